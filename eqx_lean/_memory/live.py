"""What is allocated now: the live JAX arrays, grouped and sized."""

import dataclasses

import jax
from jax.sharding import NamedSharding, Sharding, SingleDeviceSharding

from .._core import shard_bytes
from .table import format_bytes, table


def physical_nbytes(x: jax.Array) -> int:
    """Bytes an array occupies over all its devices: each shard, replicas counted separately."""
    return shard_bytes(x) * len(x.sharding.device_set)


def live_jax_arrays() -> list[jax.Array]:
    return [x for x in jax.live_arrays() if not x.is_deleted()]


def live_bytes() -> int:
    return sum(physical_nbytes(x) for x in live_jax_arrays())


def _describe_sharding(sharding: Sharding) -> str:
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        return f"{device.platform}:{device.id}"
    if isinstance(sharding, NamedSharding):
        mesh = ", ".join(f"{name}={size}" for name, size in sharding.mesh.shape.items())
        return f"{sharding.spec} over ({mesh})"
    return f"{type(sharding).__name__} over {len(sharding.device_set)} devices"


@dataclasses.dataclass(frozen=True)
class LiveArrayGroup:
    """Live arrays that share a shape, a dtype and a sharding.

    **Attributes:**

    - `shape`, `dtype`: of each array.
    - `sharding`: a short description of their sharding (`"cpu:0"`, a `PartitionSpec` and mesh).
    - `count`: how many such arrays are alive.
    - `nbytes`: their bytes together, over all devices (replicas counted).
    """

    shape: tuple[int, ...]
    dtype: str
    sharding: str
    count: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class LiveArrayReport:
    """The live JAX arrays, grouped and sorted by bytes; from [`eqx_lean.memory.live_arrays`][].

    **Attributes:**

    - `groups`: the largest groups, largest first.
    - `count`, `nbytes`: all live arrays, including groups left out of `groups`.
    - `omitted`: how many groups were left out.
    """

    groups: tuple[LiveArrayGroup, ...]
    count: int
    nbytes: int
    omitted: int

    def table(self) -> str:
        """The report as an aligned text table."""
        rows = [
            (f"{g.dtype}{list(g.shape)}", g.sharding, str(g.count), format_bytes(g.nbytes))
            for g in self.groups
        ]
        body = table(("array", "sharding", "count", "bytes"), rows)
        more = f" ({self.omitted} smaller groups not shown)" if self.omitted else ""
        return f"{self.count} live arrays, {format_bytes(self.nbytes)}{more}\n{body}"

    def __repr__(self) -> str:
        return f"LiveArrayReport(\n{self.table()}\n)"


def live_arrays(*, top: int | None = 20) -> LiveArrayReport:
    """Reports the live JAX arrays grouped by shape, dtype and sharding, largest first.

    For finding leaks: call it before and after a step and compare, or look for arrays that
    should have been freed (such as a float32 copy of a model that lives in bfloat16).

    ```python
    print(eqx_lean.memory.live_arrays(top=10))
    ```

    **Arguments:**

    - `top`: how many groups to keep (the largest by bytes); `None` keeps all.

    **Returns:**

    A [`eqx_lean.memory.LiveArrayReport`][]; `print` it for a table.
    """
    if top is not None and (not isinstance(top, int) or top < 0):
        raise ValueError(f"`top` must be a non-negative integer or None; got {top!r}.")
    counts: dict[tuple[tuple[int, ...], str, str], list[int]] = {}
    arrays = live_jax_arrays()
    for x in arrays:
        key = (tuple(x.shape), str(x.dtype), _describe_sharding(x.sharding))
        entry = counts.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += physical_nbytes(x)
    groups = sorted(
        (
            LiveArrayGroup(shape, dtype, sharding, count, nbytes)
            for (shape, dtype, sharding), (count, nbytes) in counts.items()
        ),
        key=lambda g: (-g.nbytes, -g.count, g.dtype, g.shape),
    )
    kept = groups if top is None else groups[:top]
    return LiveArrayReport(
        groups=tuple(kept),
        count=len(arrays),
        nbytes=sum(g.nbytes for g in groups),
        omitted=len(groups) - len(kept),
    )
