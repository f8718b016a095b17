"""Generation refuses what it would get wrong, keeps its stop ids through a save, and compiles
once per length bucket (issue 41): `generate`, `decode_step` and `sample` check every argument
before any work (`eqx_lean/hf/_generate.py`), `generation_config.json`'s stop ids are checked
on load (`_checkpoint.py`), `KVCache.empty` checks its sizes (`_model.py`), `save_hf` writes
`generation_config.json` from the model's stop ids (read back by `transformers` and `load_hf`),
and two `max_new_tokens` in one documented bucket compile nothing the second time."""

import dataclasses
import inspect
import json
import math
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import MICRO_DECODER

from eqx_lean.hf import (
    Decoder,
    DecoderConfig,
    KVCache,
    abstract_model,
    decode_step,
    generate,
    load_hf,
    sample,
    save_hf,
)


transformers = pytest.importorskip("transformers")

VOCAB = MICRO_DECODER["vocab_size"]  # 32
TOP_K = r"`top_k` must be None or an integer from 1 to 32"
PROMPT = 10  # away from every bucket edge: 10 + 5 and 10 + 40 are both in the bucket of 64


def random_model(config: DecoderConfig, seed: int = 0) -> Decoder:
    """A model of `config` with std-0.5 weights and norms around 1, drawn with NumPy into the
    abstract model's shapes: nothing to compile."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        base = 1.0 if "norm" in jax.tree_util.keystr(path) else 0.0
        return jax.device_put(np.asarray(base + 0.5 * rng.standard_normal(leaf.shape), leaf.dtype))

    return jax.tree_util.tree_map_with_path(draw, abstract_model(config))


def with_config(model: Decoder, **fields: Any) -> Decoder:
    config = dataclasses.replace(model.config, **fields)
    return Decoder(model.embed_tokens, model.layers, model.norm, model.lm_head, config)


@pytest.fixture(scope="module")
def model() -> Decoder:
    return random_model(DecoderConfig(**MICRO_DECODER, eos_token_id=None))


def prompt(batch: int = 2, length: int = PROMPT) -> np.ndarray:
    return np.random.default_rng(1).integers(0, VOCAB, (batch, length)).astype(np.int32)


# --- generate: every argument checked before any work -----------------------------------------


def test_ids_outside_the_vocabulary_are_refused_naming_row_and_position(model, compiles):
    for bad, shown in [(VOCAB, VOCAB), (-1, -1), (10**6, 10**6)]:
        ids = prompt()
        ids[1, 3] = bad
        for given in (ids, jax.device_put(ids)):  # (`jnp.asarray` would compile a copy)
            with pytest.raises(ValueError) as info:
                generate(model, given, 4)
            assert str(info.value) == (
                f"`prompt_ids` must hold token ids in [0, {VOCAB}) (the vocabulary size is "
                f"{VOCAB}); row 1, position 3 holds {shown}."
            )
    assert compiles.count == 0  # refused before any work


def test_float_and_bool_ids_are_refused(model):
    bad_ids: list[Any] = [prompt().astype(np.float32), jnp.ones((2, 4)), [[1.0, 2.5]], prompt() > 3]
    for bad in bad_ids:
        with pytest.raises(TypeError, match=r"`prompt_ids` must hold integer token ids; got"):
            generate(model, bad, 4)
    with pytest.raises(ValueError, match=r"`prompt_ids` must have shape \[batch>0, seq>0\]"):
        generate(model, prompt()[0], 4)


def test_counts_temperatures_and_top_k_are_refused_naming_the_argument(model, compiles):
    key = np.zeros(2, np.uint32)  # a raw key: making a typed one compiles
    ids = prompt()
    cases: list[tuple[dict[str, Any], type, str]] = [
        (
            dict(max_new_tokens=True),
            TypeError,
            r"`max_new_tokens` must be an integer of at least 1",
        ),
        (dict(max_new_tokens=4.0), TypeError, r"`max_new_tokens` must be an integer"),
        (dict(max_new_tokens=0), ValueError, r"`max_new_tokens` must be an integer of at least 1"),
        (dict(max_new_tokens=2**31), ValueError, r"`max_new_tokens` must leave the sequence"),
        (dict(top_k=0, temperature=1.0, key=key), ValueError, TOP_K + r"; got 0"),
        (dict(top_k=VOCAB + 1, temperature=1.0, key=key), ValueError, TOP_K + r"; got 33"),
        (
            dict(top_k=True, temperature=1.0, key=key),
            TypeError,
            r"`top_k` must be None or an integer",
        ),
        (
            dict(temperature=-0.5, key=key),
            ValueError,
            r"`temperature` must be a finite number at least 0; got -0\.5",
        ),
        (dict(temperature=math.nan, key=key), ValueError, r"`temperature` must be a finite number"),
        (dict(temperature="1", key=key), TypeError, r"`temperature` must be a finite number"),
        (dict(temperature=1.0), ValueError, r"`key` must be given when `temperature > 0`"),
        (dict(temperature=1.0, key=0), TypeError, r"`key` must be None or one random key"),
        (
            dict(temperature=1.0, key=np.zeros((2, 2), np.uint32)),
            TypeError,
            r"`key` must be None or one random key",
        ),
        (dict(return_logits="yes"), TypeError, r"`return_logits` must be true or false"),
        (
            dict(cache_size=True),
            TypeError,
            r"`cache_size` must be None or an integer of at least 1",
        ),
    ]
    for arguments, error, message in cases:
        call: dict[str, Any] = {"max_new_tokens": 4, **arguments}
        with pytest.raises(error, match=message):
            generate(model, ids, **call)
    assert compiles.count == 0


def test_stop_ids_outside_the_vocabulary_are_refused(model):
    ids = prompt()
    cases: list[tuple[Any, type, str]] = [
        (
            VOCAB,
            ValueError,
            r"`eos_token_id` \(a token of the 32-token vocabulary\) must be "
            r"an integer from 0 to 31; got 32\.",
        ),
        (-2, ValueError, r"`eos_token_id` .* must be an integer from 0 to 31; got -2\."),
        (
            True,
            TypeError,
            r"`eos_token_id` must be None, a token id or a sequence of token ids; got True",
        ),
        ("2", TypeError, r"`eos_token_id` must be None, a token id or a sequence"),
        ([3, 10**9], ValueError, r"each id of `eos_token_id` .* from 0 to 31; got 1000000000\."),
        ([3, True], TypeError, r"each id of `eos_token_id` .* must be an integer .*; got True"),
    ]
    for stop, error, message in cases:
        with pytest.raises(error, match=message):
            generate(model, ids, 4, eos_token_id=stop)
    # The model's own stop ids (from the checkpoint's files, or set by hand) are checked too.
    wrong = with_config(model, generation_eos_token_id=(3, 40))
    with pytest.raises(ValueError, match=r"`model.config.stop_token_ids` .* got 40\."):
        generate(wrong, ids, 4)


def test_generate_under_jit_is_refused(model):
    with pytest.raises(TypeError, match=r"`generate` cannot run under `jax.jit`"):
        jax.jit(lambda ids: generate(model, ids, 3))(jax.device_put(prompt()))


# --- decode_step and sample --------------------------------------------------------------------


def test_decode_step_is_a_documented_function():
    assert inspect.isfunction(decode_step)
    doc = inspect.getdoc(decode_step)
    assert doc is not None
    for part in ("**Arguments:**", "**Returns:**", "**Example:**", "```python", "`static`"):
        assert part in doc, part
    assert list(inspect.signature(decode_step).parameters) == [
        "params",
        "cache",
        "input_ids",
        "key",
        "static",
        "temperature",
        "top_k",
    ]


def test_decode_step_checks_its_arguments(model):
    params, static = eqx.partition(model, eqx.is_array)

    def cache():
        return KVCache.empty(model.config, 2, 8, model.dtype)

    bad = prompt(length=3)
    bad[0, 2] = VOCAB
    with pytest.raises(ValueError, match=r"`input_ids` .*; row 0, position 2 holds 32\."):
        decode_step(params, cache(), bad, static=static)
    with pytest.raises(TypeError, match=r"`input_ids` must hold integer token ids"):
        decode_step(params, cache(), bad.astype(np.float32), static=static)
    with pytest.raises(ValueError, match=r"`temperature` must be a finite number at least 0"):
        decode_step(params, cache(), prompt(), static=static, temperature=-1.0)
    with pytest.raises(ValueError, match=r"`top_k` must be None or an integer from 1 to 32"):
        decode_step(params, cache(), prompt(), jax.random.key(0), static=static, top_k=0)
    with pytest.raises(TypeError, match=r"`static` must be the model's non-array part"):
        decode_step(params, cache(), prompt(), static=params)
    with pytest.raises(TypeError, match=r"`cache` must be a KVCache"):
        decode_step(params, None, prompt(), static=static)  # pyright: ignore[reportArgumentType]


def test_decode_step_under_jit_checks_the_ids_when_it_runs(model):
    """Traced ids cannot be read on the host: the check is in the program (equinox.error_if)."""
    params, static = eqx.partition(model, eqx.is_array)

    @jax.jit
    def step(params, cache, ids):
        return decode_step(params, cache, ids, static=static)

    def cache():
        return KVCache.empty(model.config, 2, 8, model.dtype)

    next_ids, _, _ = step(params, cache(), jax.device_put(prompt(length=3)))
    assert next_ids.shape == (2,)
    bad = prompt(length=3)
    bad[1, 0] = -1
    # XLA's runtime error (a ValueError or RuntimeError, by JAX's path) carries equinox's message.
    message = r"`input_ids` must hold token ids in \[0, 32\)"
    with pytest.raises((RuntimeError, ValueError), match=message):
        jax.block_until_ready(step(params, cache(), jax.device_put(bad)))


def test_sample_checks_its_arguments():
    logits = jnp.zeros((2, VOCAB))
    with pytest.raises(ValueError, match=r"`top_k` must be None or an integer from 1 to 32"):
        sample(logits, jax.random.key(0), 1.0, top_k=0)
    with pytest.raises(ValueError, match=r"`temperature` must be a finite number at least 0"):
        sample(logits, jax.random.key(0), -1.0)


# --- KVCache.empty -----------------------------------------------------------------------------


def test_kv_cache_sizes_are_checked():
    config = DecoderConfig(**MICRO_DECODER)
    with pytest.raises(
        TypeError, match=r"`size` must be an integer from 1 to 2147483647; got True"
    ):
        KVCache.empty(config, 1, True, jnp.float32)
    with pytest.raises(ValueError, match=r"`size` must be an integer from 1 to 2147483647; got"):
        KVCache.empty(config, 1, 2**40, jnp.float32)
    with pytest.raises(TypeError, match=r"`batch_size` must be an integer of at least 1; got 2\.0"):
        KVCache.empty(config, 2.0, 8, jnp.float32)  # pyright: ignore[reportArgumentType]
    # 128 bytes a slot a sequence (keys and values, 2 layers, 1 head of 8, float32).
    with pytest.raises(ValueError) as info:
        KVCache.empty(config, 2**20, 2**31 - 1, jnp.float32)
    assert str(info.value).startswith("`size` must keep the cache's keys and values under")
    assert f"got {2**31 - 1} slots of {128 * 2**20} bytes each" in str(info.value)


# --- generation_config.json: checked on load, written by save_hf ------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("generation") / "ckpt"
    save_hf(with_config(model, model_type="llama", bos_token_id=1, eos_token_id=2), path)
    return path


# Llama-3-Instruct's generation_config.json, in its own layout (ids scaled to this vocabulary):
# `<|end_of_text|>` and `<|eot_id|>` both end a turn.
INSTRUCT = """{
  "bos_token_id": 1,
  "do_sample": true,
  "eos_token_id": [
    30,
    31
  ],
  "max_length": 4096,
  "temperature": 0.6,
  "top_p": 0.9,
  "transformers_version": "4.40.0.dev0"
}
"""


def test_stop_ids_of_generation_config_are_checked_on_load(checkpoint, tmp_path):
    generation = checkpoint / "generation_config.json"
    before = generation.read_bytes()
    where = re.escape(f"`eos_token_id` in {generation}")
    cases: list[tuple[Any, type, str]] = [
        (
            -1,
            ValueError,
            rf"{where} \(a token of the 32-token vocabulary\) must be an integer from 0 "
            r"to 31; got -1\.",
        ),
        (VOCAB, ValueError, rf"{where} .* got 32\."),
        (True, TypeError, rf"{where} .*must be an integer from 0 to 31; got True \(bool\)"),
        ([2, 10**12], ValueError, rf"each id of {where} .* got 1000000000000\."),
        ("2", TypeError, rf"{where} .*; got '2' \(str\)"),
    ]
    try:
        for eos, error, message in cases:
            generation.write_text(json.dumps({"eos_token_id": eos}))
            with pytest.raises(error, match=message):
                load_hf(checkpoint)
    finally:
        generation.write_bytes(before)


def test_save_hf_keeps_a_list_of_stop_ids_through_transformers(checkpoint, tmp_path):
    """A Llama-3-Instruct fine-tune keeps `<|eot_id|>`: the file comes back byte for byte."""
    generation = checkpoint / "generation_config.json"
    before = generation.read_bytes()
    generation.write_text(INSTRUCT)
    try:
        loaded = load_hf(checkpoint)
    finally:
        generation.write_bytes(before)
    assert loaded.config.stop_token_ids == (30, 31)
    save_hf(loaded, tmp_path / "tuned")
    assert (tmp_path / "tuned" / "generation_config.json").read_text() == INSTRUCT
    hf_generation = transformers.GenerationConfig.from_pretrained(tmp_path / "tuned")
    assert hf_generation.eos_token_id == [30, 31]
    assert load_hf(tmp_path / "tuned").config.stop_token_ids == (30, 31)

    # Changed ids are written into the same file; its other fields stay.
    changed = with_config(loaded, generation_eos_token_id=(7,))
    save_hf(changed, tmp_path / "changed")
    hf_generation = transformers.GenerationConfig.from_pretrained(tmp_path / "changed")
    assert hf_generation.eos_token_id == 7
    assert (hf_generation.temperature, hf_generation.top_p) == (0.6, 0.9)
    assert load_hf(tmp_path / "changed").config.stop_token_ids == (7,)


def test_save_hf_writes_the_stop_ids_of_a_model_without_a_generation_file(model, tmp_path):
    for eos, hf_eos, stop in [((29, 31), [29, 31], (29, 31)), (5, 5, (5,)), (None, None, ())]:
        made = with_config(model, eos_token_id=eos, bos_token_id=1)
        save_hf(made, tmp_path / "made")
        hf_generation = transformers.GenerationConfig.from_pretrained(tmp_path / "made")
        assert (hf_generation.eos_token_id, hf_generation.bos_token_id) == (hf_eos, 1)
        assert load_hf(tmp_path / "made").config.stop_token_ids == stop
    # What `files` gives is written instead.
    save_hf(model, tmp_path / "given", files={"generation_config.json": b'{"eos_token_id": 4}'})
    assert load_hf(tmp_path / "given").config.stop_token_ids == (4,)


def test_a_save_over_the_checkpoint_replaces_its_generation_file_with_the_models(
    checkpoint, tmp_path, model
):
    """The file is the save's own (written in the same atomic step as the weights), not one
    carried over from the directory the save replaces."""
    target = tmp_path / "over"
    save_hf(with_config(model, eos_token_id=3), target)
    assert load_hf(target).config.stop_token_ids == (3,)
    save_hf(with_config(model, eos_token_id=(4, 6)), target)
    assert json.loads((target / "generation_config.json").read_text())["eos_token_id"] == [4, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["over"]  # nothing left beside it


# --- one compile per length bucket ------------------------------------------------------------


def test_max_new_tokens_in_one_bucket_compile_nothing_the_second_time(model, compiles):
    """Buckets of `prompt + max_new_tokens` (generate's docstring): 64, 128, ..., 1024, then
    multiples of 1024. 10 + 5 and 10 + 40 are both in the bucket of 64; 10 + 60 is not."""
    ids = jax.device_put(prompt())
    forward = eqx.filter_jit(lambda m, x: m(x))
    first, first_logits = generate(model, ids, 5, return_logits=True, eos_token_id=())
    assert compiles.count >= 1
    before = compiles.count
    second, second_logits = generate(model, ids, 40, return_logits=True, eos_token_id=())
    assert compiles.count == before, "a second max_new_tokens in the bucket compiled"
    assert second.shape == (2, PROMPT + 40) and second_logits.shape == (2, 40, VOCAB)
    # Greedy decoding: the first tokens agree, and every logit is the causal forward's.
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second)[:, : PROMPT + 5])
    full = forward(model, second)[:, PROMPT - 1 : -1]
    np.testing.assert_allclose(np.asarray(second_logits), np.asarray(full), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(second)[:, PROMPT:], np.argmax(full, axis=-1))
    np.testing.assert_array_equal(np.asarray(first_logits), np.asarray(second_logits)[:, :5])
    # Other stop ids of the same count, and a sampled run at another temperature, neither.
    generate(model, ids, 20, eos_token_id=(4,))
    after_stop = compiles.count
    generate(model, ids, 30, eos_token_id=(9,))
    assert compiles.count == after_stop
    generate(model, ids, 6, key=jax.random.key(1), temperature=0.7)
    after_sampling = compiles.count
    generate(model, ids, 50, key=jax.random.key(2), temperature=1.3)
    assert compiles.count == after_sampling
    # The next bucket compiles (the counter sees it).
    generate(model, ids, 60, eos_token_id=())
    assert compiles.count > after_sampling


def test_stopping_in_the_loop_matches_a_loop_of_decode_steps(model):
    """The oracle: the documented building block, a prefill and then one step at a time on a
    cache of exactly `prompt + max_new_tokens` slots, stopping as `generate` documents."""
    ids = prompt()
    greedy = np.asarray(generate(model, jax.device_put(ids), 12, eos_token_id=()))
    stop = int(greedy[0, PROMPT + 3])  # the first sequence ends at its fourth token
    found = np.asarray(generate(model, jax.device_put(ids), 12, eos_token_id=(stop,)))

    params, static = eqx.partition(model, eqx.is_array)
    cache = KVCache.empty(model.config, 2, PROMPT + 12, model.dtype)
    next_ids, _, cache = decode_step(params, cache, ids, static=static)
    done = np.zeros(2, bool)
    rows = []
    for _ in range(12):
        chosen = np.where(done, stop, np.asarray(next_ids))
        rows.append(chosen)
        done |= chosen == stop
        if done.all():
            break
        next_ids, _, cache = decode_step(params, cache, chosen[:, None], static=static)
    expected = np.concatenate([ids, np.stack(rows, axis=1)], axis=1)
    np.testing.assert_array_equal(found, expected)
