"""`eqx_lean.hf.load_hf` (`eqx_lean/hf/_checkpoint.py`) refuses a checkpoint whose
config does not describe its weights, and tensors it would not load; `strict=False` opts out.
Also `DecoderConfig.from_json`'s messages (`eqx_lean/hf/_config.py`)."""

import dataclasses
import json
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from harness import MICRO_DECODER

from eqx_lean.hf import DecoderConfig, abstract_model, init, load_hf, save_hf


TINY: dict[str, Any] = dict(MICRO_DECODER, num_hidden_layers=4)


def checkpoint(path, **overrides):
    config = DecoderConfig(**(TINY | overrides))
    model = init(config, key=jax.random.key(0), std=0.2, norm_std=0.5)
    save_hf(model, path)
    return model


def set_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | fields))


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_hf_writes_given_files_in_the_same_directory(tmp_path):
    # How `merge` carries the base's tokenizer files: copied from a path, or given as bytes.
    tokenizer = tmp_path / "base_tokenizer.json"
    tokenizer.write_text('{"model": "stand-in"}')
    model = init(DecoderConfig(**TINY), key=jax.random.key(0))
    files = {"tokenizer.json": tokenizer, "generation_config.json": b"{}"}
    save_hf(model, tmp_path / "out", files=files)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": "stand-in"}'
    assert (tmp_path / "out" / "generation_config.json").read_bytes() == b"{}"
    assert_same(load_hf(tmp_path / "out"), model)
    with pytest.raises(ValueError, match=r"`files` must not hold 'config.json'"):
        save_hf(model, tmp_path / "other", files={"config.json": b"{}"})
    assert not (tmp_path / "other").exists()


def test_config_with_fewer_layers_than_the_weights_is_refused(tmp_path):
    model = checkpoint(tmp_path, num_hidden_layers=6)
    set_config(tmp_path, num_hidden_layers=4)
    with pytest.raises(ValueError) as info:
        load_hf(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "config.json") in message
    assert "says num_hidden_layers=4, but the weights" in message and "hold 6 layers" in message
    assert "pass `strict=False` to load its first 4 layers" in message
    # strict=False: the config's layers, the first 4 of the 6.
    loaded = load_hf(tmp_path, strict=False)
    first = eqx.tree_at(
        lambda m: m.layers,
        model,
        jax.tree.map(lambda x: x[:4], model.layers),
    )
    assert_same(loaded.layers, first.layers)
    assert_same(loaded.embed_tokens, model.embed_tokens)


def test_config_with_more_layers_than_the_weights_is_refused_even_when_not_strict(tmp_path):
    checkpoint(tmp_path, num_hidden_layers=2)
    set_config(tmp_path, num_hidden_layers=4)
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"says num_hidden_layers=4, but .* hold 2 layers"):
            load_hf(tmp_path, strict=strict)


def test_config_shapes_must_match_the_weights(tmp_path):
    checkpoint(tmp_path)
    set_config(tmp_path, intermediate_size=32)
    for strict in (True, False):
        with pytest.raises(ValueError) as info:
            load_hf(tmp_path, strict=strict)
        message = str(info.value)
        assert f"{tmp_path / 'config.json'} does not match the weights" in message
        assert "'model.layers.0.mlp.gate_proj.weight' the shape [32, 16]" in message
        assert "the weights hold [24, 16]" in message


def test_tensors_the_model_does_not_load_are_refused(tmp_path):
    model = checkpoint(tmp_path)
    extra = {"model.layers.1.mlp.extra": np.zeros(3, np.float32), "score.weight": np.zeros(2)}
    safetensors.numpy.save_file(extra, tmp_path / "extra.safetensors")
    with pytest.raises(ValueError) as info:
        load_hf(tmp_path)
    assert "'model.layers.1.mlp.extra' (in extra.safetensors)" in str(info.value)
    (tmp_path / "extra.safetensors").unlink()
    safetensors.numpy.save_file({"score.weight": np.zeros(2)}, tmp_path / "extra.safetensors")
    with pytest.raises(ValueError, match=r"'score.weight' \(in extra.safetensors\)"):
        load_hf(tmp_path)
    assert_same(load_hf(tmp_path, strict=False), model)


