"""LoRA in the Mistral example against Hugging Face PEFT 0.21.2 + transformers 5.18.0 (CPU torch).

The oracle is PEFT's own `LoraConfig` / `get_peft_model` / `save_pretrained` /
`PeftModel.from_pretrained` on `transformers`' `MistralForCausalLM` (eager attention), and torch
autograd and `torch.optim.AdamW` for gradients and optimiser steps.
"""

import json
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import subprocess_env
from safetensors import safe_open
from test_mistral import CONFIGS, hf_logits, hf_model, max_diff, tokens

import examples.mistral7b.train as train_module
from eqx_lean.hf import (
    DecoderConfig,
    abstract_model,
    generate,
    init,
    load_adapters,
    load_hf,
    make_lora_step,
    save_adapters,
    step_memory,
)
from eqx_lean.internal import (
    LORA_TARGETS,
    from_peft,
    hf_name,
    merged_layer,
    to_peft,
    write_slice_donated,
)
from eqx_lean.lora import LoraConfig, LoraLinear, add_lora, lora_filter, lora_paths, merge_lora


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALL = list(LORA_TARGETS)
LAYERS = "base_model.model.model.layers"


def peft_model(hf, *, r: int = 4, alpha: float = 8, targets=ALL, rslora=False, seed=0, std=0.1):
    """`hf` wrapped by `peft.get_peft_model`, its adapters (A and B) drawn normal(0, `std`)."""
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        use_rslora=rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(hf, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, std)
    return model.eval()


def base_checkpoint(tmp_path: pathlib.Path, name: str = "head_dim", seed: int = 0, std=None):
    """A tiny random HF checkpoint in `tmp_path/base` (and the `transformers` model)."""
    hf = hf_model(seed=seed, **CONFIGS[name])
    if std is not None:  # HF-scale weights, so that AdamW steps move the loss smoothly
        with torch.no_grad():
            for param_name, param in hf.named_parameters():
                if "norm" not in param_name:
                    param.normal_(0.0, std)
    hf.save_pretrained(tmp_path / "base")
    return hf, tmp_path / "base"


def fresh_hf(path: pathlib.Path):
    return transformers.MistralForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


forward = eqx.filter_jit(lambda model, input_ids: model(input_ids))


def randomized(model, seed: int, std: float = 0.1):
    """`model` with every adapter matrix drawn normal(0, `std`) (fresh B is zero)."""
    adapters, frozen = eqx.partition(model, lora_filter(model))
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    return eqx.combine(jax.tree.unflatten(treedef, new), frozen)


# --- configuration ----------------------------------------------------------------------------


def test_config_scale_targets_and_round_trip():
    config = LoraConfig(
        r=16, lora_alpha=32, target_modules=("v_proj", "self_attn.q_proj", "down_proj", "v_proj")
    )
    assert config.target_modules == ("down_proj", "self_attn.q_proj", "v_proj")  # canonical
    assert config.scale == 2.0
    assert LoraConfig(r=16, lora_alpha=32, use_rslora=True).scale == 8.0
    assert from_peft(to_peft(config)) == config
    all_linear = from_peft({"target_modules": "all-linear"})
    model = abstract_model(DecoderConfig(**CONFIGS["gqa"]))
    with pytest.raises(ValueError, match="`target_modules` must name modules of `model`"):
        add_lora(model, LoraConfig(target_modules=("q",)), key=jax.random.key(0))
    adapted = lora_paths(add_lora(model, all_linear, key=jax.random.key(0)))
    assert len(adapted) == 7 and ".lm_head" not in adapted
    with pytest.raises(ValueError, match="`r` must be a positive integer"):
        LoraConfig(r=0)
    with pytest.raises(ValueError, match="`lora_dropout` must be in"):
        LoraConfig(lora_dropout=1.0)


