"""Sharding resolution (`_policy.py`) and sharded construction on a device mesh.

The multi-device checks run in this process, on the suite's eight CPU devices (`conftest.py`;
a mesh of n devices takes the first n of them). The multi-controller test needs two JAX
processes: two subprocesses with 4 CPU devices each (`python tests/test_policy.py PORT
PROCESS_ID LAYER`, the `__main__` block below) form one 8-device mesh and print a JSON dict of
results that the test reads.
"""

import contextlib
import dataclasses
import functools
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    SMALL_BLOCK,
    GPTBlock,
    GPTConfig,
    ProcessJob,
    bits,
    free_port,
    keys_of,
    mesh_of,
    print_results,
)
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqx_lean
from eqx_lean.internal import (
    cast_floating,
    compile_writes,
    constrain,
    memory_analysis,
    plan_build,
    write_temp_bytes,
)


# Every test here shards over the eight forced CPU devices (on a GPU machine too).
pytestmark = pytest.mark.cpu_mesh


# --- layers under test ------------------------------------------------------------------------

# GPT-2 medium's layer (dim 1024, hidden 4096, 16 heads): 24 MiB in bfloat16, its largest leaves
# 16 MiB each in float32, for the temp bounds of its sharded writes to bite.
MEDIUM_BLOCK = GPTConfig(num_layers=4, dim=1024, hidden=4096, heads=16)


def make_block(key):
    return GPTBlock(SMALL_BLOCK, key=key)


def make_unbiased_block(key):
    """The small block without the linear layers' biases: `None` fields, no leaves."""
    return GPTBlock(dataclasses.replace(SMALL_BLOCK, bias=False), key=key)


def make_medium_block(key):
    return GPTBlock(MEDIUM_BLOCK, key=key)


def _dict_layer(key, rows: int, columns: int) -> dict[str, jax.Array]:
    """A dict layer with a `rows x columns` matrix, a `columns` vector and a scalar."""
    kw, kb, ks = jax.random.split(key, 3)
    return {
        "w": jax.random.normal(kw, (rows, columns)),
        "b": jax.random.normal(kb, (columns,)),
        "s": jax.random.uniform(ks, ()),
    }


def make_small(key):
    return _dict_layer(key, 16, 8)


def make_wide(key):
    """`make_small` with a 16 MiB float32 matrix (4096 x 1024), big enough for temp bounds to
    bite: with JAX's own Threefry lowering on CPU, its draw needs 4x the matrix (or its shard)
    in temporaries, the case that sharded construction's bar was last met on."""
    return _dict_layer(key, 4096, 1024)


def make_linear(key):
    return eqx.nn.Linear(16, 8, key=key)


def make_uneven(key):
    return {"w": jax.random.normal(key, (12, 8))}


# What `fsdp(mesh, "data")` must choose for each leaf when the axis has more than one device
# (its largest dimension that the axis divides, the first on ties; replicated when none does),
# written out by hand for the layers above. With one device every leaf is replicated. The
# block's leaves: `dim` vectors (norms, biases), `dim x dim` projections (a tie: the first
# dimension), `up` (`hidden x dim`, its bias `hidden`) and `down` (`dim x hidden`); `dim` and
# `hidden` are multiples of 8 (so 2, 4 and 8 devices choose alike), `hidden` the larger.
BLOCK_FSDP = {
    ".attention_norm.weight": ("data",),
    ".attention_norm.bias": ("data",),
    ".attention.query_proj.weight": ("data", None),
    ".attention.query_proj.bias": ("data",),
    ".attention.key_proj.weight": ("data", None),  # no bias: `GPTAttention` says why
    ".attention.value_proj.weight": ("data", None),
    ".attention.value_proj.bias": ("data",),
    ".attention.output_proj.weight": ("data", None),
    ".attention.output_proj.bias": ("data",),
    ".mlp_norm.weight": ("data",),
    ".mlp_norm.bias": ("data",),
    ".mlp.up.weight": ("data", None),
    ".mlp.up.bias": ("data",),
    ".mlp.down.weight": (None, "data"),
    ".mlp.down.bias": ("data",),
}
SMALL_FSDP = {"['w']": ("data", None), "['b']": ("data",), "['s']": ()}
MEDIUM_BLOCK_FSDP = BLOCK_FSDP  # 1024 and 4096 are multiples of 8, and hidden is the larger

ExpectedSpecs = Callable[[str], tuple[Any, ...]]


def fsdp_specs(table: dict[str, tuple[Any, ...]], devices: int) -> ExpectedSpecs:
    return lambda path: table[path] if devices > 1 else ()


# --- comparing a sharded stack with the unsharded reference -----------------------------------


