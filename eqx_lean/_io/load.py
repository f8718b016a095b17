"""Loading: checkpoint tensors streamed into preallocated (and possibly sharded) buffers."""

import os
from collections.abc import Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh

from .._core import (
    DtypePolicy,
    KeyPath,
    LayerAxis,
    Layout,
    ShardingPolicy,
    check_dtype_policy,
    delete_arrays,
    layer_struct,
    resolve_dtypes,
)
from .._core.chunk_plan import BufferPlan
from .._core.chunks import (
    allocate_buffers,
    compile_chunk_writes,
    fill_chunks,
    plan_chunks,
)
from ..quant._linear import QuantConfig
from .checks import Leaf, check_checkpoint, select_layers
from .file_backed import file_backed_leaves
from .names import (
    TensorName,
    check_transpose_rank,
    layer_count,
    require_all_stacked,
    resolve_names,
)
from .placement import resolve_load_shardings
from .quantized import (
    check_quantized_leaf,
    load_quantized_leaf,
    quant_config,
    quantized_modules,
    weight_path,
    with_quantized_linears,
)
from .safetensors import Maps  # Test seam: tests/test_plan_estimate.py makes reads fail.
from .snapshot import Checkpoint, opened


M = TypeVar("M")

# One call of a compiled write copies at most this many bytes (in the stored dtype, over every
# leaf it fills and every distinct shard), so a load needs no more than this beside the model,
# whatever the size of the largest tensor.
# Test seam: tests/test_io_load.py and test_io.py make chunks small (benchmarks/plan_vs_measured.py
# reads it).
_CHUNK_BYTES = 4 * 2**20


def _loaded_structs(
    layout: Layout, tensor_names: Sequence[TensorName | None], dtype: DtypePolicy
) -> list[jax.ShapeDtypeStruct]:
    # A dtype rule sees one layer of a stacked leaf, as in `build_stacked`, and rules by module
    # type are resolved against `like`.
    seen = [
        layer_struct(leaf) if name is not None and name.stacked else leaf
        for leaf, name in zip(layout.structs, tensor_names, strict=True)
    ]
    chosen = resolve_dtypes(dtype, layout.combine(layout.structs), layout.paths, seen)
    return [
        jax.ShapeDtypeStruct(leaf.shape, loaded)
        for leaf, (loaded, _) in zip(layout.structs, chosen, strict=True)
    ]


def _plan_leaves(
    like: Any,
    names: Any,
    dtype: DtypePolicy,
    sharding: Any,
    mesh: Any,
    layer_axis: Any,
    fn: str,
    quantized: dict[KeyPath, str],
) -> tuple[Layout, list[Leaf], int | None]:
    """The leaves to load; `quantized` (a weight's path to its module's name) are checked as
    weights to quantise."""
    layout = Layout.of(like)
    tensor_names = resolve_names(names, layout, fn)
    if fn == "load_stacked":
        require_all_stacked(layout, tensor_names, fn)
    num_layers = layer_count(layout, tensor_names)
    shardings = resolve_load_shardings(sharding, mesh, layer_axis, layout, tensor_names, num_layers)
    concrete = {
        path: x
        for path, x in jax.tree_util.tree_flatten_with_path(eqx.filter(like, eqx.is_array))[0]
    }
    structs = _loaded_structs(layout, tensor_names, dtype)
    leaves = []
    for path, leaf, name, leaf_sharding, struct in zip(
        layout.paths, layout.structs, tensor_names, shardings, structs, strict=True
    ):
        if name is None and path not in concrete:
            raise ValueError(
                f"`names` gives no tensor for leaf {jax.tree_util.keystr(path)}, so it is not "
                "loaded and must be kept from `like`, but `like` holds only its shape there. "
                "Name its tensor, or pass the array itself in `like`."
            )
        if name is not None:
            check_transpose_rank(path, name, leaf.shape[1:] if name.stacked else leaf.shape)
        leaves.append(Leaf(path, struct, name, concrete.get(path), leaf_sharding))
        if path in quantized:
            check_quantized_leaf(leaves[-1], quantized[path])
    return layout, leaves, num_layers


# Test seam: tests/test_io.py wraps it to record what each device reads.
def _host_slice(stored: np.ndarray, name: TensorName, index: tuple[slice, ...]) -> np.ndarray:
    """The part `index` (in the leaf's axis order) of a stored tensor, as a view when possible."""
    view = stored if name.transpose is None else stored.transpose(name.transpose)
    return view[(*index, ...)]  # the Ellipsis keeps a scalar a (0-d) view