def test_config_matches_what_peft_writes(tmp_path):
    """The fields we write are PEFT's, with PEFT's values for the same settings, and PEFT
    reads our file back as the same configuration."""
    hf, _ = base_checkpoint(tmp_path)
    wrapped = peft_model(hf, r=4, alpha=16, targets=["q_proj", "down_proj"], rslora=True)
    wrapped.save_pretrained(tmp_path / "peft")
    theirs = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    config = LoraConfig(r=4, lora_alpha=16, target_modules=("q_proj", "down_proj"), use_rslora=True)
    ours = to_peft(config, task_type="CAUSAL_LM")
    for field, value in ours.items():
        assert field in theirs, field
        if field == "target_modules":
            assert sorted(value) == sorted(theirs[field])
        else:
            assert value == theirs[field], field
    assert from_peft(theirs) == from_peft(ours)


REFUSED = [
    ("rank_pattern", {"q_proj": 8}),
    ("alpha_pattern", {"q_proj": 32}),
    ("use_dora", True),
    ("modules_to_save", ["lm_head"]),
    ("layers_to_transform", [0]),
    ("bias", "lora_only"),
    ("bias", "all"),
    ("lora_bias", True),
    ("fan_in_fan_out", True),
    ("peft_type", "IA3"),
    ("trainable_token_indices", [3, 4]),
]


@pytest.mark.parametrize(("field", "value"), REFUSED, ids=[f"{f}={v}" for f, v in REFUSED])
def test_unsupported_peft_fields_are_refused(field, value, tmp_path):
    config = dict(to_peft(LoraConfig()), **{field: value})
    with pytest.raises(ValueError, match=f"adapter config field `{field}`"):
        from_peft(config)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    model = abstract_model(DecoderConfig(**CONFIGS["gqa"]))  # refused before anything loads
    with pytest.raises(ValueError, match=f"`{field}`"):
        load_adapters(model, tmp_path)


@pytest.mark.parametrize("targets", [["q_proj", "embed_tokens"], ["embed_tokens"], "embed.*"])
def test_unknown_target_modules_are_refused(targets):
    config = from_peft(dict(to_peft(LoraConfig()), target_modules=targets))
    model = abstract_model(DecoderConfig(**CONFIGS["gqa"]))
    with pytest.raises(ValueError, match="`target_modules` must"):
        add_lora(model, config, key=jax.random.key(0), names=hf_name)