def _shard_shape(shape: tuple[int, ...], spec: tuple[Any, ...], mesh: Any) -> tuple[int, ...]:
    def devices(axes: Any) -> int:
        if axes is None:
            return 1
        names = axes if isinstance(axes, tuple) else (axes,)
        return int(np.prod([mesh.shape[name] for name in names]))

    padded = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(size // devices(axes) for size, axes in zip(shape, padded, strict=True))


def _problems(actual: Any, reference: Any, specs: ExpectedSpecs | None, mesh: Any) -> list[str]:
    """Every way the stacked `actual` differs from `reference` or from the expected shardings.

    `specs` maps a leaf's key path to its expected per-layer spec on `mesh`; the stacked leaf
    must carry `P(None, *spec)` and every device must hold only its shard.
    """
    problems = []
    if jax.tree.structure(actual) != jax.tree.structure(reference):
        return [f"structure {jax.tree.structure(actual)} != {jax.tree.structure(reference)}"]
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(reference), strict=True
    ):
        where = jax.tree_util.keystr(path)
        if not eqx.is_array(b):
            continue
        if jax.typeof(a).dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}")
            continue
        if not np.array_equal(bits(a), bits(b)):
            problems.append(f"{where}: values differ from the reference")
        if specs is None:
            continue
        stacked_spec = (None, *specs(where))
        expected = NamedSharding(mesh, P(*stacked_spec))
        if not (
            isinstance(a.sharding, NamedSharding)
            and a.sharding.mesh == mesh
            and a.sharding.is_equivalent_to(expected, a.ndim)
        ):
            problems.append(f"{where}: sharding {a.sharding} is not {expected}")
        shard_shape = _shard_shape(a.shape, stacked_spec, mesh)
        if a.sharding.num_devices != mesh.size or {s.data.shape for s in a.addressable_shards} != {
            shard_shape
        }:
            problems.append(
                f"{where}: shards {[s.data.shape for s in a.addressable_shards]} on "
                f"{a.sharding.num_devices} devices, expected {shard_shape} on {mesh.size}"
            )
    return problems


def _write_memory(
    make_layer: Callable, keys: Any, dtype: Any, sharding: Any, specs: ExpectedSpecs, mesh: Mesh
) -> dict[str, Any]:
    """Per-device `memory_analysis` of each compiled per-layer write, beside what it must be."""
    plan = plan_build(make_layer, keys, dtype, sharding, None)
    compiled = compile_writes(plan)
    layer_bytes = sum(s.size * s.dtype.itemsize for s in plan.layout.structs)
    groups = []
    for group, executable in zip(plan.groups, compiled, strict=True):
        analysis = memory_analysis(executable)
        shard_bytes = 0
        for j in group.leaves:
            struct = plan.structs[j]
            spec = (None, *specs(jax.tree_util.keystr(plan.layout.paths[j])))
            shard_elements = int(np.prod(_shard_shape(struct.shape, spec, mesh)))
            shard_bytes += shard_elements * struct.dtype.itemsize
        groups.append(
            {
                "leaves": len(group.leaves),
                "alias": analysis.alias_size_in_bytes,
                "output": analysis.output_size_in_bytes,
                "temp": analysis.temp_size_in_bytes,
                "stacked_shard_bytes": shard_bytes,
            }
        )
    return {"layer_bytes": layer_bytes, "devices": mesh.size, "groups": groups}


# --- the checks, on the suite's eight CPU devices ---------------------------------------------

SLOW = pytest.mark.slow
KINDS = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    """The independent reference: every layer at once, on one device, cast by the tests."""
    keys = keys_of(3)
    return {
        "small": eqx.filter_vmap(make_small)(keys),
        "linear": eqx.filter_vmap(make_linear)(keys),
        "block": eqx.filter_vmap(make_block)(keys),
    }


VALUE_LAYERS = {"small": (make_small, SMALL_FSDP), "block": (make_block, BLOCK_FSDP)}


def _value_case(layer: str, dtype: str, devices: int, *, slow: bool = False) -> Any:
    marks = [SLOW] if slow else []
    return pytest.param(layer, dtype, devices, id=f"{layer}/{dtype}/{devices}", marks=marks)


# A block's build compiles four writes: blocks other than bfloat16 on 8 devices are slow.
VALUE_CASES = [_value_case("small", d, n) for n in (1, 2, 4, 8) for d in DTYPES] + [
    _value_case("block", d, n, slow=(d, n) != ("bfloat16", 8)) for n in (1, 2, 4, 8) for d in DTYPES
]


