"""`eqx_lean.hf.plan_lora_step`, `fsdp_shardings` and `python -m eqx_lean.memory lora`.

The expected argument bytes are counted from the configuration by hand (the decoder's weight
shapes as Hugging Face defines them), not from the planner's own structs.
"""

import json
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from harness import TINY_DECODER, needs_gpu_plugin
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_lean
from eqx_lean.hf import (
    DecoderConfig,
    abstract_model,
    fsdp_shardings,
    lora_config_of_rank,
    next_token_loss,
    plan_lora_step,
)


# Every weight's largest dimension is a multiple of 8, so fsdp over 8 devices splits it evenly.
TINY: dict[str, Any] = TINY_DECODER
RANK = 4


def _counts(c: dict) -> tuple[int, int]:
    """(frozen base parameters, adapter parameters of rank RANK on all seven projections)."""
    h, i, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    head_dim = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    # (in, out) of q, k, v, o, gate, up, down
    projections = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    per_layer = sum(a * b for a, b in projections) + 2 * h  # and two RMSNorm weights
    base = v * h + n * per_layer + h + v * h  # embedding, layers, final norm, LM head
    adapters = n * sum(RANK * (a + b) for a, b in projections)
    return base, adapters


@needs_gpu_plugin
@pytest.mark.parametrize("axes", [None, (("data", 2), ("fsdp", 4))])
def test_plan_lora_step_bytes_by_hand(axes):
    config = DecoderConfig(**TINY)
    plan = plan_lora_step(
        config,
        "8xh100",
        batch_size=16,
        seq_len=32,
        lora_config=lora_config_of_rank(RANK),
        mesh_axes=axes,
    )
    assert (plan.platform, plan.num_devices, plan.fits) == ("gpu", 8, True)
    fsdp = 8 if axes is None else 4
    base, adapters = _counts(TINY)
    ids = 16 * 32 * 4 // 8  # int32 token ids, rows split over all 8 devices
    # bfloat16 base and float32 adapters with two float32 AdamW moments, all fully sharded;
    # the rest are the optimizer's int32 step counts, replicated.
    sharded = (2 * base + 3 * 4 * adapters) // fsdp + ids
    counts = plan.argument - sharded
    assert counts % 4 == 0 and 0 < counts <= 16, (plan.argument, sharded)
    # The adapters and the optimizer state are donated and updated in place.
    assert plan.alias >= 3 * 4 * adapters // fsdp


@needs_gpu_plugin
def test_plan_lora_step_errors():
    config = DecoderConfig(**TINY)
    with pytest.raises(ValueError, match="multiple of the number of devices \\(8\\)"):
        plan_lora_step(config, "8xh100", batch_size=4, seq_len=8)
    with pytest.raises(ValueError, match="mesh_axes names must be 'data' and 'fsdp'"):
        plan_lora_step(config, "8xh100", batch_size=8, seq_len=8, mesh_axes=[("model", 8)])


@needs_gpu_plugin
def test_fsdp_shardings_split_the_largest_dividable_dimension():
    mesh = eqx_lean.memory.target("8xh100").mesh((8,), ("fsdp",))
    tree = {
        "wide": jax.ShapeDtypeStruct((24, 64), jnp.float32),  # 64 is the largest: split it
        "odd_largest": jax.ShapeDtypeStruct((12, 9, 16), jnp.float32),  # 12, 9 are not: 16
        "none_divide": jax.ShapeDtypeStruct((3, 5), jnp.float32),
        "static": "not an array",
    }
    got = fsdp_shardings(tree, mesh)
    assert got["wide"] == NamedSharding(mesh, P(None, "fsdp"))
    assert got["odd_largest"] == NamedSharding(mesh, P(None, None, "fsdp"))
    assert got["none_divide"] == NamedSharding(mesh, P())
    assert got["static"] is None


@needs_gpu_plugin
def test_cli_plans_a_lora_step(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, model_type="mistral")))
    out = subprocess.run(
        [sys.executable, "-m", "eqx_lean.memory", "lora", "8xh100"]
        + ["--config", str(tmp_path / "config.json"), "--seq-len", "16", "--rank", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # One row per device by default.
    assert "batch 8 x 16 tokens" in out.stdout
    assert "plan for 8xh100 (8 x gpu), per device: fits" in out.stdout


@needs_gpu_plugin
def test_plan_train_step_of_the_decoder_on_a_target_default_mesh():
    """`memory.plan_train_step` of the decoder's loss on `target.mesh`'s default (Explicit)
    axes, ids split by rows: it failed at the embedding lookup (issue 39). The plan is the one
    made on the same mesh with Auto axes, where XLA chooses every sharding."""
    optax = pytest.importorskip("optax")
    config = DecoderConfig(**TINY)
    target = eqx_lean.memory.target("8xh100")

    def plan_on(mesh: Any) -> Any:
        model = abstract_model(config)
        placed = fsdp_shardings(model, mesh)
        model = jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            model,
            placed,
        )
        ids = jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=NamedSharding(mesh, P("fsdp")))
        return eqx_lean.memory.plan_train_step(
            next_token_loss, model, optax.adamw(1e-4), ids, target=target
        )

    explicit = plan_on(target.mesh((8,), ("fsdp",)))
    auto = plan_on(target.mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,)))
    assert (explicit.platform, explicit.num_devices, explicit.fits) == ("gpu", 8, True)
    assert (explicit.argument, explicit.output, explicit.alias) == (
        auto.argument,
        auto.output,
        auto.alias,
    )