def test_tensors_the_config_does_not_name_are_refused(tmp_path):
    """A DoRA magnitude (or any tensor we would not load) must not be silently ignored."""
    hf, _ = base_checkpoint(tmp_path)
    wrapped = peft_model(hf, targets=["q_proj"])
    wrapped.save_pretrained(tmp_path / "peft")
    from safetensors.numpy import load_file, save_file

    file = tmp_path / "peft" / "adapter_model.safetensors"
    tensors = load_file(file)
    tensors[f"{LAYERS}.0.self_attn.q_proj.lora_magnitude_vector"] = np.ones(64, np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    model = load_hf(tmp_path / "base", dtype=jnp.float32)
    with pytest.raises(ValueError, match="lora_magnitude_vector"):
        load_adapters(model, tmp_path / "peft")


# --- the layer --------------------------------------------------------------------------------


def test_fresh_adapters_init_as_peft_and_leave_logits_unchanged(tmp_path):
    _, base = base_checkpoint(tmp_path)
    model = load_hf(base, dtype=jnp.float32)
    lora = add_lora(model, LoraConfig(r=4, target_modules=tuple(ALL)), key=jax.random.key(1))
    input_ids = jnp.asarray(tokens(0, batch=2, seq=12))
    np.testing.assert_array_equal(forward(lora, input_ids), forward(model, input_ids))
    q_proj = lora.layers.self_attn.q_proj
    assert isinstance(q_proj, LoraLinear)
    assert q_proj.base.weight is model.layers.self_attn.q_proj.weight  # shared, not copied
    # kaiming_uniform_(a=sqrt(5)) on A = [r, in]: uniform on +-1/sqrt(in), std 1/sqrt(3 in).
    scaled = []
    for target, (_, where) in LORA_TARGETS.items():
        layer = where(lora.layers)
        assert isinstance(layer, LoraLinear), target
        _, out_features, in_features = where(model.layers).weight.shape
        assert layer.lora_A.shape == (2, 4, in_features) and layer.lora_A.dtype == jnp.float32
        assert layer.lora_B.shape == (2, out_features, 4) and layer.lora_B.dtype == jnp.float32
        np.testing.assert_array_equal(layer.lora_B, 0.0)
        a = np.asarray(layer.lora_A)
        assert not np.array_equal(a[0], a[1])  # one draw per layer
        scaled.append(a.ravel() * np.sqrt(in_features))  # uniform on [-1, 1]
    pooled = np.concatenate(scaled)
    assert np.abs(pooled).max() <= 1 and np.abs(pooled).max() > 0.999
    assert abs(pooled.std() - 1 / np.sqrt(3)) < 0.03 / np.sqrt(3)
    assert abs(pooled.mean()) < 0.03


def test_dropout_drops_at_the_rate_and_rescales():
    """With W = 0 and A = B = I, the layer returns dropout(x): zeros at rate p, x / (1 - p)."""
    dim, rate = 64, 0.25
    layer = LoraLinear(
        base=eqx.nn.Linear(dim, dim, use_bias=False, key=jax.random.key(0)),
        lora_A=jnp.eye(dim),
        lora_B=jnp.eye(dim),
        config=LoraConfig(r=dim, lora_alpha=dim, lora_dropout=rate),
    )
    layer = eqx.tree_at(lambda m: m.base.weight, layer, jnp.zeros((dim, dim)))
    x = 1.0 + jax.random.uniform(jax.random.key(1), (256, dim))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(layer.project(x), x, rtol=1e-6)  # no key: inference
        out = np.asarray(layer.project(x, key=jax.random.key(2)))
        again = np.asarray(layer.project(x, key=jax.random.key(2)))
    np.testing.assert_array_equal(out, again)
    dropped = out == 0
    assert abs(dropped.mean() - rate) < 0.01
    np.testing.assert_allclose(out[~dropped], np.asarray(x)[~dropped] / (1 - rate), rtol=1e-6)


def test_model_dropout_uses_the_key(tmp_path):
    """With `lora_dropout > 0` a call with a key drops (differently for another key, the same
    for the same key, through `remat` too); a call without one does not (inference)."""
    _, base = base_checkpoint(tmp_path)
    config = LoraConfig(r=4, target_modules=tuple(ALL), lora_dropout=0.5)
    model = add_lora(load_hf(base, dtype=jnp.float32), config, key=jax.random.key(0))
    model = randomized(model, 1)
    input_ids = jnp.asarray(tokens(3, batch=2, seq=12))
    run = eqx.filter_jit(lambda m, ids, key: m(ids, key=key, remat=True))
    first = run(model, input_ids, jax.random.key(5))
    np.testing.assert_array_equal(run(model, input_ids, jax.random.key(5)), first)
    assert max_diff(run(model, input_ids, jax.random.key(6)), first) > 1e-3
    assert max_diff(forward(model, input_ids), first) > 1e-3


@pytest.mark.slow
def test_lora_model_generates_like_its_merge(tmp_path):
    _, base = base_checkpoint(tmp_path, "sliding_window")
    config = LoraConfig(r=4, target_modules=("q_proj", "v_proj", "down_proj"))
    model = randomized(add_lora(load_hf(base, dtype=jnp.float32), config, key=jax.random.key(0)), 2)
    prompts = jnp.asarray(tokens(4, batch=2, seq=4))
    with jax.default_matmul_precision("highest"):
        ours, logits = generate(model, prompts, 8, return_logits=True)
        merged, merged_logits = generate(merge_lora(model), prompts, 8, return_logits=True)
    assert max_diff(logits, merged_logits) <= 1e-4
    np.testing.assert_array_equal(ours, merged)


def test_adapters_are_added_to_plain_projections_only(tmp_path):
    _, base = base_checkpoint(tmp_path)
    model = add_lora(load_hf(base), LoraConfig(target_modules=("q_proj",)), key=jax.random.key(0))
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        add_lora(model, LoraConfig(target_modules=("q_proj",)), key=jax.random.key(1))
    with pytest.raises(ValueError, match="must have LoRA adapters"):
        save_adapters(load_hf(base), tmp_path / "none")


# --- parity with PEFT -------------------------------------------------------------------------

CASES = [
    pytest.param("head_dim", ALL, True, id="head_dim-all-targets-rslora"),
    pytest.param("gqa", ["q_proj", "v_proj"], False, id="gqa-qv", marks=pytest.mark.slow),
    pytest.param(
        "sliding_window", ["o_proj", "gate_proj", "up_proj", "down_proj"], False,
        id="window-o-mlp", marks=pytest.mark.slow,
    ),
]  # fmt: skip


@pytest.mark.quick
@pytest.mark.parametrize(("name", "targets", "rslora"), CASES)
def test_peft_saved_adapters_load_and_give_peft_logits(name, targets, rslora, tmp_path):
    hf, base = base_checkpoint(tmp_path, name)
    wrapped = peft_model(hf, r=4, alpha=12, targets=targets, rslora=rslora)
    wrapped.save_pretrained(tmp_path / "peft")
    input_ids = tokens(1, batch=2, seq=16)
    expected = hf_logits(wrapped, input_ids)
    model = load_adapters(load_hf(base, dtype=jnp.float32), tmp_path / "peft")
    with jax.default_matmul_precision("highest"):
        ours = forward(model, jnp.asarray(input_ids))
    assert max_diff(ours, expected) <= 1e-4
    assert max_diff(expected, hf_logits(fresh_hf(base), input_ids)) > 1e-2  # adapters matter


@pytest.mark.parametrize(("name", "targets", "rslora"), CASES)
def test_saved_adapters_load_in_peft_with_the_same_logits(name, targets, rslora, tmp_path):
    _, base = base_checkpoint(tmp_path, name)
    config = LoraConfig(r=4, lora_alpha=12, target_modules=tuple(targets), use_rslora=rslora)
    model = add_lora(load_hf(base, dtype=jnp.float32), config, key=jax.random.key(3))
    model = randomized(model, seed=4)
    save_adapters(model, tmp_path / "ours")
    assert sorted(os.listdir(tmp_path / "ours")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    loaded = peft.PeftModel.from_pretrained(fresh_hf(base), tmp_path / "ours").eval()
    input_ids = tokens(2, batch=2, seq=16)
    with jax.default_matmul_precision("highest"):
        ours = forward(model, jnp.asarray(input_ids))
    assert max_diff(ours, hf_logits(loaded, input_ids)) <= 1e-4
    # Every tensor that PEFT itself writes for these settings, with its shape and dtype.
    peft_model(fresh_hf(base), r=4, targets=targets).save_pretrained(tmp_path / "theirs")

    def header(directory):
        with safe_open(str(directory / "adapter_model.safetensors"), "np") as f:
            return {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}

    assert header(tmp_path / "ours") == header(tmp_path / "theirs")


def _torch_lora_grads(wrapped) -> dict[str, np.ndarray]:
    return {
        name.replace(".default", ""): param.grad.numpy().copy()
        for name, param in wrapped.named_parameters()
        if param.requires_grad
    }


def _our_grads(grads, num_layers: int) -> dict[str, np.ndarray]:
    out = {}
    for path, where in LORA_TARGETS.values():
        layer = where(grads.layers)
        if not isinstance(layer, LoraLinear):
            continue
        for matrix in ("lora_A", "lora_B"):
            stacked = np.asarray(getattr(layer, matrix))
            for i in range(num_layers):
                out[f"{LAYERS}.{i}.{path}.{matrix}.weight"] = stacked[i]
    return out


@pytest.mark.parametrize(("name", "targets", "rslora"), CASES)
def test_loss_and_adapter_gradients_match_torch_autograd(name, targets, rslora, tmp_path):
    hf, base = base_checkpoint(tmp_path, name, seed=5, std=0.05)
    wrapped = peft_model(hf, r=4, alpha=8, targets=targets, rslora=rslora, std=0.05)
    wrapped.save_pretrained(tmp_path / "peft")
    batch = tokens(6, batch=3, seq=16)
    ids = torch.from_numpy(batch.astype(np.int64))
    wrapped.train()
    loss = wrapped(ids, labels=ids).loss
    loss.backward()
    expected = _torch_lora_grads(wrapped)

    model = load_adapters(load_hf(base, dtype=jnp.float32), tmp_path / "peft")
    adapters, frozen = eqx.partition(model, lora_filter(model))

    def loss_of(adapters):
        return train_module.next_token_loss(eqx.combine(adapters, frozen), jnp.asarray(batch))

    with jax.default_matmul_precision("highest"):
        ours, grads = jax.jit(jax.value_and_grad(loss_of))(adapters)
    np.testing.assert_allclose(float(ours), loss.item(), rtol=1e-4)
    got = _our_grads(grads, model.config.num_hidden_layers)
    num_layers = model.config.num_hidden_layers
    assert sorted(got) == sorted(expected) and len(got) == 2 * len(targets) * num_layers
    for tensor, reference in expected.items():
        scale = np.abs(reference).max()
        assert scale > 0, tensor
        assert np.abs(got[tensor] - reference).max() <= 1e-4 * scale, tensor


@pytest.mark.parametrize(("name", "targets", "rslora"), CASES)
def test_first_five_adamw_losses_match_peft_and_torch_adamw(name, targets, rslora, tmp_path):
    hf, base = base_checkpoint(tmp_path, name, seed=7, std=0.05)
    wrapped = peft_model(hf, r=4, alpha=8, targets=targets, rslora=rslora, std=0.05)
    wrapped.save_pretrained(tmp_path / "peft")
    text = train_module.load_text()  # ASCII: every byte is a valid id of the 128-token vocab
    data = train_module.batches(text, batch_size=4, seq_len=24, seed=0)
    input_batches = [next(data) for _ in range(5)]
    lr, weight_decay = 1e-2, 0.01

    wrapped.train()
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    torch_adamw = torch.optim.AdamW(
        trainable, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay
    )
    expected = []
    for batch in input_batches:
        ids = torch.from_numpy(batch.astype(np.int64))
        loss = wrapped(ids, labels=ids).loss
        expected.append(loss.item())
        torch_adamw.zero_grad()
        loss.backward()
        torch_adamw.step()

    model = load_adapters(load_hf(base, dtype=jnp.float32), tmp_path / "peft")
    adapters, frozen = eqx.partition(model, lora_filter(model))
    optimizer = train_module.adamw(lr, weight_decay)
    opt_state = optimizer.init(adapters)
    step = make_lora_step(optimizer, remat=True)
    losses = []
    with jax.default_matmul_precision("highest"):
        for batch in input_batches:
            adapters, opt_state, loss = step(frozen, adapters, opt_state, jnp.asarray(batch), None)
            losses.append(float(loss))
    assert len(set(expected)) == 5 and expected[-1] < expected[0]
    np.testing.assert_allclose(losses, expected, rtol=1e-4)


@pytest.mark.parametrize(("name", "targets", "rslora"), CASES)
def test_merged_checkpoint_gives_peft_logits_in_transformers(name, targets, rslora, tmp_path):
    hf, base = base_checkpoint(tmp_path, name)
    wrapped = peft_model(hf, r=4, alpha=8, targets=targets, rslora=rslora)
    wrapped.save_pretrained(tmp_path / "peft")
    input_ids = tokens(8, batch=2, seq=16)
    expected = hf_logits(wrapped, input_ids)
    from eqx_lean.hf import save_hf

    model = load_adapters(load_hf(base, dtype=jnp.float32), tmp_path / "peft")
    save_hf(merge_lora(model), tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", attn_implementation="eager"
    ).eval()
    assert max_diff(hf_logits(merged, input_ids), expected) <= 1e-4
    # Not donated: the LoRA model (and the base it shares) still runs, unchanged.
    with jax.default_matmul_precision("highest"):
        assert max_diff(forward(model, jnp.asarray(input_ids)), expected) <= 1e-4


def test_merge_writes_each_layer_in_place():
    """The per-layer merge reads one layer (float32 temporaries of one layer at most) and writes
    it back in place: the write aliases the donated stack and needs no temporaries."""
    layers, out_features, in_features, r = 8, 512, 256, 4
    weight = jax.ShapeDtypeStruct((layers, out_features, in_features), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((layers, r, in_features), jnp.float32)
    b = jax.ShapeDtypeStruct((layers, out_features, r), jnp.float32)
    index = jax.ShapeDtypeStruct((), jnp.int32)
    scale = jax.ShapeDtypeStruct((), jnp.float32)
    read = (
        merged_layer.lower(weight, a, b, scale, index, bit_reads=True).compile().memory_analysis()
    )
    layer = jax.ShapeDtypeStruct((out_features, in_features), jnp.bfloat16)
    write = write_slice_donated.lower(weight, layer, index, bit_writes=True)
    write = write.compile().memory_analysis()
    assert read is not None and write is not None
    layer_f32 = out_features * in_features * 4
    assert read.temp_size_in_bytes <= 1.1 * layer_f32
    assert read.output_size_in_bytes == layer_f32 // 2
    assert write.alias_size_in_bytes == layers * layer_f32 // 2
    assert write.temp_size_in_bytes == 0


def test_bfloat16_lora_logits_within_twice_peft_own_error(tmp_path):
    """A bfloat16 base with float32 adapters (PEFT's default, `autocast_adapter_dtype`)."""
    hf, base = base_checkpoint(tmp_path, "sliding_window")
    wrapped = peft_model(hf, r=4, alpha=8)
    wrapped.save_pretrained(tmp_path / "peft")
    input_ids = tokens(9, batch=2, seq=16)
    reference = hf_logits(wrapped, input_ids)
    bf16 = peft.PeftModel.from_pretrained(fresh_hf(base).to(torch.bfloat16), tmp_path / "peft")
    lora_dtypes = {p.dtype for n, p in bf16.named_parameters() if "lora_" in n}
    assert lora_dtypes == {torch.float32}
    peft_error = max_diff(hf_logits(bf16.eval(), input_ids), reference)
    model = load_adapters(load_hf(base, dtype=jnp.bfloat16), tmp_path / "peft")
    ours = forward(model, jnp.asarray(input_ids))
    assert ours.dtype == jnp.bfloat16
    assert max_diff(ours, reference) <= 2 * peft_error


# --- training step memory ---------------------------------------------------------------------


def test_step_memory_reports_the_adapters_and_their_optimizer_state():
    config = DecoderConfig(**CONFIGS["gqa"])
    lora_config = LoraConfig(r=4, target_modules=tuple(ALL))
    plan = step_memory(config, lora_config, batch_size=1, seq_len=16)
    per_layer = (
        4 * (64 + 64) + 4 * (64 + 32) * 2 + 4 * (64 + 64) + 4 * (64 + 96) * 2 + 4 * (96 + 64)
    )
    assert plan["adapters"] == 3 * per_layer * 4
    assert plan["optimizer"] == 2 * plan["adapters"] + 4  # two moments and the step count
    assert plan["alias"] >= plan["adapters"] + plan["optimizer"]  # both updated in place
    base = eqx.filter_eval_shape(init, config, key=jax.random.key(0))
    assert plan["base"] == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(base))


# --- the command line -------------------------------------------------------------------------


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "examples.mistral7b", *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_finetune_and_merge_commands_end_to_end(tmp_path):
    hf = hf_model(seed=11, **dict(CONFIGS["sliding_window"], vocab_size=256))
    hf.save_pretrained(tmp_path / "base")
    text = tmp_path / "data.jsonl"
    text.write_text(
        "".join(json.dumps({"text": f"document {i}: " + "abc " * 20}) + "\n" for i in range(8))
    )
    done = _run(
        "finetune", "--checkpoint", str(tmp_path / "base"), "--data", str(text), "--rank", "2",
        "--targets", "q", "v", "down", "--steps", "3", "--seq-len", "16", "--batch-size", "2",
        "--lr", "1e-2", "--save-adapters", str(tmp_path / "adapters"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "s/step" in done.stdout and "peak RSS" in done.stdout
    assert "finetune" in done.stderr  # the tqdm bar
    saved = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"]) == (2, 4)
    assert sorted(saved["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    loaded = peft.PeftModel.from_pretrained(fresh_hf(tmp_path / "base"), tmp_path / "adapters")
    ours = load_adapters(load_hf(tmp_path / "base", dtype=jnp.float32), tmp_path / "adapters")
    q_proj = ours.layers.self_attn.q_proj
    assert isinstance(q_proj, LoraLinear) and np.abs(np.asarray(q_proj.lora_B)).max() > 0
    input_ids = tokens(10, batch=2, seq=12, vocab=256)
    with jax.default_matmul_precision("highest"):
        logits = forward(ours, jnp.asarray(input_ids))
    assert max_diff(logits, hf_logits(loaded.eval(), input_ids)) <= 1e-4

    done = _run(
        "merge", "--checkpoint", str(tmp_path / "base"), "--adapters", str(tmp_path / "adapters"),
        "--out", str(tmp_path / "merged"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert max_diff(hf_logits(fresh_hf(tmp_path / "merged"), input_ids), logits) <= 1e-4


def test_adapter_config_and_weights_come_from_one_save_when_a_save_lands_during_the_load(
    tmp_path, when_load_files_are_open
):
    # Two adapter saves of the same shapes but another `lora_alpha` and other matrices: a config
    # read apart from the weights would scale the matrices of one by the alpha of the other.
    model = init(DecoderConfig(**CONFIGS["head_dim"], dtype="float32"), key=jax.random.key(0))
    older = randomized(add_lora(model, LoraConfig(r=4, lora_alpha=8), key=jax.random.key(1)), 1)
    newer = randomized(add_lora(model, LoraConfig(r=4, lora_alpha=32), key=jax.random.key(2)), 2)
    path = tmp_path / "adapters"
    save_adapters(older, path)
    saved = when_load_files_are_open(lambda: save_adapters(newer, path))
    loaded = load_adapters(model, path)
    assert saved
    input_ids = jnp.asarray(tokens(0, batch=2, seq=12))
    np.testing.assert_allclose(
        forward(loaded, input_ids), forward(newer, input_ids), rtol=1e-6, atol=1e-6
    )
    assert not np.allclose(forward(older, input_ids), forward(newer, input_ids), atol=1e-3)


@pytest.mark.parametrize("saved_layers, model_layers", [(4, 2), (2, 4)])
def test_adapters_of_another_layer_count_are_refused_naming_both(
    tmp_path, saved_layers, model_layers
):
    def model_of(layers):
        config = DecoderConfig(**(CONFIGS["head_dim"] | {"num_hidden_layers": layers}))
        return init(config, key=jax.random.key(0))

    save_adapters(
        add_lora(model_of(saved_layers), LoraConfig(r=2), key=jax.random.key(1)), tmp_path
    )
    with pytest.raises(
        ValueError,
        match=rf"adapter_model.safetensors holds adapters for {saved_layers} layers "
        rf"\('base_model.model.model.layers.0.…' to .*, but `model` has {model_layers}: adapters "
        "load only onto a model with the layers they were trained on",
    ):
        load_adapters(model_of(model_layers), tmp_path)


def test_a_missing_adapter_config_is_named_with_or_without_the_weights(tmp_path):
    model = init(DecoderConfig(**CONFIGS["head_dim"]), key=jax.random.key(0))
    save_adapters(add_lora(model, LoraConfig(r=2), key=jax.random.key(1)), tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").unlink()
    (tmp_path / "b").mkdir()
    for directory in ("a", "b"):  # read with the weights; read alone, the weights missing too
        with pytest.raises(
            FileNotFoundError,
            match=r"`path` must be a PEFT adapter directory; .*adapter_config.json is missing",
        ):
            load_adapters(model, tmp_path / directory)