@pytest.mark.parametrize("layer, dtype, devices", VALUE_CASES)
def test_sharded_values_equal_the_unsharded_build(references, layer, dtype, devices):
    """Bitwise equal to `filter_vmap` cast, each leaf sharded as `fsdp` says, on 1-8 devices."""
    make_layer, table = VALUE_LAYERS[layer]
    mesh = mesh_of((devices,), ("data",), AxisType.Auto)
    built = eqx_lean.build_stacked(make_layer, keys_of(3), DTYPES[dtype], eqx_lean.fsdp(mesh))
    reference = cast_floating(references[layer], DTYPES[dtype])
    assert _problems(built, reference, fsdp_specs(table, devices), mesh) == []


def _model_first(path: str) -> tuple[Any, ...]:
    return ("model",)


def _dict_prefix(mesh: Mesh) -> dict[str, Any]:
    """A dict prefix mixing a `PartitionSpec` (on `mesh=`), a `NamedSharding` and `None`."""
    return {"w": P(None, "model"), "b": NamedSharding(mesh, P("data")), "s": None}


DICT_PREFIX_SPECS = {"['w']": (None, "model"), "['b']": ("data",), "['s']": ()}


def _rule(mesh: Mesh) -> Callable[[Any, jax.ShapeDtypeStruct], Any]:
    """A rule giving matrices a `PartitionSpec`, vectors a `NamedSharding`, scalars `None`."""

    def rule(path: Any, leaf: jax.ShapeDtypeStruct) -> Any:
        if leaf.ndim == 2:
            return P("model", "data")
        return None if leaf.ndim == 0 else NamedSharding(mesh, P("model"))

    return rule


RULE_SPECS = {"['w']": ("model", "data"), "['b']": ("model",), "['s']": ()}