class _Reader:
    """Reads the leaves' tensors from memory maps of the checkpoint's files."""

    def __init__(
        self,
        leaves: Sequence[Leaf],
        checkpoint: Checkpoint,
        selected: Sequence[int] | None,
        maps: Maps,
    ):
        self.leaves, self.checkpoint, self.selected, self.maps = leaves, checkpoint, selected, maps

    def _tensor(self, j: int, layer: int | None):
        name = self.leaves[j].name
        assert name is not None
        at = None if layer is None else (self.selected or ())[layer]
        return name, self.checkpoint.tensors[name.at(at)]

    def read(self, j: int, layer: int | None, index: tuple[slice, ...]) -> np.ndarray:
        name, tensor = self._tensor(j, layer)
        return _host_slice(self.maps.view(tensor), name, index)

    def release(self, members: Sequence[int], layer: int | None) -> None:
        for j in members:
            self.maps.release(self._tensor(j, layer)[1])


# Test seam: tests/test_io_load.py and test_io.py make it fail, to show a refusal allocates nothing.
def _allocate(plans: Sequence[BufferPlan]) -> list[Any]:
    return allocate_buffers(plans)


def _load_into(
    leaves: Sequence[Leaf],
    checkpoint: Checkpoint,
    selected: Sequence[int] | None,
    quantize: QuantConfig | None,
    quantized: dict[KeyPath, str],
    file_backed: bool,
) -> list[Any]:
    """The leaves' values: the named ones filled from `checkpoint` (those in `quantized`
    quantised with `quantize` as they stream, after the others) or, with `file_backed`, mapped
    from its files; the rest as `like` held."""
    named = [
        j for j, leaf in enumerate(leaves) if leaf.name is not None and leaf.path not in quantized
    ]
    if file_backed:
        mapped = file_backed_leaves([leaves[j] for j in named], checkpoint, selected)
        loaded = dict(zip(named, mapped, strict=True))
        return [loaded[j] if j in loaded else leaf.source for j, leaf in enumerate(leaves)]
    plans = []
    for j in named:
        leaf = leaves[j]
        assert leaf.name is not None
        first = leaf.name.at((selected or (None,))[0] if leaf.name.stacked else None)
        stored = checkpoint.tensors[first].dtype
        plans.append(BufferPlan(leaf.struct, leaf.sharding, leaf.name.stacked, stored))
    groups = plan_chunks(plans, _CHUNK_BYTES)
    compiled = compile_chunk_writes(groups)  # before allocating: see its docstring
    buffers = _allocate(plans)
    maps = Maps(checkpoint.fds)
    try:
        reader = _Reader([leaves[j] for j in named], checkpoint, selected, maps)
        fill_chunks(groups, compiled, buffers, reader.read, reader.release)
    except BaseException:
        delete_arrays(buffers)
        raise
    finally:
        maps.close()
    loaded = dict(zip(named, buffers, strict=True))
    try:
        for j, leaf in enumerate(leaves):
            if leaf.path in quantized:
                assert quantize is not None
                module = quantized[leaf.path]
                loaded[j] = load_quantized_leaf(checkpoint, leaf, selected, quantize, module)
    except BaseException:
        delete_arrays(jax.tree.leaves(list(loaded.values())))
        raise
    return [loaded[j] if j in loaded else leaf.source for j, leaf in enumerate(leaves)]


def _load(
    path: Any,
    like: Any,
    names: Any,
    *,
    dtype: DtypePolicy,
    sharding: Any,
    mesh: Any,
    layer_axis: Any,
    layers: Any,
    strict: bool,
    quantize: Any,
    file_backed: Any,
    fn: str,
) -> Any:
    dtype = check_dtype_policy(dtype)
    config = quant_config(quantize)
    if not isinstance(file_backed, bool):
        raise TypeError(f"`file_backed` must be True or False; got {file_backed!r}.")
    if file_backed and config is not None:
        raise ValueError(
            "`file_backed=True` makes arrays of the checkpoint's stored values, and `quantize` "
            "makes new values from them: pass one of the two."
        )
    modules = quantized_modules(like, config)
    quantized = {weight_path(path): name for path, name in modules.items()}
    layout, leaves, num_layers = _plan_leaves(
        like, names, dtype, sharding, mesh, layer_axis, fn, quantized
    )
    selected = select_layers(layers, num_layers)
    if not isinstance(strict, bool):
        raise TypeError(
            f"`strict` must be True (every tensor of the checkpoint must be loaded) or False; "
            f"got {strict!r}."
        )
    with opened(path) as checkpoint:
        check_checkpoint(leaves, checkpoint, selected, layers is not None, strict, fn)
        values = _load_into(leaves, checkpoint, selected, config, quantized, file_backed)
    weights = {
        leaf.path: v for leaf, v in zip(leaves, values, strict=True) if leaf.path in quantized
    }
    # `combine` takes arrays; the quantised weights (pytrees) go in with their modules.
    values = [None if leaf.path in quantized else v for leaf, v in zip(leaves, values, strict=True)]
    return with_quantized_linears(layout.combine(values), modules, weights)


