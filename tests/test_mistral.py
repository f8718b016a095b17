"""The Mistral example against HuggingFace `transformers` (eager attention, CPU torch)."""

import json
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import TINY_DECODER

import examples.mistral7b.train as train_module
from eqx_lean.hf import (
    DecoderConfig,
    KVCache,
    decode_step,
    from_hf_state_dict,
    generate,
    init,
    load_hf,
    save_hf,
    to_hf_state_dict,
)
from eqx_lean.internal import accumulated_product, jitted_decode_step, linear_product


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY: dict[str, Any] = TINY_DECODER
CONFIGS: dict[str, dict[str, Any]] = {
    "gqa": dict(TINY, num_hidden_layers=3),
    "sliding_window": dict(TINY, sliding_window=5),
    "head_dim": dict(TINY, head_dim=32, num_key_value_heads=1, sliding_window=6),
}


def hf_model(seed: int = 0, **overrides):
    """A tiny random `MistralForCausalLM` with std-0.2 matrices and non-trivial norm weights."""
    config = transformers.MistralConfig(**overrides, rope_theta=10000.0)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomized(transformers.MistralForCausalLM(config))


def randomized(model):
    """`model` (any HF decoder) in eval mode, its matrices and biases redrawn with std 0.2 and
    its norm weights around 1 from torch's current random state, so logits are far from
    trivial."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2)
    return model.eval()


def hf_logits(model, input_ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(np.asarray(input_ids, np.int64)))
    return out.logits.float().numpy()


def tokens(seed: int, batch: int, seq: int, vocab: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int32)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.fixture(scope="module")
def model():
    """A tiny random float32 model (window 5, non-trivial norms), built once for the module."""
    config = DecoderConfig(**CONFIGS["sliding_window"], dtype="float32")
    return init(config, key=jax.random.key(0), std=0.2, norm_std=0.5)


forward = eqx.filter_jit(lambda model, input_ids: model(input_ids))


# --- config -----------------------------------------------------------------------------------


def test_config_reads_old_and_transformers5_forms():
    old = dict(TINY, rope_theta=1e6, torch_dtype="bfloat16", sliding_window=4096)
    new = dict(TINY, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, dtype="bfloat16")
    new["sliding_window"] = 4096
    assert DecoderConfig.from_hf(old) == DecoderConfig.from_hf(new)
    config = DecoderConfig.from_hf(new)
    assert (config.rope_theta, config.dtype, config.head_dim) == (1e6, "bfloat16", 16)
    assert DecoderConfig.from_hf(config.to_hf()) == config


def test_config_of_transformers_round_trips(tmp_path):
    hf_config = transformers.MistralConfig(**CONFIGS["head_dim"], rope_theta=5e5)
    hf_config.save_pretrained(tmp_path)
    config = DecoderConfig.from_json(tmp_path)
    assert (config.head_dim, config.rope_theta, config.sliding_window) == (32, 5e5, 6)


def test_presets():
    v01, v03 = DecoderConfig.v0_1(), DecoderConfig.v0_3()
    assert (v01.sliding_window, v01.vocab_size, v01.rope_theta) == (4096, 32000, 1e4)
    assert (v03.sliding_window, v03.vocab_size, v03.rope_theta) == (None, 32768, 1e6)
    assert (v01.head_dim, v01.num_hidden_layers, v01.num_key_value_heads) == (128, 32, 8)
    assert DecoderConfig.preset("v0.3") == v03
    tiny = DecoderConfig.preset("tiny")
    assert (tiny.vocab_size, tiny.hidden_size, tiny.num_hidden_layers) == (256, 128, 2)
    assert (tiny.sliding_window, tiny.dtype) == (32, "float32")


def test_config_errors():
    with pytest.raises(ValueError, match="multiple of `num_key_value_heads`"):
        DecoderConfig(**dict(TINY, num_key_value_heads=3))
    with pytest.raises(ValueError, match="`head_dim` must be a positive even"):
        DecoderConfig(**dict(TINY, head_dim=15))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        DecoderConfig.from_hf(dict(TINY, tie_word_embeddings=True))
    with pytest.raises(ValueError, match="`name` must be one of"):
        DecoderConfig.preset("v9")


# --- forward parity ---------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_float32_logits_match_transformers(name, tmp_path):
    hf = hf_model(**CONFIGS[name])
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path, dtype=jnp.float32)
    input_ids = tokens(1, batch=2, seq=16)
    with jax.default_matmul_precision("highest"):
        ours = model(jnp.asarray(input_ids))
    assert ours.shape == (2, 16, 128) and ours.dtype == jnp.float32
    assert max_diff(ours, hf_logits(hf, input_ids)) <= 1e-4


def test_bfloat16_logits_within_twice_transformers_own_error(tmp_path):
    hf = hf_model(**CONFIGS["sliding_window"])
    input_ids = tokens(2, batch=2, seq=16)
    reference = hf_logits(hf, input_ids)
    hf.save_pretrained(tmp_path)
    hf_bf16_error = max_diff(hf_logits(hf.to(torch.bfloat16), input_ids), reference)
    model = load_hf(tmp_path, dtype=jnp.bfloat16)
    ours = model(jnp.asarray(input_ids))
    assert ours.dtype == jnp.bfloat16
    assert max_diff(ours, reference) <= 2 * hf_bf16_error


def test_state_dict_round_trip():
    hf = hf_model(**CONFIGS["gqa"])
    state_dict = {name: value.numpy() for name, value in hf.state_dict().items()}
    config = DecoderConfig.from_hf(hf.config.to_dict())
    model = from_hf_state_dict(state_dict, config, jnp.float32)
    back = to_hf_state_dict(model)
    assert sorted(back) == sorted(state_dict)
    for name, value in state_dict.items():
        np.testing.assert_array_equal(back[name], value)


def test_state_dict_errors():
    hf = hf_model(**CONFIGS["gqa"])
    state_dict = {name: value.numpy() for name, value in hf.state_dict().items()}
    config = DecoderConfig.from_hf(hf.config.to_dict())
    with pytest.raises(KeyError, match="must hold every Mistral tensor"):
        from_hf_state_dict({k: v for k, v in state_dict.items() if "norm" not in k}, config)
    state_dict["model.layers.1.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"`model.layers.1.mlp.up_proj.weight` must have shape"):
        from_hf_state_dict(state_dict, config)


@pytest.mark.parametrize("max_shard_bytes", [2**30, 40_000])
def test_save_hf_loads_in_transformers(model, max_shard_bytes, tmp_path):
    save_hf(model, tmp_path, max_shard_bytes=max_shard_bytes)
    sharded = (tmp_path / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_bytes < 2**30)
    hf = transformers.MistralForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    input_ids = tokens(3, batch=2, seq=12)
    with jax.default_matmul_precision("highest"):
        ours = forward(model, jnp.asarray(input_ids))
    assert max_diff(ours, hf_logits(hf.eval(), input_ids)) <= 1e-4
    reloaded = load_hf(tmp_path)
    for a, b in zip(jax.tree.leaves(reloaded), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_save_hf_writes_dtype(model, tmp_path):
    save_hf(jax.tree.map(lambda x: x.astype(jnp.bfloat16), model), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_hf(tmp_path).dtype == jnp.bfloat16


def test_load_hf_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(DecoderConfig(**TINY).to_hf()))
    with pytest.raises(FileNotFoundError, match="must be a HF checkpoint directory"):
        load_hf(tmp_path)


def test_load_hf_places_every_leaf_with_the_given_sharding(model, tmp_path):
    save_hf(model, tmp_path)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    reloaded = load_hf(tmp_path, sharding=sharding)
    for a, b in zip(jax.tree.leaves(reloaded), jax.tree.leaves(model), strict=True):
        assert a.sharding == sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match="`sharding`"):
        load_hf(tmp_path, sharding=object())


# --- init -------------------------------------------------------------------------------------


def test_init_shapes_dtypes_and_std(model):
    config = DecoderConfig(**CONFIGS["head_dim"])
    abstract = eqx.filter_eval_shape(init, config, key=jax.random.key(0), dtype=jnp.bfloat16)
    assert abstract.layers.self_attn.q_proj.weight.shape == (2, 4 * 32, 64)
    assert abstract.layers.self_attn.k_proj.weight.shape == (2, 32, 64)
    assert abstract.lm_head.weight.shape == (128, 64)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(abstract))
    std = float(jnp.std(model.layers.mlp.up_proj.weight))
    assert 0.19 < std < 0.21
    norm_std = float(jnp.std(model.layers.input_layernorm.weight))
    assert 0.4 < norm_std < 0.6
    default = eqx.filter_eval_shape(init, config, key=jax.random.key(0))
    assert default.embed_tokens.weight.dtype == jnp.bfloat16  # config.dtype


# --- generation -------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_size", [5, 24])
def test_kv_cache_decode_matches_full_forward(model, cache_size):
    """Prefill 7 tokens then decode 9 one by one; a 5-slot cache wraps around (window 5)."""
    input_ids = jnp.asarray(tokens(4, batch=2, seq=16))
    with jax.default_matmul_precision("highest"):
        full = forward(model, input_ids)
        params, static = eqx.partition(model, eqx.is_array)
        cache = KVCache.empty(model.config, 2, cache_size, model.dtype)
        step_logits = []
        _, last, cache = decode_step(
            params, cache, input_ids[:, :7], None, static=static, temperature=0.0, top_k=None
        )
        step_logits.append(last)
        for t in range(7, 16):
            _, last, cache = decode_step(
                params,
                cache,
                input_ids[:, t : t + 1],
                None,
                static=static,
                temperature=0.0,
                top_k=None,
            )
            step_logits.append(last)
    assert max_diff(jnp.stack(step_logits, axis=1), full[:, 6:]) <= 1e-4


def test_decode_step_donates_cache(model):
    params, static = eqx.partition(model, eqx.is_array)
    cache = KVCache.empty(model.config, 2, 5, model.dtype)
    input_ids = jnp.zeros((2, 1), jnp.int32)
    compiled = jitted_decode_step.lower(
        params, cache, input_ids, None, static=static, temperature=0.0, top_k=None
    ).compile()
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
    analysis = compiled.memory_analysis()
    assert analysis is not None
    assert analysis.alias_size_in_bytes >= cache_bytes
    _, _, new_cache = compiled(params, cache, input_ids, None)
    assert cache.keys.is_deleted() and not new_cache.keys.is_deleted()


def test_greedy_generation_matches_transformers(tmp_path):
    hf = hf_model(seed=3, **CONFIGS["sliding_window"])
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompts = tokens(5, batch=6, seq=4)
    prompt_tensor = torch.from_numpy(prompts.astype(np.int64))
    with torch.no_grad():
        out = hf.generate(
            prompt_tensor,
            attention_mask=torch.ones_like(prompt_tensor),
            max_new_tokens=20,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    hf_ids = out.sequences.numpy()
    top2 = np.sort(torch.stack(out.logits, dim=1).float().numpy(), axis=-1)[..., -2:]
    clear = np.all(top2[..., 1] - top2[..., 0] > 1e-3, axis=1)
    assert clear.sum() >= 3, "too few prompts with a clear top-1 at every step"
    hf.save_pretrained(tmp_path)
    ours = generate(load_hf(tmp_path), jnp.asarray(prompts), 20)
    assert ours.shape == (6, 24)
    np.testing.assert_array_equal(np.asarray(ours)[clear], hf_ids[clear])


def test_sampling(model):
    prompts = jnp.asarray(tokens(6, batch=3, seq=4))
    greedy, logits = generate(model, prompts, 6, return_logits=True)
    np.testing.assert_array_equal(np.asarray(greedy)[:, 4:], np.argmax(logits, axis=-1))
    sampled = generate(model, prompts, 6, key=jax.random.key(2), temperature=1.0, top_k=3)
    first = np.asarray(sampled)[:, 4]
    allowed = np.argsort(np.asarray(logits[:, 0]), axis=-1)[:, -3:]
    assert all(token in row for token, row in zip(first, allowed, strict=True))
    again = generate(model, prompts, 6, key=jax.random.key(2), temperature=1.0, top_k=3)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(sampled))
    with pytest.raises(ValueError, match="`key` must be given"):
        generate(model, prompts, 2, temperature=1.0)
    with pytest.raises(ValueError, match="`prompt_ids` must have shape"):
        generate(model, prompts[0], 2)


# --- training ---------------------------------------------------------------------------------


def test_first_five_losses_match_transformers_and_torch_adamw():
    hf = hf_model(seed=7, **CONFIGS["gqa"])
    with torch.no_grad():  # HF-scale weights, so that AdamW steps move the loss smoothly
        for name, param in hf.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.05)
    config = DecoderConfig.from_hf(hf.config.to_dict())
    model = from_hf_state_dict(
        {name: value.numpy() for name, value in hf.state_dict().items()}, config, jnp.float32
    )
    text = train_module.load_text()  # ASCII, so every byte is a valid id of the 128-token vocab
    data = train_module.batches(text, batch_size=4, seq_len=24, seed=0)
    input_batches = [next(data) for _ in range(5)]

    hf.train()
    torch_adamw = torch.optim.AdamW(
        hf.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
    )
    hf_losses = []
    for batch in input_batches:
        ids = torch.from_numpy(batch.astype(np.int64))
        loss = hf(ids, labels=ids).loss
        hf_losses.append(loss.item())
        torch_adamw.zero_grad()
        loss.backward()
        torch_adamw.step()

    optimizer = train_module.adamw(1e-2, weight_decay=0.01)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step = train_module.make_train_step(optimizer, remat=True)
    losses = []
    with jax.default_matmul_precision("highest"):
        for batch in input_batches:
            model, opt_state, loss = step(model, opt_state, jnp.asarray(batch))
            losses.append(float(loss))
    assert len(set(hf_losses)) == 5  # the optimiser does move the model
    np.testing.assert_allclose(losses, hf_losses, rtol=1e-4)


@pytest.mark.slow
def test_training_beats_unigram_entropy():
    _, losses, held_out = train_module.train(log_every=0)
    _, held_out_text = train_module.split_text(train_module.load_text())
    assert held_out < train_module.unigram_entropy(held_out_text)
    assert losses[-1] < losses[0]


# --- bfloat16 products ------------------------------------------------------------------------


def _bf16(rng: np.random.Generator, *shape: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def test_bfloat16_product_and_its_gradients_accumulate_in_float32():
    """Forward and both gradients equal a float64 computation rounded once to bfloat16 (to
    one rounding step: the float32 sums may round the other way)."""
    rng = np.random.default_rng(0)
    x, weight, cotangent = _bf16(rng, 3, 5, 64), _bf16(rng, 32, 64), _bf16(rng, 3, 5, 32)
    out, vjp = jax.vjp(linear_product, x, weight)
    dx, dweight = vjp(cotangent)
    x64, w64, ct64 = (np.asarray(a, np.float64) for a in (x, weight, cotangent))
    expected = [x64 @ w64.T, ct64 @ w64, np.einsum("bto,bti->oi", ct64, x64)]
    for got, want in zip([out, dx, dweight], expected, strict=True):
        assert got.dtype == jnp.bfloat16 and got.shape == want.shape
        rounded = np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64)
        np.testing.assert_allclose(np.asarray(got, np.float64), rounded, rtol=2**-7, atol=1e-6)
    # float32 operands take JAX's own derivatives, forward mode included.
    x32, w32 = x.astype(jnp.float32), weight.astype(jnp.float32)
    _, tangent = jax.jvp(linear_product, (x32, w32), (x32, jnp.zeros_like(w32)))
    np.testing.assert_allclose(tangent, x64 @ w64.T, rtol=1e-5, atol=1e-5)


_PRODUCT_X = jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16)
_PRODUCT_WEIGHT = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)


def _product_temp(f) -> int:
    analysis = jax.jit(f).lower(_PRODUCT_X, _PRODUCT_WEIGHT).compile().memory_analysis()
    assert analysis is not None
    return analysis.temp_size_in_bytes


@pytest.mark.xla_cpu
def test_xla_cpu_copies_the_weight_for_a_plain_bfloat16_dot():
    """Why `linear_product` exists: XLA:CPU copies a bfloat16 weight to float32 for a plain
    bfloat16 dot (JAX 0.10's XLA:CPU)."""
    weight_f32 = 2048 * 2048 * 4
    assert _product_temp(lambda x, w: jnp.einsum("ti,oi->to", x, w)) >= weight_f32


# XLA:CPU's plan too: the bounds failed on the H200 (2026-11-28, the GPU as default backend).
@pytest.mark.xla_cpu
def test_bfloat16_product_needs_no_float32_copy_of_the_weight():
    """The float32-result product, and its gradient with respect to the input, read the weight
    as it is and hold activation-sized temporaries only."""

    def input_grad(x, weight):
        return jax.grad(lambda x: jnp.sum(linear_product(x, weight).astype(jnp.float32)))(x)

    result_f32 = 256 * 2048 * 4  # the float32 result, before its rounding to bfloat16
    assert _product_temp(linear_product) <= result_f32
    assert _product_temp(input_grad) <= 2 * result_f32


@pytest.mark.xla_cpu
@pytest.mark.parametrize("leading", [(1,), (1, 1), ()], ids=str)
def test_a_one_row_bfloat16_product_needs_no_float32_copy_either(leading):
    """One row (a decode step) is a matrix-vector dot, which XLA:CPU lowers with a float32
    copy of the weight even for a float32 result; padded to two rows, it reads it as is. The
    row's values are those of the same row in a larger product."""
    x = jax.ShapeDtypeStruct((*leading, 2048), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    plain = jax.jit(lambda x, w: accumulated_product(x, w)).lower(x, weight).compile()
    padded = jax.jit(linear_product).lower(x, weight).compile()
    analyses = [plain.memory_analysis(), padded.memory_analysis()]
    assert analyses[0] is not None and analyses[1] is not None
    assert analyses[0].temp_size_in_bytes >= 4096 * 2048 * 4
    assert analyses[1].temp_size_in_bytes <= 2 * 4096 * 4
    rng = np.random.default_rng(1)
    rows, w = _bf16(rng, 3, 2048), _bf16(rng, 4096, 2048)
    one = linear_product(rows[0].reshape(*leading, 2048), w)
    assert one.shape == (*leading, 4096)
    np.testing.assert_array_equal(
        np.asarray(one, np.float32).reshape(-1), np.asarray(linear_product(rows, w)[0], np.float32)
    )
