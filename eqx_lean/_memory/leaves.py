"""Every leaf's dtype and sharding, as a build would choose them, before anything is built."""

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding
from jaxtyping import PRNGKeyArray

from .. import _core
from .._core import DtypePolicy, ShardingPolicy
from .table import format_bytes, table


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """One stacked leaf as `build_stacked` would make it.

    **Attributes:**

    - `path`: the leaf's key path in one layer, as `jax.tree_util.keystr` writes it (the path
        every rule is given).
    - `shape`: the stacked leaf's shape, layer axis first.
    - `built_dtype`: the dtype `make_layer` creates it in (construction precision).
    - `stored_dtype`: the dtype it is stored in, as `dtype=` chose.
    - `sharding`: one layer's `PartitionSpec`, as `sharding=` chose (the layer axis is
        replicated), `"replicated"`, or `"default"` (default placement, no mesh).
    - `nbytes`: the stacked leaf's bytes in `stored_dtype`, over all devices.
    - `nbytes_per_device`: its share on each device (replicated leaves count in full).
    """

    path: str
    shape: tuple[int, ...]
    built_dtype: str
    stored_dtype: str
    sharding: str
    nbytes: int
    nbytes_per_device: int


def _describe_spec(sharding: Sharding | None) -> str:
    if sharding is None:
        return "default"
    if isinstance(sharding, NamedSharding) and any(e is not None for e in sharding.spec):
        return str(sharding.spec).replace("PartitionSpec", "P")
    return "replicated"


@dataclasses.dataclass(frozen=True)
class LeafReport:
    """What a build would make of every leaf; from [`eqx_lean.memory.describe`][] and
    [`eqx_lean.memory.MemoryEstimate`][]`.leaves`. `print` it for a table.

    **Attributes:**

    - `num_layers`: the number of stacked layers `L`.
    - `leaves`: one [`eqx_lean.memory.LeafInfo`][] per array leaf, in the layer's leaf order.
    """

    num_layers: int
    leaves: tuple[LeafInfo, ...]

    def __iter__(self) -> Iterator[LeafInfo]:
        return iter(self.leaves)

    def __len__(self) -> int:
        return len(self.leaves)

    def __getitem__(self, path: str) -> LeafInfo:
        """The leaf at `path`, as `jax.tree_util.keystr` writes it (such as `".mlp.weight"`)."""
        for leaf in self.leaves:
            if leaf.path == path:
                return leaf
        raise KeyError(f"No leaf at {path!r}; the leaves are at: {[x.path for x in self]}.")

    def table(self) -> str:
        """The leaves as an aligned text table, one row per leaf."""
        sharded = any(x.nbytes_per_device != x.nbytes for x in self.leaves)
        header = ("leaf", "shape", "built", "stored", "sharding (per layer)", "bytes")
        rows = [
            (
                x.path or "(the layer)",
                str(list(x.shape)),
                x.built_dtype,
                x.stored_dtype,
                x.sharding,
                format_bytes(x.nbytes),
            )
            + ((format_bytes(x.nbytes_per_device),) if sharded else ())
            for x in self.leaves
        ]
        header += ("per device",) if sharded else ()
        total = sum(x.nbytes for x in self.leaves)
        summary = f"{len(self.leaves)} leaves of {self.num_layers} layers: {format_bytes(total)}"
        if sharded:
            summary += f", {format_bytes(sum(x.nbytes_per_device for x in self))} per device"
        return f"{summary}\n{table(header, rows)}"

    def __repr__(self) -> str:
        return f"LeafReport(\n{self.table()}\n)"


def leaf_report(plan: Any) -> LeafReport:
    """The `LeafReport` of a build plan (`eqx_lean._core.plan_build`)."""
    leaves = []
    for path, built, stored, sharding in zip(
        plan.layout.paths, plan.layout.structs, plan.structs, plan.shardings, strict=True
    ):
        stacked = _core.stacked_sharding(sharding)
        leaves.append(
            LeafInfo(
                path=jax.tree_util.keystr(path),
                shape=tuple(stored.shape),
                built_dtype=str(np.dtype(built.dtype)),
                stored_dtype=str(np.dtype(stored.dtype)),
                sharding=_describe_spec(sharding),
                nbytes=_core.struct_bytes(stored),
                nbytes_per_device=_core.shard_bytes(stored, stacked),
            )
        )
    return LeafReport(plan.num_layers, tuple(leaves))


def describe(
    make_layer: Callable[[PRNGKeyArray], Any],
    keys: PRNGKeyArray,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    *,
    mesh: Mesh | None = None,
) -> LeafReport:
    """Shows the dtype and sharding that `build_stacked` would give every leaf, building nothing.

    Takes exactly the arguments of [`eqx_lean.build_stacked`][], traces `make_layer` on an
    abstract key and resolves `dtype` and `sharding` as the build does; nothing is compiled or
    allocated. The way to check a dtype rule before building:

    ```python
    dtype = eqx_lean.dtypes.for_modules(eqx.nn.RMSNorm, jnp.float32, otherwise=jnp.bfloat16)
    print(eqx_lean.memory.describe(make_block, keys, dtype))
    ```

    ```text
    LeafReport(
    6 leaves of 24 layers: 96.2 MiB
    leaf                             shape    built    stored  sharding (per layer)     bytes
    ---------------------  ---------------  -------  --------  --------------------  --------
    .norm.weight                 [24, 512]  float32   float32               default  48.0 KiB
    .norm.bias                   [24, 512]  float32   float32               default  48.0 KiB
    .mlp.layers[0].weight  [24, 2048, 512]  float32  bfloat16               default  48.0 MiB
    ...
    ```

    [`eqx_lean.memory.estimate`][] returns the same report as its `leaves`.

    **Arguments:**

    - `make_layer`, `keys`, `dtype`, `sharding`, `mesh`: as for [`eqx_lean.build_stacked`][].

    **Returns:**

    A [`eqx_lean.memory.LeafReport`][]: one [`eqx_lean.memory.LeafInfo`][] per leaf (path,
    stacked shape, built and stored dtypes, sharding, bytes); `print` it for a table, index it
    by path (`report[".norm.weight"].stored_dtype`).
    """
    return leaf_report(_core.plan_build(make_layer, keys, dtype, sharding, mesh))