def checkpoint_tensors(
    path: str | os.PathLike | Sequence[str | os.PathLike] | Checkpoint,
) -> dict[str, jax.ShapeDtypeStruct]:
    """The tensors a checkpoint holds, read from its headers only: nothing is loaded.

    Every header is checked as [`eqx_lean.load_tensors`][] checks it (a bad file is an error
    naming it), so this is the way to compare a checkpoint with a configuration before loading
    it, as the Mistral example's `load_hf` does with `config.json`:

    ```python
    stored = eqx_lean.checkpoint_tensors("Mistral-7B-v0.1/")
    stored["model.layers.0.mlp.up_proj.weight"]  # ShapeDtypeStruct(shape=(14336, 4096), ...)
    ```

    **Arguments:**

    - `path`: as for [`eqx_lean.load_stacked`][]: a directory, a safetensors file, a list of
        them, or an index file.

    **Returns:**

    A dict from tensor name to a `jax.ShapeDtypeStruct` of its shape and stored dtype, in the
    order the files hold them.
    """
    with opened(path) as checkpoint:
        return {
            name: jax.ShapeDtypeStruct(tensor.shape, tensor.dtype)
            for name, tensor in checkpoint.tensors.items()
        }


def load_tensors(
    path: str | os.PathLike | Sequence[str | os.PathLike] | Checkpoint,
    like: M,
    names: Any,
    *,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    mesh: Mesh | None = None,
    layer_axis: LayerAxis = None,
    layers: int | range | None = None,
    strict: bool = True,
    quantize: QuantConfig | str | None = None,
    file_backed: bool = False,
) -> M:
    """Loads a whole model from safetensors files, straight into its final buffers.

    Like [`eqx_lean.load_stacked`][], but for any model: a leaf whose name contains `{i}` is
    stacked (its leading axis is the layer axis, one tensor per layer), any other name is one
    tensor holding the whole leaf (an embedding, a final norm, a head). So a whole Hugging Face
    checkpoint loads in one call:

    ```python
    HF = {
        ".embed.weight": "model.embed_tokens.weight",
        ".blocks.attn.q.weight": "model.layers.{i}.self_attn.q_proj.weight",
        # ... one entry per array leaf of the model
        ".norm.weight": "model.norm.weight",
        ".head.weight": "lm_head.weight",
    }
    like = eqx.filter_eval_shape(Mistral, config, key=jax.random.key(0))
    model = eqx_lean.load_tensors(
        "Mistral-7B-v0.1/", like, lambda path, _: HF[jax.tree_util.keystr(path)],
        dtype=jnp.bfloat16,
    )
    ```

    The load is strict by default: the checkpoint must hold no layer beyond those loaded (see
    `layers`) and no tensor that no leaf is named for, except the buffers `transformers`
    computes from the config (names ending in `.rotary_emb.inv_freq`). So a checkpoint that
    does not fit the model is an error that names what is extra, never a silent partial load.

    **Arguments:** as for [`eqx_lean.load_stacked`][]; `like` is the whole model, and `names`
    may mix templates with `{i}` and plain names. Paths given to `names`, `dtype` and `sharding`
    rules are the whole model's (such as `.blocks.mlp.weight`): a name map written for
    `load_stacked` needs its prefix (see
    [paths](../getting-started.md#paths-in-rules-and-name-functions)). `sharding` has its one
    meaning: for a leaf named with `{i}` it is one layer's sharding (the layer axis is
    replicated, unless `layer_axis` names mesh axes for it); for a plain leaf it is the whole
    tensor's. A rule `(path, leaf)` sees one layer's `ShapeDtypeStruct` for the first and the
    tensor's for the second. With `strict=False`, tensors that no
    leaf is named for are ignored, wherever they are (load a part of a checkpoint that way); the
    layer count is still checked.

    **Returns:**

    The model with the structure of `like`, its array leaves loaded.
    """
    return _load(
        path,
        like,
        names,
        dtype=dtype,
        sharding=sharding,
        mesh=mesh,
        layer_axis=layer_axis,
        layers=layers,
        strict=strict,
        quantize=quantize,
        file_backed=file_backed,
        fn="load_tensors",
    )


