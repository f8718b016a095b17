"""`eqx_lean.hf.next_token_loss` with HF's `labels` against transformers + PEFT 0.21.2 (CPU torch,
float32, eager attention): the loss and the adapter gradients of a batch whose two rows mask
prompts of different lengths with -100. And the fused loss (the default) against the textbook
one (`fused=False`), for a tied head as well; and the name of the decoder's carries.
"""

import contextlib
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import TINY_DECODER
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals
from test_mistral import tokens
from test_mistral_lora import ALL, _our_grads, _torch_lora_grads, base_checkpoint, peft_model

import eqx_lean
from eqx_lean.hf import (
    LAYER_INPUT,
    DecoderConfig,
    init,
    load_adapters,
    load_hf,
    make_lora_step,
    make_train_step,
    next_token_loss,
)
from eqx_lean.lora import lora_filter


torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

PROMPTS = (5, 9)  # the masked prompt of each row


def masked(batch: np.ndarray) -> np.ndarray:
    labels = batch.copy()
    for row, prompt in enumerate(PROMPTS):
        labels[row, :prompt] = -100
    return labels


def test_loss_and_adapter_gradients_with_a_masked_prompt_match_peft(tmp_path):
    hf, base = base_checkpoint(tmp_path, "head_dim", seed=5, std=0.05)
    wrapped = peft_model(hf, r=4, alpha=8, targets=ALL, std=0.05)
    wrapped.save_pretrained(tmp_path / "peft")
    batch = tokens(6, batch=2, seq=16)
    labels = masked(batch)
    wrapped.train()
    loss = wrapped(
        torch.from_numpy(batch.astype(np.int64)), labels=torch.from_numpy(labels.astype(np.int64))
    ).loss
    loss.backward()
    expected = _torch_lora_grads(wrapped)

    model = load_adapters(load_hf(base, dtype=jnp.float32), tmp_path / "peft")
    adapters, frozen = eqx.partition(model, lora_filter(model))

    def loss_of(adapters, fused):
        model = eqx.combine(adapters, frozen)
        return next_token_loss(model, jnp.asarray(batch), labels=jnp.asarray(labels), fused=fused)

    with jax.default_matmul_precision("highest"):
        step = jax.jit(jax.value_and_grad(loss_of), static_argnums=1)
        ours, grads = step(adapters, True)
        textbook, textbook_grads = step(adapters, False)
    assert abs(float(ours) / loss.item() - 1) <= 1e-5
    got = _our_grads(grads, model.config.num_hidden_layers)
    assert sorted(got) == sorted(expected)
    for tensor, reference in expected.items():
        scale = np.abs(reference).max()
        assert scale > 0, tensor
        assert np.abs(got[tensor] - reference).max() <= 1e-4 * scale, tensor
    # The fused loss against the textbook one on the same model.
    assert abs(float(ours) / float(textbook) - 1) <= 1e-6
    reference_grads = _our_grads(textbook_grads, model.config.num_hidden_layers)
    for tensor, reference in reference_grads.items():
        assert np.abs(got[tensor] - reference).max() <= 1e-5 * np.abs(reference).max(), tensor


# A gradient "optimizer": the update is zero and the state's trace is the gradient, exactly.
GRADIENT_OF = optax.chain(optax.trace(decay=0.0), optax.scale(0.0))


def test_accumulated_lora_step_matches_transformers_num_items_in_batch(tmp_path):
    """transformers' gradient accumulation (its `Trainer`): each micro-batch's summed loss
    divided by `num_items_in_batch`, the whole batch's count of shifted labels, and the
    gradients added. Two micro-batches of one row, prompts of 5 and 9 masked (10 and 6
    targets), against `make_lora_step(grad_accum=2)` with the same labels."""
    hf, base = base_checkpoint(tmp_path, "head_dim", seed=5, std=0.05)
    wrapped = peft_model(hf, r=4, alpha=8, targets=ALL, std=0.05)
    wrapped.save_pretrained(tmp_path / "peft")
    batch = tokens(7, batch=2, seq=16)
    labels = masked(batch)
    num_items = torch.tensor(int(np.sum(labels[:, 1:] != -100)))
    wrapped.train()
    expected = 0.0
    for row in range(2):
        micro = wrapped(
            torch.from_numpy(batch[row : row + 1].astype(np.int64)),
            labels=torch.from_numpy(labels[row : row + 1].astype(np.int64)),
            num_items_in_batch=num_items,
        ).loss
        micro.backward()
        expected += micro.item()
    expected_grads = _torch_lora_grads(wrapped)

    model = load_adapters(load_hf(base, dtype=jnp.float32), tmp_path / "peft")
    adapters, frozen = eqx.partition(model, lora_filter(model))
    step = make_lora_step(GRADIENT_OF, grad_accum=2)
    with jax.default_matmul_precision("highest"):
        _, state, loss = step(
            frozen,
            adapters,
            GRADIENT_OF.init(adapters),
            jnp.asarray(batch),
            None,
            jnp.asarray(labels),
        )
    assert abs(float(loss) / expected - 1) <= 1e-5
    got = _our_grads(state[0].trace, model.config.num_hidden_layers)
    assert sorted(got) == sorted(expected_grads)
    for tensor, reference in expected_grads.items():
        scale = np.abs(reference).max()
        assert scale > 0, tensor
        assert np.abs(got[tensor] - reference).max() <= 1e-4 * scale, tensor