def test_rotary_inv_freq_buffers_are_ignored(tmp_path):
    model = checkpoint(tmp_path)
    inv_freq = {
        f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32) for i in range(4)
    }
    safetensors.numpy.save_file(inv_freq, tmp_path / "buffers.safetensors")
    assert_same(load_hf(tmp_path), model)


def test_truncated_config_json_names_the_file(tmp_path):
    checkpoint(tmp_path)
    text = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError) as info:
        load_hf(tmp_path)
    message = str(info.value)
    assert f"{tmp_path / 'config.json'} must hold a JSON object" in message
    assert "it is not valid JSON" in message and "at line" in message
    (tmp_path / "config.json").write_text("")
    with pytest.raises(
        ValueError, match=r"config\.json .*\(the file is empty: was it truncated\?\)"
    ):
        DecoderConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json must hold a JSON object .*; got a list"):
        DecoderConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(
        ValueError,
        match=r"config\.json is not a config eqx_lean\.hf reads: .*'gpt2'.*eqx_lean\.load_tensors",
    ):
        DecoderConfig.from_json(tmp_path / "config.json")


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_abstract_model_is_the_abstract_init(dtype):
    config = DecoderConfig(**TINY)
    ours = abstract_model(config, dtype)
    reference = eqx.filter_eval_shape(init, config, key=jax.random.key(0), dtype=dtype)
    leaves, treedef = jax.tree_util.tree_flatten(ours)
    expected, expected_treedef = jax.tree_util.tree_flatten(reference)
    assert treedef == expected_treedef
    for x, y in zip(leaves, expected, strict=True):
        assert (x.shape, x.dtype) == (y.shape, y.dtype)
    assert dataclasses.asdict(ours.config) == dataclasses.asdict(config)


def test_config_and_weights_come_from_one_save_when_a_save_lands_during_the_load(
    tmp_path, when_load_files_are_open
):
    # Two saves with the same shapes but another `rms_norm_eps` and other weights: a config
    # read apart from the weights would give the weights of one with the epsilon of the other.
    path = tmp_path / "checkpoint"
    checkpoint(path, rms_norm_eps=1e-5)
    newer = init(DecoderConfig(**TINY, rms_norm_eps=1e-3), key=jax.random.key(1))
    saved = when_load_files_are_open(lambda: save_hf(newer, path))
    loaded = load_hf(path)
    assert saved and loaded.config.rms_norm_eps == 1e-3
    assert_same(loaded, newer)


def test_load_hf_of_an_open_checkpoint_reads_that_checkpoint(tmp_path):
    import eqx_lean

    path = tmp_path / "checkpoint"
    older = checkpoint(path, rms_norm_eps=1e-5)
    with eqx_lean.open_checkpoint(path, files=["config.json"]) as opened:
        checkpoint(path, rms_norm_eps=1e-3)  # replaces the directory; `opened` keeps the old
        loaded = load_hf(opened)
    assert loaded.config.rms_norm_eps == 1e-5
    assert_same(loaded, older)
    with (
        eqx_lean.open_checkpoint(path) as opened,
        pytest.raises(
            ValueError, match=r"`path` must be opened with its config: `eqx_lean.open_checkpoint"
        ),
    ):
        load_hf(opened)


def test_load_hf_file_backed_equals_the_copied_load_and_gives_the_same_logits(tmp_path):
    path = tmp_path / "ckpt"
    checkpoint(path, dtype="bfloat16")
    copied = load_hf(path)
    mapped = load_hf(path, file_backed=True)
    assert_same(mapped, copied)
    ids = jnp.asarray([[1, 5, 7, 3]])
    np.testing.assert_array_equal(np.asarray(mapped(ids)), np.asarray(copied(ids)))
    with pytest.raises(ValueError, match="stores it as bfloat16 and the load asks for float32"):
        load_hf(path, dtype=jnp.float32, file_backed=True)
    with pytest.raises(ValueError, match="pass one of the two"):
        load_hf(path, file_backed=True, quantize="int8")