def load_stacked(
    path: str | os.PathLike | Sequence[str | os.PathLike] | Checkpoint,
    like: M,
    names: Any,
    *,
    dtype: DtypePolicy = None,
    sharding: ShardingPolicy = None,
    mesh: Mesh | None = None,
    layer_axis: LayerAxis = None,
    layers: int | range | None = None,
    strict: bool = True,
    quantize: QuantConfig | str | None = None,
    file_backed: bool = False,
) -> M:
    """Loads stacked layers from safetensors files that store one tensor per layer.

    Every stacked buffer is allocated once, in its target dtype and sharding (no random
    initialisation), then filled in place from read-only memory maps of the files (page cache,
    not a private copy), casting on the way: on CPU, each device's slice of each layer is copied
    with NumPy straight into the buffer's memory; elsewhere, by compiled writes that donate the
    buffers, each call a few rows of one layer of every leaf, at most 4 MiB in all, one program
    for all the leaves and every device. The process holds the loaded model plus a few MiB,
    whatever the size of its largest tensor: never a second copy of the stack, never a whole
    tensor on the side, never a float32 copy of a bfloat16 model.

    Every file header, tensor name, shape and dtype is checked before anything is allocated, so a
    bad checkpoint fails with a clear message and writes nothing. Pickle checkpoints (`.bin`,
    `.pt`) are refused: they can run code when loaded.

    A checkpoint that holds more layers than `like` is an error that names both counts (pass
    `layers` to load only some), and so is a per-layer tensor of a loaded layer that no leaf is
    named for (a tensor named like the templates, `model.layers.{i}.…`, that the model lacks;
    `strict=False` ignores those). Tensors outside the templates' pattern (an embedding, a head)
    are not this function's business.

    ```python
    like = eqx.filter_eval_shape(eqx_lean.build_stacked, make_block, keys, jnp.bfloat16)
    names = lambda path, _: "model.layers.{i}." + HF_BLOCK[jax.tree_util.keystr(path)]
    blocks = eqx_lean.load_stacked("Mistral-7B-v0.1/", like, names)
    ```

    **Arguments:**

    - `path`: a directory holding `model.safetensors.index.json` (as Hugging Face writes
        sharded checkpoints) or `*.safetensors` files, one safetensors file, a list of them, or
        an index file. The index may name only files in its own directory (plain file names;
        a file that is a symbolic link, as in the Hugging Face cache, is fine). Or a checkpoint
        already opened with [`eqx_lean.open_checkpoint`][] (to read its `config.json` with it).
        Every file is opened before any tensor is read, relative to one open descriptor of the
        directory, so a save replacing the checkpoint during the load gives exactly the old or
        exactly the new checkpoint, never a mix (see [`eqx_lean.open_checkpoint`][]).
    - `like`: the stacked model to load into; its array leaves may be `jax.ShapeDtypeStruct`s
        (for example from `eqx.filter_eval_shape(eqx_lean.build_stacked, ...)`) or arrays, of
        which only the shape and dtype are used (they are never modified). Non-array leaves and
        static fields are kept.
    - `names`: the tensor name of every array leaf, for one layer: a pytree of the structure of
        `like` (built with `eqx.tree_at`, say) whose leaves are templates such as
        `"model.layers.{i}.mlp.up_proj.weight"` or [`eqx_lean.TensorName`][]s (with a
        transpose), or a function `(path, leaf) -> name` given each leaf's key path relative to
        `like` (one layer's paths, such as `.mlp.weight`; see
        [paths](../getting-started.md#paths-in-rules-and-name-functions)) and the leaf as it is
        in `like`. Every name must contain `{i}`, the layer index. A leaf named `None` is not
        loaded: `like` must hold its array, which is returned as is.
    - `dtype`: the dtype to store each floating leaf in: `None` keeps the dtypes of `like`; a
        floating dtype casts every floating leaf; a rule chooses per leaf, as for
        [`eqx_lean.build_stacked`][] (resolved against `like`; a function is given one layer's
        `ShapeDtypeStruct`). Tensors are cast from whatever
        floating dtype the file has; integer and boolean tensors must match exactly.
    - `sharding`: how each leaf of one layer is sharded, exactly as for
        [`eqx_lean.build_stacked`][]: `None`, one `Sharding` or `PartitionSpec`, a pytree prefix
        of the layer, or a rule `(path, leaf) -> sharding` such as [`eqx_lean.fsdp`][]; the
        layer axis is replicated. (Before eqx_lean 0.2.0 it was the sharding of the whole
        stacked leaf: a spec with one more entry than a layer's leaf has dimensions is now an
        error that says so.) With `sharding=None`, shardings carried by the
        `ShapeDtypeStruct`s of `like` are used; they must replicate the layer axis. Each device
        reads and receives only its own slice of each layer.
    - `mesh`: the `jax.sharding.Mesh` that `PartitionSpec`s refer to (default: the mesh set
        by `jax.set_mesh`, if any). Shardings of `like` on an abstract mesh (as
        `eqx.filter_eval_shape` of a sharded build gives) are placed on it; without one, on
        `jax.make_mesh` of the same axis sizes and names over every device.
    - `layer_axis`: the mesh axis (or axes) to shard the layer axis itself over, for pipeline
        stages; `None` (the default) replicates it, as `fold` and `scan` expect.
    - `layers`: which checkpoint layers to load, one per layer of `like`: `None` (the default)
        loads them all, and the checkpoint must hold exactly as many layers as `like`; an int
        `N` loads the first `N` (`like` has `N` layers); a `range` loads those layers, in order
        (`layers=range(16, 32)` loads the second half of a 32-layer checkpoint into a 16-layer
        `like`). Tensors of the other layers are ignored.
    - `strict`: `True` (the default) makes a per-layer tensor of a loaded layer that no leaf is
        named for an error; `False` ignores it. Nothing else is accepted. Buffers that
        `transformers` computes from the config (names ending in `.rotary_emb.inv_freq`) are
        always ignored.
    - `quantize`: `None` (the default); or `"nf4"`, `"int8"` or an
        [`eqx_lean.quant.QuantConfig`][] to load the `eqx.nn.Linear`s its `target_modules`
        chooses (by their dotted paths in `like`; `"all-linear"`: every one not named
        `lm_head`) as [`eqx_lean.quant.QuantizedLinear`][]s, QLoRA's frozen base. Each chosen
        weight is named, checked and chosen (`layers`, `dtype`, `strict`) as any leaf, then
        quantised as it streams from the file, a few rows at a time, from its values in its
        `dtype`: the process never holds it at full precision. The result equals
        [`eqx_lean.quant.quantize_linears`][] of the model loaded without `quantize`. The
        weight must be stored `[out, in]` (no transpose). Its `sharding` is given for the
        weight itself, as without `quantize`: int8 codes take it, and NF4 codes (blocks of
        consecutive values of each row-major tensor) are split between rows over the mesh axes
        it names, each shard holding whole blocks and the scales of its blocks, or the load is
        refused naming the weight. A stack of quantised layers runs sharded under
        [`eqx_lean.fold`][], which gathers each layer.
    - `file_backed`: `False` (the default) copies every tensor into memory of its own. `True`,
        on CPU, makes each loaded leaf the file's own pages instead (a private copy-on-write
        memory map), as `transformers` maps a checkpoint: the load copies nothing, takes no
        anonymous memory, and pages are read from the page cache when first used. Each leaf
        must be stored as it is loaded: in its `dtype`, untransposed, on one CPU device, its
        data 64-byte aligned, and a stacked leaf's layers consecutive tensors of one file in
        layer order. Checkpoints that eqx_lean saves are so laid out, each stack in one file
        when it fits in `max_shard_bytes`; for any other leaf the load is refused, naming it
        and the reason. For a frozen base (LoRA, inference): such arrays must not be donated
        or updated in place. Nothing breaks if they are (the map is private, so the file never
        changes), but the pages written become anonymous memory, a copy after all. The file
        must not be truncated or rewritten in place while the arrays live (eqx_lean's own
        saves replace files, which leaves the mapped ones intact); reading a page of a
        truncated file kills the process with `SIGBUS`.

    **Returns:**

    The stacked model, with the structure of `like`.
    """
    return _load(
        path,
        like,
        names,
        dtype=dtype,
        sharding=sharding,
        mesh=mesh,
        layer_axis=layer_axis,
        layers=layers,
        strict=strict,
        quantize=quantize,
        file_backed=file_backed,
        fn="load_stacked",
    )