def _built_in_form(form: str, mesh: Mesh, references: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The stack that `sharding=` in the form named `form` gives on `mesh`, the reference it
    must equal, and the expected per-layer spec of each leaf (by key path)."""
    keys = keys_of(3)

    def reference(name: str, dtype: Any = jnp.bfloat16) -> Any:
        return cast_floating(references[name], dtype)

    if form == "one-sharding":  # one Sharding for every leaf: each leaf's dimension 0 divides by 4
        one = NamedSharding(mesh, P("model"))
        built = eqx_lean.build_stacked(make_linear, keys, jnp.bfloat16, one)
        return built, reference("linear"), _model_first
    if form == "spec-and-mesh":  # the same as one PartitionSpec
        built = eqx_lean.build_stacked(make_linear, keys, jnp.bfloat16, P("model"), mesh=mesh)
        return built, reference("linear"), _model_first
    if form == "prefix-dict":
        built = eqx_lean.build_stacked(
            make_small, keys, jnp.bfloat16, _dict_prefix(mesh), mesh=mesh
        )
        return built, reference("small"), DICT_PREFIX_SPECS.__getitem__
    if form == "prefix-tree-at":  # over the abstract layer; `bias` is a non-array `None` there
        abstract = eqx.filter_eval_shape(make_linear, keys[0])
        prefix = eqx.tree_at(
            lambda layer: layer.weight, jax.tree.map(lambda leaf: P(), abstract), P(None, "model")
        )
        built = eqx_lean.build_stacked(make_linear, keys, jnp.bfloat16, prefix, mesh=mesh)
        return built, reference("linear"), lambda path: (None, "model") if path == ".weight" else ()
    if form == "rule":
        built = eqx_lean.build_stacked(make_small, keys, jnp.bfloat16, _rule(mesh), mesh=mesh)
        return built, reference("small"), RULE_SPECS.__getitem__
    if form == "one-sharding-block":
        one = NamedSharding(mesh, P("model"))
        built = eqx_lean.build_stacked(make_block, keys, jnp.float32, one)
        return built, reference("block", jnp.float32), _model_first
    # A prefix over the block: one spec for all of `mlp` (its weights and biases: dimension 0
    # of each divides by 4), a NamedSharding for the query projection's weight, `None`
    # (replicated over the mesh) for the rest. Allocated, not built: the values of a block
    # build are checked above.
    assert form == "prefix-tree-at-block", form
    abstract = eqx.filter_eval_shape(make_block, keys[0])
    prefix = jax.tree.map(lambda leaf: None, abstract)
    prefix = eqx.tree_at(lambda block: block.mlp, prefix, P("model"))
    prefix = eqx.tree_at(
        lambda block: block.attention.query_proj.weight,
        prefix,
        NamedSharding(mesh, P("data", "model")),
        is_leaf=lambda x: x is None,
    )

    def prefix_specs(path: str) -> tuple[Any, ...]:
        if path.startswith(".mlp."):
            return ("model",)
        return ("data", "model") if path == ".attention.query_proj.weight" else ()

    allocated = eqx_lean.allocate_stacked(abstract, 3, jnp.float32, prefix, mesh=mesh)
    block = reference("block", jnp.float32)
    zeros = jax.tree.map(lambda x: jnp.zeros_like(x, device=jax.devices()[0]), block)
    return allocated, zeros, prefix_specs


FORMS = [
    ("one-sharding", "auto"),
    ("one-sharding", "explicit"),
    ("spec-and-mesh", "auto"),
    ("spec-and-mesh", "explicit"),
    ("prefix-dict", "auto"),
    ("prefix-dict", "explicit"),
    ("prefix-tree-at", "auto"),
    ("prefix-tree-at", "explicit"),
    ("rule", "auto"),
    ("rule", "explicit"),
    # The block, one mesh kind each: its build compiles four writes.
    ("one-sharding-block", "explicit"),
    ("prefix-tree-at-block", "auto"),
]


@pytest.mark.parametrize("form, kind", FORMS)
def test_every_form_of_sharding_is_honoured(references, form, kind):
    """Values as the unsharded reference; each leaf `P(None, *its spec)` on the 2 x 4 mesh."""
    mesh = mesh_of((2, 4), ("data", "model"), KINDS[kind])
    built, reference, specs = _built_in_form(form, mesh, references)
    assert _problems(built, reference, specs, mesh) == []


def test_a_fully_replicated_sharding_that_is_not_named(references):
    """All of the stack on one device."""
    device = jax.devices()[3]
    built = eqx_lean.build_stacked(
        make_small, keys_of(3), jnp.bfloat16, jax.sharding.SingleDeviceSharding(device)
    )
    reference = cast_floating(references["small"], jnp.bfloat16)
    assert _problems(built, reference, None, None) == []
    assert sorted({d.id for x in jax.tree.leaves(built) for d in x.devices()}) == [3]


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_allocate_stacked_shards_its_buffers(references, kind):
    mesh = mesh_of((2, 4), ("data", "model"), KINDS[kind])
    abstract = eqx.filter_eval_shape(make_small, jax.random.key(0))
    allocated = eqx_lean.allocate_stacked(abstract, 3, jnp.bfloat16, _rule(mesh), mesh=mesh)
    reference = cast_floating(references["small"], jnp.bfloat16)
    zeros = jax.tree.map(lambda x: jnp.zeros_like(x, device=jax.devices()[0]), reference)
    assert _problems(allocated, zeros, RULE_SPECS.__getitem__, mesh) == []


def assert_lean_writes(analysis: dict[str, Any]) -> None:
    """Each write updates its stacked shards in place, with one layer's shard of temporaries."""
    temp_bound = 3 * analysis["layer_bytes"] / analysis["devices"] + 2**20
    for group in analysis["groups"]:
        assert group["alias"] == group["stacked_shard_bytes"], group
        assert 0 <= group["output"] - group["alias"] <= 8 * group["leaves"], group
        assert group["temp"] <= temp_bound, (group, temp_bound)


# Each case's stack, built by `fsdp` over an 8-device mesh: its layer, how many layers, their
# dtype, the mesh's axis type and the per-layer specs `fsdp` must choose. "wide" is a layer
# made of one 16 MiB float32 leaf: with Threefry's default CPU lowering (a rolled loop) its draw
# alone needs 4 x the leaf's shard, so it is the case that fails without the unrolled lowering
# of `eqx_lean._threefry`. "medium-block" is GPT-2 medium's layer.
FSDP_WRITES = {
    "block-fsdp/bfloat16": (make_block, 3, jnp.bfloat16, AxisType.Auto, BLOCK_FSDP),
    "block-fsdp/float32": (make_block, 3, jnp.float32, AxisType.Auto, BLOCK_FSDP),
    "wide/auto": (make_wide, 4, jnp.bfloat16, AxisType.Auto, SMALL_FSDP),
    "wide/explicit": (make_wide, 4, jnp.bfloat16, AxisType.Explicit, SMALL_FSDP),
    "medium-block/auto": (make_medium_block, 4, jnp.bfloat16, AxisType.Auto, MEDIUM_BLOCK_FSDP),
    "medium-block/explicit": (
        make_medium_block,
        4,
        jnp.bfloat16,
        AxisType.Explicit,
        MEDIUM_BLOCK_FSDP,
    ),
}


def _memory_of(case: str) -> dict[str, Any]:
    """`_write_memory` of an `FSDP_WRITES` case, or of the block with one `P("model")` for
    every leaf on a 2 x 4 mesh ("block-one-sharding/explicit")."""
    if case == "block-one-sharding/explicit":
        mesh = mesh_of((2, 4), ("data", "model"), AxisType.Explicit)
        one = NamedSharding(mesh, P("model"))
        return _write_memory(make_block, keys_of(3), jnp.float32, one, _model_first, mesh)
    make_layer, num_layers, dtype, axis_type, table = FSDP_WRITES[case]
    mesh = mesh_of((8,), ("data",), axis_type)
    fsdp = eqx_lean.fsdp(mesh)
    return _write_memory(make_layer, keys_of(num_layers), dtype, fsdp, fsdp_specs(table, 8), mesh)


@pytest.fixture(scope="module")
def write_memory() -> Callable[[str], dict[str, Any]]:
    """`_memory_of`, each case compiled once in this module (the "wide" ones serve two tests)."""
    return functools.cache(_memory_of)


MEMORY_CASES = [
    "block-fsdp/bfloat16",
    pytest.param("block-fsdp/float32", marks=SLOW),
    "block-one-sharding/explicit",
    # The unrolled Threefry lowering of `eqx_lean._threefry` (a private path, for XLA:CPU)
    # is what keeps these two lean.
    pytest.param("wide/auto", marks=[pytest.mark.private_jax, pytest.mark.xla_cpu]),
    pytest.param("wide/explicit", marks=[pytest.mark.private_jax, pytest.mark.xla_cpu]),
    pytest.param("medium-block/auto", marks=SLOW),
    pytest.param("medium-block/explicit", marks=SLOW),
]


@pytest.mark.parametrize("case", MEMORY_CASES)
def test_per_layer_writes_alias_the_stacked_shards(write_memory, case):
    assert_lean_writes(write_memory(case))


@pytest.fixture(scope="module")
def wide_unsharded_temp() -> list[int]:
    """The temporaries of the "wide" writes unsharded (one device), to compare against."""
    return write_temp_bytes(plan_build(make_wide, keys_of(4), jnp.bfloat16))


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_wide_leaf_is_built_sharded(write_memory, wide_unsharded_temp, kind):
    """Per device, the writes need an eighth of the unsharded writes' temporaries."""
    analysis = write_memory(f"wide/{kind}")
    unsharded = wide_unsharded_temp
    sharded = sorted((group["temp"] for group in analysis["groups"]), reverse=True)
    assert sharded[0] <= unsharded[0] / 8 + 64 * 2**10
    for group in analysis["groups"]:
        assert group["alias"] == group["stacked_shard_bytes"], group
        assert 0 <= group["output"] - group["alias"] <= 8 * group["leaves"], group


def _build_small(mesh: Mesh) -> Callable[[Any], Any]:
    def build(keys: Any) -> Any:
        return eqx_lean.build_stacked(make_small, keys, jnp.bfloat16, eqx_lean.fsdp(mesh))

    return build


@pytest.mark.parametrize("case", ["set-mesh/auto", "set-mesh/explicit", "no-mesh/auto"])
def test_under_filter_jit(references, case):
    """Under `jit`, an Explicit mesh must be the ambient one: the user's `jax.set_mesh`."""
    ambient, kind = case.split("/")
    mesh = mesh_of((8,), ("data",), KINDS[kind])
    with jax.set_mesh(mesh) if ambient == "set-mesh" else contextlib.nullcontext():
        built = eqx.filter_jit(_build_small(mesh))(keys_of(3))
    reference = cast_floating(references["small"], jnp.bfloat16)
    assert _problems(built, reference, fsdp_specs(SMALL_FSDP, 8), mesh) == []


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_under_filter_eval_shape_allocates_nothing(kind):
    mesh = mesh_of((8,), ("data",), KINDS[kind])
    keys = keys_of(3)  # ready before the count: no pending computation lands during it
    before = {id(x) for x in jax.live_arrays()}
    abstract = eqx.filter_eval_shape(_build_small(mesh), keys)
    after = {id(x) for x in jax.live_arrays()}
    assert len(after - before) == 0
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    shapes = {
        jax.tree_util.keystr(p): [list(x.shape), x.dtype.name]
        for p, x in jax.tree_util.tree_leaves_with_path(abstract)
    }
    assert shapes == {
        "['b']": [[3, 8], "bfloat16"],
        "['s']": [[3], "bfloat16"],
        "['w']": [[3, 16, 8], "bfloat16"],
    }


def where(*parts: str) -> str:
    return ".*".join(re.escape(part) for part in parts)


def test_error_spec_not_dividing_a_dimension():
    mesh = mesh_of((8,), ("data",), AxisType.Auto)
    with pytest.raises(ValueError, match=where("['w']", "(12, 8)", "P('data',)", "divisible")):
        eqx_lean.build_stacked(make_uneven, keys_of(3), None, P("data"), mesh=mesh)
    with pytest.raises(ValueError, match=where("['w']", "(12, 8)", "('data',)", "divisible")):
        eqx_lean.allocate_stacked(
            {"w": jax.ShapeDtypeStruct((12, 8), jnp.float32)},
            3,
            sharding=NamedSharding(mesh, P(("data",))),
        )


def test_error_non_named_sharding():
    # JAX's only public Shardings are named or on one device: a sharded one that is not named
    # is internal. Where it is gone, this import fails, saying why.
    from jax._src.sharding_impls import GSPMDSharding

    mesh = mesh_of((8,), ("data",), AxisType.Auto)
    hlo = NamedSharding(mesh, P("data"))._to_xla_hlo_sharding(2)
    positional = GSPMDSharding(tuple(mesh.devices.flat), hlo)
    sharding = {"w": positional, "b": None, "s": None}
    with pytest.raises(TypeError, match=where("['w']", "NamedSharding", "fully replicated")):
        eqx_lean.build_stacked(make_small, keys_of(3), None, sharding)


# --- checks that one device can answer --------------------------------------------------------


def test_fsdp_shards_norms_whose_width_the_axis_divides():
    """What `fsdp`'s docstring says: vectors (norms, biases) are sharded like matrices when the
    axis divides their width; only leaves with no divisible dimension are replicated."""
    eight = eqx_lean.fsdp(jax.sharding.AbstractMesh((8,), ("data",)))  # no devices needed

    def spec(shape: tuple[int, ...], rule: Any = eight) -> P:
        return rule((), jax.ShapeDtypeStruct(shape, jnp.bfloat16)).spec

    assert spec((1024,)) == P("data")  # a 1024-wide norm on 8 devices: 8 pieces of 128
    assert spec((12,)) == P()  # a width 8 does not divide: replicated
    assert spec(()) == P()  # scalars: replicated
    assert spec((12, 1024)) == P(None, "data")  # the largest divisible dimension
    assert spec((1024, 1024)) == P("data", None)  # the first of equal ones
    assert spec((16, 12)) == P("data", None)  # the only divisible one, though not the largest
    one_device = eqx_lean.fsdp(jax.sharding.AbstractMesh((1,), ("data",)))
    assert spec((1024,), one_device) == spec((1024, 1024), one_device) == P()


@pytest.fixture(scope="module")
def one_device_mesh() -> Mesh:
    return jax.make_mesh((1,), ("data",), (AxisType.Auto,), devices=jax.devices()[:1])


def test_error_spec_naming_an_unknown_axis(one_device_mesh):
    keys = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(ValueError, match=where("['w']", "(16, 8)", "P('model',)", "'model'")):
        sharding = {"w": P("model"), "b": None, "s": None}
        eqx_lean.build_stacked(make_small, keys, None, sharding, mesh=one_device_mesh)


def test_error_spec_longer_than_the_rank(one_device_mesh):
    keys = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(ValueError, match=where("['b']", "(8,)", "P(None, 'data')", "more dim")):
        eqx_lean.build_stacked(make_small, keys, None, P(None, "data"), mesh=one_device_mesh)


def test_error_mesh_axis_named_twice(one_device_mesh):
    keys = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(
        ValueError, match=where("['w']", "(16, 8)", "P('data', 'data')", "more than once")
    ):
        sharding = {"w": P("data", "data"), "b": None, "s": None}
        eqx_lean.build_stacked(make_small, keys, None, sharding, mesh=one_device_mesh)


def test_a_spec_with_the_layer_axis_explains_the_per_layer_meaning(one_device_mesh):
    keys = jax.random.split(jax.random.key(0), 2)
    sharding = {"w": P(None, "data", None), "b": None, "s": None}
    with pytest.raises(ValueError, match=where("['w']", "(16, 8)", "Since eqx_lean 0.2.0")):
        eqx_lean.build_stacked(make_small, keys, None, sharding, mesh=one_device_mesh)


def test_a_mesh_set_with_set_mesh_serves_as_the_default(one_device_mesh):
    keys = jax.random.split(jax.random.key(0), 2)
    with jax.set_mesh(one_device_mesh):
        built = eqx_lean.build_stacked(make_small, keys, None, P())
    for x in jax.tree.leaves(built):
        assert x.sharding.is_equivalent_to(NamedSharding(one_device_mesh, P()), x.ndim)


def test_error_partition_spec_without_mesh():
    keys = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(ValueError, match=where("['b']", "PartitionSpec", "`mesh=`")):
        eqx_lean.build_stacked(make_small, keys, None, P())


def test_error_prefix_that_does_not_match(one_device_mesh):
    keys = jax.random.split(jax.random.key(0), 2)
    sharding = {"w": P(), "bias": P(), "s": P()}
    with pytest.raises(ValueError, match="`sharding` must be .* pytree prefix of the layer"):
        eqx_lean.build_stacked(make_small, keys, None, sharding, mesh=one_device_mesh)
    with pytest.raises(ValueError, match="does not match the layer"):
        eqx_lean.allocate_stacked(
            eqx.filter_eval_shape(make_block, keys[0]), 2, None, [P()], mesh=one_device_mesh
        )


def test_prefix_over_a_layer_with_none_fields(one_device_mesh):
    """`bias=None` in `eqx.nn.Linear` is no leaf: a prefix mapped over the layer has it too."""
    abstract = eqx.filter_eval_shape(make_unbiased_block, jax.random.key(0))
    prefix = jax.tree.map(lambda leaf: P(), abstract)
    prefix = eqx.tree_at(lambda block: block.mlp, prefix, P(None, "data"))
    allocated = eqx_lean.allocate_stacked(abstract, 2, None, prefix, mesh=one_device_mesh)
    for path, x in jax.tree_util.tree_leaves_with_path(allocated):
        spec = P(None, None, "data") if jax.tree_util.keystr(path).startswith(".mlp.") else P()
        assert x.sharding.is_equivalent_to(NamedSharding(one_device_mesh, spec), x.ndim), path
        assert x.sharding.spec == (spec if spec != P() else P(None)), path


class CustomError(Exception):
    pass


def test_a_rule_that_raises_names_its_leaf_argument_and_the_path_convention(one_device_mesh):
    """A user's rule failing (a name map without the path it was given) is re-raised with the
    leaf, the argument and where paths are relative to; its own exception is the cause."""
    keys = jax.random.split(jax.random.key(0), 2)
    per_model = {".blocks['w']": jnp.bfloat16}  # written for a whole model's paths

    def dtype_rule(path, leaf):
        return per_model[jax.tree_util.keystr(path)]

    with pytest.raises(KeyError) as caught:
        eqx_lean.build_stacked(make_small, keys, dtype_rule)
    message = str(caught.value)
    assert message.startswith(
        "The `dtype` rule raised KeyError: \"['b']\" for leaf ['b'] (float32[8])."
    ), message
    assert "relative to the tree they are given: one layer in build_stacked" in message
    assert "'Paths in rules and name functions' in docs/getting-started.md" in message
    assert isinstance(caught.value.__cause__, KeyError)
    assert caught.value.__cause__.args == ("['b']",)

    def sharding_rule(path, leaf):
        raise CustomError("no spec for this leaf")

    for call in [
        lambda: eqx_lean.build_stacked(make_small, keys, None, sharding_rule, mesh=one_device_mesh),
        lambda: eqx_lean.allocate_stacked(
            eqx.filter_eval_shape(make_small, keys[0]), 2, None, sharding_rule
        ),
    ]:
        # A user's own exception type becomes a ValueError, caused by it.
        with pytest.raises(
            ValueError, match=r"The `sharding` rule raised CustomError: no spec"
        ) as e:
            call()
        assert "for leaf ['b'] (float32[8])" in str(e.value)
        assert isinstance(e.value.__cause__, CustomError)

    # `gather=` rules go through the same resolver, named as `gather`.
    square = lambda k: eqx.nn.Linear(8, 8, key=k)  # noqa: E731
    stacked = eqx_lean.build_stacked(square, keys, None, P(), mesh=one_device_mesh)

    def gather_rule(path, leaf):
        raise IndexError("out of specs")

    with pytest.raises(IndexError, match=r"The `gather` rule raised IndexError: out of specs") as e:
        eqx_lean.fold(stacked, jnp.ones(8), gather=gather_rule)
    assert "for leaf .weight (float32[8, 8])" in str(e.value)


def test_error_fsdp_unknown_axis(one_device_mesh):
    with pytest.raises(ValueError, match=where("`axis`", "['model']", "('data',)")):
        eqx_lean.fsdp(one_device_mesh, "model")


def test_fsdp_on_one_device_replicates(one_device_mesh):
    rule = eqx_lean.fsdp(one_device_mesh)
    leaf = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    assert rule((), leaf) == NamedSharding(one_device_mesh, P())


def test_constrain_reshards_on_explicit_axes_and_constrains_on_auto_ones(one_device_mesh):
    x = jnp.arange(8.0)
    assert constrain(x, None) is x

    def only_equation(fn: Callable) -> tuple[str, dict[str, Any]]:
        (eqn,) = jax.make_jaxpr(fn)(x).eqns
        return eqn.primitive.name, eqn.params

    explicit_mesh = jax.make_mesh((1,), ("data",), (AxisType.Explicit,), devices=jax.devices()[:1])
    name, params = only_equation(lambda x: constrain(x, NamedSharding(explicit_mesh, P("data"))))
    assert (name, params["dst_sharding"].spec) == ("reshard", P("data"))
    auto = NamedSharding(one_device_mesh, P("data"))
    name, params = only_equation(lambda x: constrain(x, auto))
    assert (name, params["sharding"]) == ("sharding_constraint", auto)
    # Inside `auto_axes` only the spec is given: the sharding is the context's (abstract) mesh's.
    with jax.set_mesh(one_device_mesh):
        name, params = only_equation(lambda x: constrain(x, auto, inside_auto_axes=True))
    assert (name, params["sharding"].spec) == ("sharding_constraint", P("data"))
    assert params["sharding"] != auto


# --- the multi-controller check: two JAX processes --------------------------------------------


def _multiprocess_check(port: int, process_id: int, layer: str) -> dict[str, Any]:
    """Run by each of the two processes, which form one 8-device mesh (4 devices each)."""
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        local_device_ids=list(range(4)),
    )
    from jax.experimental import multihost_utils

    make_layer = {"small": make_small, "block": make_block}[layer]
    table = {"small": SMALL_FSDP, "block": BLOCK_FSDP}[layer]
    keys = jax.random.split(jax.random.key(0), 3)
    mesh = jax.make_mesh((8,), ("data",))
    built = eqx_lean.build_stacked(make_layer, keys, jnp.bfloat16, eqx_lean.fsdp(mesh))
    # Computed here, on this process's first device only: no collective, no other process.
    with jax.default_device(jax.local_devices()[0]):
        reference = cast_floating(eqx.filter_vmap(make_layer)(keys), jnp.bfloat16)
    local = set(jax.local_devices())
    leaves = {}
    for (path, x), ref in zip(
        jax.tree_util.tree_leaves_with_path(built), jax.tree.leaves(reference), strict=True
    ):
        where = jax.tree_util.keystr(path)
        spec = (None, *table[where])
        expected_shard = _shard_shape(x.shape, spec, mesh)
        gathered = multihost_utils.process_allgather(x, tiled=True)
        leaves[where] = {
            "fully_addressable": x.is_fully_addressable,
            "addressable_shards": len(x.addressable_shards),
            "shards_on_local_devices": all(s.device in local for s in x.addressable_shards),
            "shard_shapes_ok": all(s.data.shape == expected_shard for s in x.addressable_shards),
            "shards_equal_reference": all(
                np.array_equal(bits(s.data), bits(np.asarray(ref)[s.index]))
                for s in x.addressable_shards
            ),
            "gathered_equal_reference": bool(np.array_equal(bits(gathered), bits(ref))),
            "sharding_ok": isinstance(x.sharding, NamedSharding)
            and x.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), x.ndim),
        }
    result = {
        "process_index": jax.process_index(),
        "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "leaves": leaves,
    }
    jax.distributed.shutdown()
    return result


