"""`remat=` with JAX's name-based checkpoint policies (`jax.checkpoint_policies.
save_only_these_names`, `save_any_names_but_these`, `save_and_offload_only_these_names`) in
`fold`, `scan` and `hf.make_lora_step`: the values of `remat=None`, whatever form JAX gives the
policy (a function or a dataclass instance with `__call__`, by version), and the refusal of
policy functions where `jax_remat3` would ignore them."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import TINY_DECODER, tolerance
from jax.ad_checkpoint import checkpoint_name

import eqx_lean
from eqx_lean import hf, lora
from eqx_lean.internal import remat as remat_module


NAME = "layer_input"
POLICIES = jax.checkpoint_policies


def name_policies(name: str) -> dict[str, Any]:
    return {
        "save_only_these_names": POLICIES.save_only_these_names(name),
        "save_any_names_but_these": POLICIES.save_any_names_but_these("not-" + name),
        "save_and_offload_only_these_names": POLICIES.save_and_offload_only_these_names(
            names_which_can_be_saved=(),
            names_which_can_be_offloaded=(name,),
            offload_src="device",
            offload_dst="pinned_host",
        ),
        "nested": eqx_lean.NestedRemat(policy=POLICIES.save_only_these_names(name)),
    }


class Layer(eqx.Module):
    weight: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        x = checkpoint_name(x, NAME)
        return jnp.tanh(x @ self.weight)


def assert_close(found: Any, expected: Any) -> None:
    for a, b in zip(jax.tree.leaves(found), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tolerance("loop"), atol=0)


@pytest.fixture(scope="module")
def stack() -> Layer:
    keys = jax.random.split(jax.random.key(0), 4)
    return eqx_lean.build_stacked(lambda k: Layer(0.5 * jax.random.normal(k, (8, 8))), keys)


X = jnp.linspace(-1.0, 1.0, 16, dtype=jnp.float32).reshape(2, 8)


@pytest.mark.parametrize("policy", list(name_policies(NAME)))
def test_fold_takes_name_based_policies(stack, policy):
    def loss(stack, remat):
        return jnp.sum(eqx_lean.fold(stack, X, remat=remat) ** 2)

    expected = jax.value_and_grad(loss)(stack, None)
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    assert_close(grad(stack, name_policies(NAME)[policy]), expected)


@pytest.mark.parametrize("policy", list(name_policies(NAME)))
def test_scan_takes_name_based_policies(stack, policy):
    def call(layer, x, scale):
        y = layer(x) * scale
        return y, jnp.sum(y)

    scales = jnp.arange(1.0, 5.0)

    def loss(stack, remat):
        carry, ys = eqx_lean.scan(stack, X, scales, call=call, remat=remat)
        return jnp.sum(carry**2) + jnp.sum(ys)

    expected = jax.value_and_grad(loss)(stack, None)
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    assert_close(grad(stack, name_policies(NAME)[policy]), expected)


@pytest.fixture(scope="module")
def lora_model() -> tuple[Any, Any, Any]:
    config = hf.DecoderConfig(**dict(TINY_DECODER, dtype="float32"))
    model = hf.init(config, key=jax.random.key(0), norm_std=0.1)
    model = lora.add_lora(
        model, lora.LoraConfig(r=4, target_modules=("q_proj", "down_proj")), key=jax.random.key(1)
    )
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    ids = jax.random.randint(jax.random.key(2), (2, 12), 0, config.vocab_size)
    return adapters, frozen, ids


def lora_steps(lora_model, remat: Any) -> tuple[Any, list[float]]:
    adapters, frozen, ids = lora_model
    # Plain SGD: the update is linear in the gradient. (Adam divides by the gradient's running
    # size, so where LoRA's B starts at zero the gradient's last bits decide it, and a GPU's
    # recomputation under remat changes those bits.)
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(adapters)
    adapters = jax.tree.map(jnp.copy, adapters)  # the step donates them
    step = hf.make_lora_step(optimizer, remat=remat)
    losses = []
    for _ in range(2):
        adapters, opt_state, loss = step(frozen, adapters, opt_state, ids, None)
        losses.append(float(loss))
    return adapters, losses


@pytest.fixture(scope="module")
def lora_reference(lora_model) -> tuple[Any, list[float]]:
    return lora_steps(lora_model, True)


# Nested remat with a name-based policy is the fold's and scan's (above): one compile fewer.
@pytest.mark.parametrize("policy", ["save_only_these_names", "save_and_offload_only_these_names"])
def test_make_lora_step_takes_name_based_policies_of_the_layer_input(
    lora_model, lora_reference, policy
):
    """The decoder names each layer's input `hf.LAYER_INPUT`: a policy keeping it (in device
    or host memory) gives the steps of `remat=True`."""
    adapters, losses = lora_steps(lora_model, name_policies(hf.LAYER_INPUT)[policy])
    expected_adapters, expected_losses = lora_reference
    np.testing.assert_allclose(losses, expected_losses, rtol=tolerance("loop"))
    found = jax.tree.leaves(eqx.filter(adapters, eqx.is_array))
    expected = jax.tree.leaves(eqx.filter(expected_adapters, eqx.is_array))
    for a, b in zip(found, expected, strict=True):
        b = np.asarray(b)
        atol = tolerance("loop") * np.abs(b).max()
        np.testing.assert_allclose(np.asarray(a), b, rtol=tolerance("loop"), atol=atol)


@dataclasses.dataclass(frozen=True)
class ClassPolicy:
    """A policy in the form JAX 0.11's `jax.checkpoint_policies` makes: a frozen dataclass
    with `__call__` (standing for `SaveAndOffloadOnlyTheseNames`, a function on JAX 0.10.2)."""

    names: frozenset[str]

    def __call__(self, prim: Any, *_: Any, **params: Any) -> bool:
        return params.get("name") in self.names


def test_a_policy_made_by_jax_is_accepted_in_either_form(monkeypatch):
    monkeypatch.setattr(remat_module, "_made_by_jax", lambda: (ClassPolicy,))
    remat_module.check_remat(ClassPolicy(frozenset({NAME})))
    remat_module.check_remat(eqx_lean.NestedRemat(policy=ClassPolicy(frozenset({NAME}))))
    for policy in name_policies(NAME).values():  # as this JAX makes them
        remat_module.check_remat(policy)


def test_under_remat3_a_policy_function_is_refused_naming_the_name_based_one(monkeypatch):
    """Under `jax_remat3` JAX never calls a policy function (it reads its own policies by
    class), so a function would silently save nothing: refused, with what to use instead."""
    monkeypatch.setattr(remat_module, "_remat3", lambda: True)
    monkeypatch.setattr(remat_module, "_made_by_jax", lambda: (ClassPolicy,))

    def mine(prim, *_, **params):
        return False

    with pytest.raises(TypeError, match="save_only_these_names") as refused:
        remat_module.check_remat(mine)
    assert "jax_remat3" in str(refused.value)
    with pytest.raises(TypeError, match="jax_remat3"):
        eqx_lean.NestedRemat(policy=mine)
    remat_module.check_remat(ClassPolicy(frozenset({NAME})))
    remat_module.check_remat(True)  # `nothing_saveable`, which JAX 0.11 reads as it is
    remat_module.check_remat(POLICIES.everything_saveable)