@pytest.fixture(scope="module")
def tied():
    """A tiny float32 model whose head is its embedding, built once for the module."""
    config = DecoderConfig(**TINY_DECODER, tie_word_embeddings=True, dtype="float32")
    return init(config, key=jax.random.key(3), std=0.2, norm_std=0.5)


def test_a_tied_model_fully_differentiated_matches_the_textbook_loss(tied):
    """Full fine-tuning of a model whose head is its embedding: every gradient, the embedding's
    (the lookup's and the head's parts) included. And `labels=None` counts every next token."""
    model = tied
    assert model.lm_head is None
    batch = jnp.asarray(tokens(2, batch=2, seq=12))
    labels = jnp.asarray(masked(np.asarray(batch)))

    @eqx.filter_jit
    def losses_and_grads(model):
        # One program for every loss compared (one compilation of the decoder).
        def loss(model, fused, labels):
            return next_token_loss(model, batch, labels=labels, fused=fused)

        fused = eqx.filter_value_and_grad(loss)(model, True, labels)
        textbook = eqx.filter_value_and_grad(loss)(model, False, labels)
        return fused, textbook, loss(model, True, None), loss(model, False, batch)

    with jax.default_matmul_precision("highest"):
        (loss, grads), (expected, expected_grads), default, every = losses_and_grads(model)
    assert abs(float(loss) / float(expected) - 1) <= 1e-6
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        assert np.abs(np.asarray(got - want)).max() <= 1e-5 * np.abs(np.asarray(want)).max()
    assert abs(float(default) / float(every) - 1) <= 1e-6
    with pytest.raises(ValueError, match="`labels` must be integers of `input_ids`' shape"):
        next_token_loss(model, batch, labels=batch[:, :-1])


def test_the_full_fine_tuning_step_takes_labels(tied):
    """`make_train_step(...)(model, opt_state, ids, labels)`: the loss and gradient of the
    textbook loss with those labels (the gradient read from the optimizer's state)."""
    batch = jnp.asarray(tokens(3, batch=2, seq=12))
    labels = jnp.asarray(masked(np.asarray(batch)))
    params = eqx.filter(tied, eqx.is_array)

    @eqx.filter_jit
    def textbook(model):
        return eqx.filter_value_and_grad(
            lambda m: next_token_loss(m, batch, labels=labels, fused=False)
        )(model)

    with jax.default_matmul_precision("highest"):
        expected, expected_grads = textbook(tied)
        step = make_train_step(GRADIENT_OF)
        _, state, loss = step(tied, GRADIENT_OF.init(params), batch, labels)
    assert abs(float(loss) / float(expected) - 1) <= 1e-6
    got, want = jax.tree.leaves(state[0].trace), jax.tree.leaves(expected_grads)
    for g, w in zip(got, want, strict=True):
        assert np.abs(np.asarray(g - w)).max() <= 1e-5 * np.abs(np.asarray(w)).max()


def test_a_name_based_policy_saves_the_named_layer_input(tied):
    """`LAYER_INPUT` names the hidden states entering each layer: what a
    `save_only_these_names` policy keeps of a layer, and nothing else of it."""
    config = tied.config
    layer = eqx_lean.layer_at(tied.layers, 0)
    x = jnp.ones((1, 8, config.hidden_size))
    positions = jnp.arange(8, dtype=jnp.int32)

    def block(x, policy):
        cos = jnp.ones((8, config.resolved_head_dim))
        return jax.checkpoint(
            lambda x: jnp.sum(layer(x, (cos, cos * 0.0), positions)[0]), policy=policy
        )(x)

    def saved(policy) -> list[str]:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            print_saved_residuals(lambda x: block(x, policy), x)
        return printed.getvalue().splitlines()

    named = saved(jax.checkpoint_policies.save_only_these_names(LAYER_INPUT))
    other = saved(jax.checkpoint_policies.save_only_these_names("not_this_one"))
    shape = f"f32[1,8,{config.hidden_size}] named '{LAYER_INPUT}'"
    assert [line for line in named if " named '" in line] == [
        line for line in named if shape in line
    ]
    assert len([line for line in named if shape in line]) == 1
    assert not any(" named '" in line for line in other)


class _NamedLayer(eqx.Module):
    """A layer that names its input, as the docs of `fold` say to."""

    linear: eqx.nn.Linear

    def __call__(self, x):
        x = checkpoint_name(x, "layer_input")
        return jnp.tanh(jax.vmap(self.linear)(x))


def test_fold_takes_a_policy_that_saves_a_named_carry():
    keys = jax.random.split(jax.random.key(0), 3)
    stack = eqx.filter_vmap(lambda k: _NamedLayer(eqx.nn.Linear(8, 8, key=k)))(keys)
    x = jax.random.normal(jax.random.key(1), (4, 8))

    @eqx.filter_jit
    def grads(stack, x, policy):
        remat = True if policy is None else policy
        return eqx.filter_grad(lambda s: jnp.sum(eqx_lean.fold(s, x, remat=remat) ** 2))(stack)

    named = grads(stack, x, jax.checkpoint_policies.save_only_these_names("layer_input"))
    recomputed = grads(stack, x, None)
    for a, b in zip(jax.tree.leaves(named), jax.tree.leaves(recomputed), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