def _two_process_job(layer: str) -> ProcessJob:
    port = free_port()
    commands = [[sys.executable, __file__, str(port), str(i), layer] for i in range(2)]
    return ProcessJob(commands, devices=4, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def two_process_job(request) -> Iterator[ProcessJob | None]:
    """Starts the two processes at this module's first test, when a selected test reads them,
    so that they run while the checks above run in this process."""
    here = Path(__file__)
    wanted = any(
        Path(str(item.path)) == here and "two_processes" in getattr(item, "fixturenames", ())
        for item in request.session.items
    )
    job = _two_process_job("small") if wanted else None
    yield job
    if job is not None:
        job.stop()


@pytest.fixture(scope="module")
def two_processes(two_process_job: ProcessJob | None) -> list[dict[str, Any]]:
    assert two_process_job is not None, "started for every selected test that reads it"
    return two_process_job.results()


def assert_multiprocess_build(outputs: list[dict[str, Any]], paths: set[str]) -> None:
    assert sorted(out["process_index"] for out in outputs) == [0, 1]
    for out in outputs:
        assert (out["devices"], out["local_devices"]) == (8, 4)
        assert set(out["leaves"]) == paths
        for path, leaf in out["leaves"].items():
            assert leaf == {
                "fully_addressable": False,
                "addressable_shards": 4,
                "shards_on_local_devices": True,
                "shard_shapes_ok": True,
                "shards_equal_reference": True,
                "gathered_equal_reference": True,
                "sharding_ok": True,
            }, (out["process_index"], path)


def test_two_processes_build_one_global_stack(two_processes):
    """Two controllers with 4 CPU devices each build one stack sharded over all 8 devices."""
    assert_multiprocess_build(two_processes, set(SMALL_FSDP))


@pytest.mark.slow
def test_two_processes_build_one_global_stack_of_blocks():
    assert_multiprocess_build(_two_process_job("block").results(), set(BLOCK_FSDP))


def _main(argv: list[str]) -> None:
    """One of the two processes: `python tests/test_policy.py PORT PROCESS_ID LAYER`."""
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, process_id, layer = argv
    results = _multiprocess_check(int(port), int(process_id), layer)
    print_results(results)


if __name__ == "__main__":
    _main(sys.argv[1:])
