"""Quantised loads of HF checkpoints, against `quantize_linears` of the plain load and against
transformers + bitsandbytes 0.50.2 (4-bit NF4 on CPU, float32 compute) and PEFT on top."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mistral import TINY, hf_logits, hf_model, max_diff, tokens
from test_mistral_lora import randomized

import eqx_lean
from eqx_lean.hf import load_adapters, load_hf, save_adapters
from eqx_lean.lora import LoraConfig, add_lora
from eqx_lean.quant import QuantConfig, QuantizedLinear, quantize_linears


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bitsandbytes = pytest.importorskip("bitsandbytes")

# 128 x 64 and 64 x 128 MLP matrices, 64 x 64 and 32 x 64 attention ones: bitsandbytes' CPU
# kernels need input sizes that are multiples of the block size.
CONFIG = dict(TINY, intermediate_size=128, num_hidden_layers=3)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant_hf") / "base"
    hf_model(seed=0, **CONFIG).save_pretrained(path)
    return path


def _bnb_model(path, double_quant: bool = False, dtype=None):
    dtype = torch.float32 if dtype is None else dtype
    settings = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_use_double_quant=double_quant,
    )
    model = transformers.MistralForCausalLM.from_pretrained(
        path,
        quantization_config=settings,
        device_map="cpu",
        dtype=dtype,
        attn_implementation="eager",
    ).eval()
    # On a CPU with AVX512-BF16 (as this one), bitsandbytes' inference repacks each weight
    # for a bfloat16 kernel, rounding the scales to bfloat16 (`_convert_weight_packed_for_cpu`).
    # The reference is its path on every other CPU and in training: `dequantize_4bit`, then a
    # product in the compute dtype.
    for module in model.modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


@pytest.mark.parametrize(
    "config", [QuantConfig(), QuantConfig(double_quant=True), QuantConfig("int8")], ids=str
)
def test_quantised_load_equals_quantising_the_loaded_model(checkpoint, config, monkeypatch):
    from eqx_lean.internal import quant_load

    monkeypatch.setattr(quant_load, "_CHUNK_VALUES", 100)  # many chunks per tensor
    got = load_hf(checkpoint, dtype=jnp.bfloat16, quantize=config)
    want = quantize_linears(load_hf(checkpoint, dtype=jnp.bfloat16), config)
    assert isinstance(got.layers.mlp.up_proj, QuantizedLinear)
    assert got.lm_head is None or not isinstance(got.lm_head, QuantizedLinear)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_logits_match_transformers_bitsandbytes(checkpoint, double_quant):
    ours = load_hf(checkpoint, dtype=jnp.float32, quantize=QuantConfig(double_quant=double_quant))
    theirs = _bnb_model(checkpoint, double_quant)  # (codes: see tests/test_quant.py)
    input_ids = tokens(1, batch=2, seq=16)
    with jax.default_matmul_precision("highest"):
        logits = ours(jnp.asarray(input_ids))
    assert max_diff(logits, hf_logits(theirs, input_ids)) <= 1e-4
    # Quantisation is not a no-op: the full-precision model's logits are far away.
    plain = load_hf(checkpoint, dtype=jnp.float32)
    with jax.default_matmul_precision("highest"):
        assert max_diff(plain(jnp.asarray(input_ids)), logits) > 1e-2


def test_nf4_bfloat16_logits_are_as_close_to_bitsandbytes_as_bfloat16_allows(checkpoint):
    """With bfloat16 products (and bfloat16 activations) on both sides, the logits differ by
    bfloat16's rounding through the network, not by the quantisation: measured 0.27 on logits
    up to 7.8 (0.28 with bitsandbytes' AVX512-BF16 kernel), while each side is 1.41 from the
    float32 computation of the same NF4 weights."""
    input_ids = tokens(1, batch=2, seq=16)
    ours = load_hf(checkpoint, dtype=jnp.bfloat16, quantize="nf4")(jnp.asarray(input_ids))
    theirs = hf_logits(_bnb_model(checkpoint, dtype=torch.bfloat16), input_ids)
    with jax.default_matmul_precision("highest"):
        exact = load_hf(checkpoint, dtype=jnp.float32, quantize="nf4")(jnp.asarray(input_ids))
    difference = max_diff(np.asarray(ours, np.float32), theirs)
    assert difference <= 0.35
    assert difference <= 0.5 * max_diff(np.asarray(ours, np.float32), np.asarray(exact))


def test_qlora_adapters_load_in_peft_on_bitsandbytes_and_back(checkpoint, tmp_path):
    base = load_hf(checkpoint, dtype=jnp.float32, quantize="nf4")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS)
    lora = randomized(add_lora(base, config, key=jax.random.key(0)), seed=1)
    save_adapters(lora, tmp_path / "ours")
    input_ids = tokens(2, batch=2, seq=16)
    with jax.default_matmul_precision("highest"):
        ours = lora(jnp.asarray(input_ids))
    in_peft = peft.PeftModel.from_pretrained(_bnb_model(checkpoint), tmp_path / "ours").eval()
    assert max_diff(ours, hf_logits(in_peft, input_ids)) <= 1e-4
    # The reverse: adapters made by PEFT on bitsandbytes' 4-bit model, loaded here.
    wrapped = peft.get_peft_model(
        _bnb_model(checkpoint),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, task_type="CAUSAL_LM"),
    )
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.add_(0.1 * torch.randn_like(param))
    wrapped.save_pretrained(tmp_path / "theirs")
    loaded = load_adapters(base, tmp_path / "theirs")
    assert isinstance(loaded.layers.self_attn.q_proj.base, QuantizedLinear)
    with jax.default_matmul_precision("highest"):
        mine = loaded(jnp.asarray(input_ids))
    assert max_diff(mine, hf_logits(wrapped.eval(), input_ids)) <= 1e-4


def test_prequantised_checkpoints_are_refused_naming_quantization_config(checkpoint, tmp_path):
    _bnb_model(checkpoint).save_pretrained(tmp_path / "bnb")
    assert "quantization_config" in json.loads((tmp_path / "bnb" / "config.json").read_text())
    with pytest.raises(
        ValueError, match=r"config.json has a `quantization_config` \('bitsandbytes'\)"
    ):
        load_hf(tmp_path / "bnb")


def test_quantised_load_errors(checkpoint):
    with pytest.raises(ValueError, match="`quantize` must be None, 'nf4', 'int8'"):
        load_hf(checkpoint, quantize="fp4")
    with pytest.raises(ValueError, match=r"entries \['gate'\] name no linear layer"):
        load_hf(checkpoint, quantize=QuantConfig(target_modules=["gate"]))
    assert eqx_lean.quant.QuantizedLinear is QuantizedLinear


def test_quantised_load_is_strict_about_extra_tensors(checkpoint, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    extra = tmp_path / "extra"
    shutil.copytree(checkpoint, extra)
    tensors = load_file(extra / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, extra / "model.safetensors", metadata={"format": "pt"})
    extra_named = r"that no leaf of `like` is named for: 'model.layers.0.mlp.extra"
    with pytest.raises(ValueError, match=extra_named):
        load_hf(extra, quantize="nf4")
    loaded = load_hf(extra, quantize="nf4", strict=False)
    assert isinstance(loaded.layers.mlp.up_proj, QuantizedLinear)
