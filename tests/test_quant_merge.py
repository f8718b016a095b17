"""Saving quantised models as HF checkpoints: dequantised one layer at a time, with LoRA
adapters merged as each layer is written (`save_hf(..., merge_adapters=True)`), against
bitsandbytes' `dequantize_4bit`, `merge_lora` of the dequantised model, and transformers +
PEFT on bitsandbytes' 4-bit model."""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_mistral import hf_logits, max_diff, tokens
from test_mistral_lora import randomized
from test_quant_hf import CONFIG, PROJECTIONS, _bnb_model

import eqx_lean
from eqx_lean.hf import load_hf, save_adapters, save_hf
from eqx_lean.internal import ComputedTensor
from eqx_lean.lora import LoraConfig, LoraLinear, add_lora, merge_lora
from eqx_lean.quant import QuantizedLinear, dequantized_linear


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bitsandbytes = pytest.importorskip("bitsandbytes")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from test_mistral import hf_model

    path = tmp_path_factory.mktemp("quant_merge") / "base"
    hf_model(seed=4, **CONFIG).save_pretrained(path)
    return path


def _tensors(path) -> dict[str, np.ndarray]:
    return safetensors_numpy.load_file(path / "model.safetensors")


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _dequantised(model):
    """`model` with every quantised base replaced by its dequantised `eqx.nn.Linear`."""

    def plain(node):
        return dequantized_linear(node) if isinstance(node, QuantizedLinear) else node

    return jax.tree.map(plain, model, is_leaf=lambda x: isinstance(x, QuantizedLinear))


def test_quantised_model_saves_bitsandbytes_dequantised_weights(checkpoint, tmp_path):
    model = load_hf(checkpoint, dtype=jnp.bfloat16, quantize="nf4")
    save_hf(model, tmp_path / "out")
    saved, source = _tensors(tmp_path / "out"), _tensors(checkpoint)
    assert set(saved) == set(source)
    for name, value in saved.items():
        assert value.dtype == ml_dtypes.bfloat16, name
        original = torch.from_numpy(source[name]).to(torch.bfloat16)
        if any(f".{p}." in name for p in PROJECTIONS):
            # bitsandbytes quantises the bfloat16 weight and decodes it to bfloat16.
            packed, state = bitsandbytes.functional.quantize_4bit(
                original, blocksize=64, quant_type="nf4"
            )
            original = bitsandbytes.functional.dequantize_4bit(packed, state)
        expected = original.view(torch.uint16).numpy()
        np.testing.assert_array_equal(_bits(value), expected, err_msg=name)


def test_merge_into_a_quantised_base_equals_merging_the_dequantised_model(checkpoint, tmp_path):
    base = load_hf(checkpoint, dtype=jnp.bfloat16, quantize="nf4")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS)
    model = randomized(add_lora(base, config, key=jax.random.key(0)), seed=2)
    input_ids = jnp.asarray(tokens(5, batch=1, seq=8))
    before = model(input_ids)
    save_hf(model, tmp_path / "merged", merge_adapters=True)
    save_hf(merge_lora(_dequantised(model)), tmp_path / "reference")
    merged, reference = _tensors(tmp_path / "merged"), _tensors(tmp_path / "reference")
    assert set(merged) == set(reference)
    for name in merged:
        np.testing.assert_array_equal(_bits(merged[name]), _bits(reference[name]), err_msg=name)
    # The adapters are in: each merged projection differs from the plain dequantised save.
    save_hf(base, tmp_path / "base")
    plain = _tensors(tmp_path / "base")
    weight = "model.layers.1.mlp.down_proj.weight"
    delta = np.asarray(merged[weight], np.float32) - np.asarray(plain[weight], np.float32)
    a = np.asarray(model.layers.mlp.down_proj.lora_A[1], np.float64)
    b = np.asarray(model.layers.mlp.down_proj.lora_B[1], np.float64)
    np.testing.assert_allclose(
        delta,
        config.scale * b @ a,
        atol=2 * 2.0**-8 * np.abs(plain[weight].astype(np.float32)).max(),
    )
    # Nothing was changed in place: the model still computes what it did.
    np.testing.assert_array_equal(np.asarray(model(input_ids)), np.asarray(before))
    assert isinstance(model.layers.mlp.down_proj, LoraLinear)


def test_merged_quantised_checkpoint_gives_peft_bitsandbytes_logits(checkpoint, tmp_path):
    base = load_hf(checkpoint, dtype=jnp.float32, quantize="nf4")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS)
    model = randomized(add_lora(base, config, key=jax.random.key(0)), seed=3)
    save_adapters(model, tmp_path / "adapters")
    save_hf(model, tmp_path / "merged", merge_adapters=True)
    input_ids = tokens(6, batch=2, seq=16)
    # The oracle: PEFT's adapters on bitsandbytes' 4-bit base, unmerged.
    in_peft = peft.PeftModel.from_pretrained(_bnb_model(checkpoint), tmp_path / "adapters")
    expected = hf_logits(in_peft.eval(), input_ids)
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", attn_implementation="eager"
    ).eval()
    assert max_diff(hf_logits(merged, input_ids), expected) <= 1e-4
    # And the merge is not a no-op: the base alone is far from it.
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="eager"
    ).eval()
    assert max_diff(hf_logits(plain, input_ids), expected) > 1e-2


def test_merge_on_save_into_a_plain_base_equals_merge_lora(checkpoint, tmp_path):
    base = load_hf(checkpoint, dtype=jnp.bfloat16)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    model = randomized(add_lora(base, config, key=jax.random.key(1)), seed=4)
    weight = model.layers.mlp.down_proj.base.weight
    save_hf(model, tmp_path / "merged", merge_adapters=True)
    assert not weight.is_deleted()
    save_hf(merge_lora(model), tmp_path / "reference")
    merged, reference = _tensors(tmp_path / "merged"), _tensors(tmp_path / "reference")
    for name in merged:
        np.testing.assert_array_equal(_bits(merged[name]), _bits(reference[name]), err_msg=name)


def test_saving_adapters_unmerged_is_refused_naming_merge_adapters(checkpoint, tmp_path):
    base = load_hf(checkpoint, quantize="nf4")
    model = add_lora(base, LoraConfig(r=2, target_modules=["q_proj"]), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"`merge_adapters=True`"):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_computed_tensor_of_the_wrong_shape_leaves_the_checkpoint_unchanged(tmp_path):
    good = {"w": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)}
    eqx_lean.save_tensors(tmp_path / "ckpt", good, {"w": "w.{i}"})
    before = (tmp_path / "ckpt" / "model.safetensors").read_bytes()
    bad = {"w": ComputedTensor((2, 3), np.float32, lambda layer: np.zeros((4,), np.float32))}
    with pytest.raises(ValueError, match=r"must give float32\[3\] for 'w.0'; it gave float32\[4\]"):
        eqx_lean.save_tensors(tmp_path / "ckpt", bad, {"w": "w.{i}"})
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == before
    # A right one is written as computed, one layer per call.
    calls = []

    def read(layer):
        calls.append(layer)
        return np.full((3,), layer, np.float32)

    eqx_lean.save_tensors(
        tmp_path / "ckpt", {"w": ComputedTensor((2, 3), np.float32, read)}, {"w": "w.{i}"}
    )
    assert sorted(calls) == [0, 1]
    loaded = _tensors(tmp_path / "ckpt")
    np.testing.assert_array_equal(loaded["w.1"], np.ones(3, np.float32))
    assert eqx.is_array(good["w"])
