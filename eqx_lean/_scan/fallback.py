"""The scans JAX differentiates itself: a `lax.scan` over the stack as `xs`, with the layer
policy of `remat=` and nested groups.

`fold` and `scan` differentiate these under `vmap` over a stack the batch does not reach,
where JAX's own derivative sums the examples' gradients as it goes (`backward` and `batching`
say how each path finds that case).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from .remat import Policy, checkpointed


def scan_layers(
    step: Callable[[Any, Any, Any], tuple[Any, Any]],
    dynamic: Any,
    carry: Any,
    xs: Any,
    unroll: int | bool,
) -> tuple[Any, Any]:
    def body(carry: Any, sliced: tuple[Any, Any]) -> tuple[Any, Any]:
        layer, x = sliced
        return step(layer, carry, x)

    return lax.scan(body, carry, (dynamic, xs), unroll=unroll)


def split_groups(tree: Any, num_groups: int, group_size: int) -> tuple[Any, Any]:
    """Splits the leading axis of every leaf into `(num_groups, group_size)` plus a remainder."""
    main_len = num_groups * group_size

    def main(x: Array) -> Array:
        x = x if x.shape[0] == main_len else x[:main_len]
        return x.reshape(num_groups, group_size, *x.shape[1:])

    return jax.tree.map(main, tree), jax.tree.map(lambda x: x[main_len:], tree)


def merge_groups(main: Any, rest: Any, has_rest: bool) -> Any:
    def merge(m: Array, r: Array | None) -> Array:
        m = m.reshape(-1, *m.shape[2:])
        return m if r is None else jnp.concatenate([m, r])

    if not has_rest:
        return jax.tree.map(lambda m: merge(m, None), main)
    return jax.tree.map(merge, main, rest)


def nested_scan(
    step: Callable[[Any, Any, Any], tuple[Any, Any]],
    dynamic: Any,
    carry: Any,
    xs: Any,
    num_layers: int,
    policy: Policy,
    group_size: int,
    unroll: int | bool,
) -> tuple[Any, Any]:
    num_groups, rest = divmod(num_layers, group_size)
    inner = checkpointed(step, policy)

    def group(layers: Any, carry: Any, group_xs: Any) -> tuple[Any, Any]:
        return scan_layers(inner, layers, carry, group_xs, unroll)

    outer = checkpointed(group, jax.checkpoint_policies.nothing_saveable)
    main_layers, rest_layers = split_groups(dynamic, num_groups, group_size)
    main_xs, rest_xs = split_groups(xs, num_groups, group_size)
    carry, main_ys = scan_layers(outer, main_layers, carry, main_xs, unroll=1)
    rest_ys = None
    if rest:
        carry, rest_ys = outer(rest_layers, carry, rest_xs)
    return carry, merge_groups(main_ys, rest_ys, has_rest=bool(rest))
