"""Conversion between the Equinox model and HuggingFace `transformers` checkpoints."""

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

import eqx_lean

from .. import _arguments as arguments
from .._io.names import stored_layer_count
from .._io.quantized import quant_config
from .._io.safetensors import INDEX_FILE, WEIGHTS_FILE
from ..quant._linear import QuantConfig
from ._config import DecoderConfig, config_from_file, parse_config_json
from ._families import DTYPE_NAMES, declared_layers, stated_dtype
from ._model import Decoder, DecoderBlock, RMSNorm, _linear_from_weight, _resolve_dtype, make_block
from ._quantized import load_quantized, refuse_bitsandbytes, refuse_prequantized
from ._tower import TowerNames, check_extras, is_multimodal, tower_prefix


_EMBED, _NORM, _HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def _layer_name(index: int | str, name: str) -> str:
    return f"model.layers.{index}.{name}"


def _named_leaves(like: Decoder, names: Any = None) -> list[tuple[str, Any]]:
    """Every array leaf of `like` with its HF name (a template with `{i}` for a block leaf),
    by `names` (`None`: `_hf_name`): JAX and NumPy arrays and abstract
    `jax.ShapeDtypeStruct`s alike."""
    names = _hf_name if names is None else names
    return [
        (names(path, leaf), leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(like)
        if isinstance(leaf, jax.ShapeDtypeStruct) or eqx.is_array(leaf)
    ]


def _hf_names(config: DecoderConfig) -> list[str]:
    return _tensor_names(abstract_model(config))


def _tensor_names(like: Decoder, name_of: Any = None) -> list[str]:
    """Every HF tensor name `like` has a leaf for, one per layer for a block leaf (by
    `name_of`, as for `_named_leaves`)."""
    names = []
    for template, _ in _named_leaves(like, name_of):
        if "{i}" in template:
            names.extend(template.format(i=i) for i in range(like.config.num_hidden_layers))
        else:
            names.append(template)
    return names


_Q, _KV = ("num_attention_heads", "head_dim"), ("num_key_value_heads", "head_dim")
# The config fields each dimension of a tensor is sized by, by the end of its HF name.
_DIM_FIELDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "embed_tokens.weight": (("vocab_size",), ("hidden_size",)),
    "lm_head.weight": (("vocab_size",), ("hidden_size",)),
    "norm.weight": (("hidden_size",),),
    "q_norm.weight": (("head_dim",),),
    "k_norm.weight": (("head_dim",),),
    "q_proj.weight": (_Q, ("hidden_size",)),
    "k_proj.weight": (_KV, ("hidden_size",)),
    "v_proj.weight": (_KV, ("hidden_size",)),
    "o_proj.weight": (("hidden_size",), _Q),
    "q_proj.bias": (_Q,),
    "k_proj.bias": (_KV,),
    "v_proj.bias": (_KV,),
    "o_proj.bias": (("hidden_size",),),
    "gate_proj.weight": (("intermediate_size",), ("hidden_size",)),
    "up_proj.weight": (("intermediate_size",), ("hidden_size",)),
    "down_proj.weight": (("hidden_size",), ("intermediate_size",)),
    "gate_proj.bias": (("intermediate_size",),),
    "up_proj.bias": (("intermediate_size",),),
    "down_proj.bias": (("hidden_size",),),
}


def _sized_by(
    name: str, expected: tuple[int, ...], held: tuple[int, ...], config: DecoderConfig
) -> str:
    """The config fields, with their values, that give tensor `name` a shape other than the
    one held: "`hidden_size`=16 gives", "`hidden_size`=16, `vocab_size`=8 give"."""
    end = ".".join(name.split(".")[-2:])
    dims = _DIM_FIELDS.get(end) or _DIM_FIELDS.get(
        "norm.weight" if end.endswith("norm.weight") else end
    )
    if dims is None or len(dims) != len(expected):
        return "sizes give"
    wrong = [i for i in range(len(expected)) if i >= len(held) or expected[i] != held[i]]
    fields = dict.fromkeys(field for i in wrong or range(len(expected)) for field in dims[i])
    values = {"head_dim": config.resolved_head_dim}
    shown = [f"`{f}`={values.get(f, getattr(config, f))}" for f in fields]
    return ", ".join(shown) + (" gives" if len(shown) == 1 else " give")


def _check_shape(
    name: str, held: tuple[int, ...], expected: tuple[int, ...], config: DecoderConfig
) -> None:
    if tuple(held) != tuple(expected):
        raise ValueError(
            f"tensor `{name}` must have shape {list(expected)}, which `config`'s "
            f"{_sized_by(name, expected, tuple(held), config)} it; `state_dict` holds "
            f"{list(held)}."
        )


def _assemble(
    get_tensor: Callable[[str], np.ndarray], config: DecoderConfig, dtype: Any
) -> Decoder:
    """Builds the model from HF tensors fetched one at a time by name.

    The stacked leaves are preallocated in `dtype` and filled one layer slice at a time with
    a donated in-place write, so at most one source tensor exists beside the model.
    """
    like = abstract_model(config, dtype)
    leaves = []
    for template, leaf in _named_leaves(like):
        if "{i}" not in template:
            leaves.append(jnp.asarray(get_tensor(template)).astype(leaf.dtype))
            continue
        buffer = jnp.zeros(leaf.shape, leaf.dtype)
        for i in range(config.num_hidden_layers):
            buffer = eqx_lean.write_layer(buffer, get_tensor(template.format(i=i)), i)
        leaves.append(buffer)
    treedef = jax.tree.structure(like)
    return jax.tree.unflatten(treedef, leaves)


_FAMILY_NAMES = {
    "mistral": "Mistral",
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3",
}


def _untied_error(where: str) -> ValueError:
    return ValueError(
        f"{where} ties the head to the embedding (tie_word_embeddings), but the checkpoint's "
        f"tensors {_HEAD!r} and {_EMBED!r} differ; a tied model has one matrix for both. Set "
        "`tie_word_embeddings` to false in config.json to load them as two."
    )


def from_hf_state_dict(
    state_dict: dict[str, np.ndarray], config: DecoderConfig, dtype: Any = None
) -> Decoder:
    """Builds the model from a HuggingFace state dict.

    **Arguments:**

    - `state_dict`: HF tensor names (`model.layers.{i}.self_attn.q_proj.weight`, ...) to arrays
        (numpy, or anything `np.asarray` accepts, such as `tensor.numpy()`).
    - `config`: the model shape.
    - `dtype`: the model's dtype; `None` means `config.dtype`.

    **Returns:**

    The [`Decoder`][] model. The layer count and every tensor's shape are checked against
    `config` before any buffer is allocated: a state dict with more layers than `config` is
    refused too (as [`load_hf`][] refuses such a checkpoint), and so is one of bitsandbytes'
    quantised tensors.
    """
    held, expected = stored_layer_count(state_dict, _LAYER_PREFIX), config.num_hidden_layers
    if held != expected:  # before any list of one name per layer is built
        extra = (
            f" Pass a config with {held} layers, or drop the layers from {expected} on to "
            "keep the first ones."
            if held > expected
            else ""
        )
        raise ValueError(
            f"`state_dict` must hold the {expected} layers `config.num_hidden_layers` gives; "
            f"it holds {held} ('{_LAYER_PREFIX}{{i}}.…' for i < {held}).{extra}"
        )
    names = _hf_names(config)
    dtypes = {name: str(getattr(value, "dtype", "")) for name, value in state_dict.items()}
    refuse_bitsandbytes(
        {name: dtype.removeprefix("torch.") for name, dtype in dtypes.items()},
        set(names),
        "`state_dict` holds",
        None,
    )
    missing = [name for name in names if name not in state_dict]
    if missing:
        raise KeyError(
            f"`state_dict` must hold every {_FAMILY_NAMES[config.model_type]} tensor of "
            f"`config`; missing {missing[:5]}."
        )
    if config.tie_word_embeddings and _HEAD in state_dict:
        if not np.array_equal(np.asarray(state_dict[_HEAD]), np.asarray(state_dict[_EMBED])):
            raise _untied_error("`config`")
    dtype = _resolve_dtype(config, dtype)
    # Every shape before the first buffer: a size wrong in `config` is refused, not allocated.
    for template, leaf in _named_leaves(abstract_model(config, dtype)):
        stacked = "{i}" in template
        shape = leaf.shape[1:] if stacked else leaf.shape
        for name in [template.format(i=i) for i in range(expected)] if stacked else [template]:
            _check_shape(name, tuple(np.shape(state_dict[name])), shape, config)
    return _assemble(lambda name: np.asarray(state_dict[name]), config, dtype)


def _hf_sources(model: Decoder) -> list[tuple[str, Array, int | None]]:
    """Every HF tensor of `model` as (name, array, layer index or None), in HF order.

    Layer tensors are referenced, not sliced, so that listing them copies nothing.
    """
    named = _named_leaves(model)
    sources: list[tuple[str, Array, int | None]] = []
    sources.extend((name, leaf, None) for name, leaf in named if name == _EMBED)
    for i in range(model.config.num_hidden_layers):
        sources.extend((name.format(i=i), leaf, i) for name, leaf in named if "{i}" in name)
    sources.extend(
        (name, leaf, None) for name, leaf in named if "{i}" not in name and name != _EMBED
    )
    return sources


def _host_copy(array: Array, index: int | None) -> np.ndarray:
    return np.asarray(array if index is None else array[index])


def to_hf_state_dict(model: Decoder) -> dict[str, np.ndarray]:
    """The HuggingFace state dict of `model`: HF tensor names to numpy arrays (copies)."""
    return {name: _host_copy(array, index) for name, array, index in _hf_sources(model)}


def _require_weights(path: str) -> None:
    """A clear message for a directory without HF weights, before anything is read."""
    if not any(os.path.exists(os.path.join(path, name)) for name in (INDEX_FILE, WEIGHTS_FILE)):
        raise FileNotFoundError(
            f"`path` must be a HF checkpoint directory holding `{WEIGHTS_FILE}` or `{INDEX_FILE}`; "
            f"found neither in {path!r}."
        )


def _hf_name(path: Any, leaf: Any) -> str:
    """The HF tensor name of a leaf of [`Decoder`][]: block leaves share HF's attribute names
    (biases included); a tied model has no `lm_head` leaf."""
    del leaf
    key = jax.tree_util.keystr(path)
    if key.startswith(".layers."):
        return _layer_name("{i}", key.removeprefix(".layers."))
    return {".embed_tokens.weight": _EMBED, ".norm.weight": _NORM, ".lm_head.weight": _HEAD}[key]


def abstract_model(config: DecoderConfig, dtype: Any = None) -> Decoder:
    """The model's structure with `jax.ShapeDtypeStruct` leaves: nothing is allocated.

    The same structure as `eqx.filter_eval_shape(init, config, ...)`, traced without
    `build_stacked`'s machinery (one block under `filter_vmap`), and without running anything.
    """
    dtype = _resolve_dtype(config, dtype)

    def cast(x: Any) -> Any:
        return x.astype(dtype) if eqx.is_inexact_array(x) else x

    def block(key: Any) -> DecoderBlock:
        return make_block(config, key=key)

    def build() -> Decoder:
        # Inside the trace: creating the key runs nothing.
        keys = jax.random.split(jax.random.key(0), config.num_hidden_layers)
        layers = eqx.filter_vmap(block)(keys)
        matrix = jnp.zeros((config.vocab_size, config.hidden_size), dtype)
        return Decoder(
            embed_tokens=eqx.nn.Embedding(weight=matrix),
            layers=jax.tree.map(cast, layers),
            norm=RMSNorm(
                jnp.ones((config.hidden_size,), dtype),
                config.rms_norm_eps,
                bool(config.norm_unit_offset),
            ),
            lm_head=None if config.tie_word_embeddings else _linear_from_weight(matrix),
            config=config,
        )

    return eqx.filter_eval_shape(build)


_LAYER_PREFIX = "model.layers."


def _check_layer_count(
    expected: int | None,
    stored: Mapping[str, Any],
    path: str,
    strict: bool,
    prefix: str = _LAYER_PREFIX,
) -> None:
    """`config.json` must give the layer count the weights hold (`None`: it gives none a
    config is built from, which building it reports), their names under `prefix`."""
    config_file = os.path.join(path, "config.json")
    held = stored_layer_count(stored, prefix)
    if expected is not None and (held < expected or (strict and held > expected)):
        hint = (
            f"Fix config.json, or pass `strict=False` to load its first {expected} layers."
            if held > expected
            else "Fix config.json."
        )
        raise ValueError(
            f"{config_file} says num_hidden_layers={expected}, but the weights in {path} hold "
            f"{held} layers ('{prefix}0.…' to '{prefix}{held - 1}.…'). {hint}"
        )


def _check_shapes(
    stored: Mapping[str, Any],
    path: str,
    config: DecoderConfig,
    like: Decoder,
    name_of: Any = _hf_name,
) -> None:
    """`config.json` must give every tensor the shape the weights hold (after the layer count
    is checked: this lists every layer's names)."""
    config_file = os.path.join(path, "config.json")
    expected = config.num_hidden_layers
    for leaf_path, leaf in jax.tree_util.tree_leaves_with_path(like):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            continue
        template = name_of(leaf_path, leaf)
        stacked = "{i}" in template
        shape = leaf.shape[1:] if stacked else leaf.shape
        for name in [template.format(i=i) for i in range(expected)] if stacked else [template]:
            if name in stored and stored[name].shape != shape:
                held = tuple(stored[name].shape)
                raise ValueError(
                    f"{config_file} does not match the weights in {path}: its "
                    f"{_sized_by(name, shape, held, config)} tensor {name!r} the shape "
                    f"{list(shape)}, but the weights hold {list(held)}."
                )


def load_hf(
    path: str | os.PathLike | eqx_lean.Checkpoint,
    *,
    dtype: Any = None,
    sharding: Any = None,
    strict: bool = True,
    quantize: Any = None,
    file_backed: bool = False,
) -> Decoder:
    """Loads a HuggingFace checkpoint of a family `eqx_lean.hf` reads (Mistral, Llama, Qwen2,
    Qwen3, Gemma 2, Gemma 3; a `Gemma3ForConditionalGeneration` as its text tower, its vision
    tower's tensors left unread) with
    [`eqx_lean.load_tensors`][].

    Every tensor is copied from a memory map of its file straight into buffers allocated once
    in `dtype`, so the process holds the model plus a few MiB.

    The load is strict: `config.json` must describe the weights (the same number of layers,
    every tensor's shape), and every tensor of the checkpoint must be loaded, except the buffers
    `transformers` computes from the config (`*.rotary_emb.inv_freq`). A mismatch is an error
    that names the file and what differs (the config field, the tensor and both shapes), found
    from the files' headers before anything is allocated; the layer count is checked before
    anything of one entry per layer is built, so a wrong size fails at once, however large.

    **Arguments:**

    - `path`: a directory with `config.json` and `model.safetensors` or a sharded
        `model.safetensors.index.json` (as written by `save_pretrained` or [`save_hf`][]); or
        such a directory already opened with `eqx_lean.open_checkpoint(path,
        files=["config.json", ...])`, to read other files of the same checkpoint with it.
        `config.json` and the weights are read from one checkpoint, opened whole: a save
        replacing the directory during the load gives the old or the new model, never the
        config of one with the weights of the other.
    - `dtype`: the model's dtype; `None` means the checkpoint's, as `transformers`'
        `from_pretrained` reads it: `config.json`'s `dtype` (or its older `torch_dtype`), else
        the dtype the weights are stored in (a `config.json` without either and weights
        stored in several dtypes is refused: pass `dtype`).
    - `sharding`: as for [`eqx_lean.load_tensors`][]: `None`, one `jax.sharding.Sharding` for
        every leaf, a pytree of shardings with the model's structure, or a rule such as
        [`eqx_lean.fsdp`][].
    - `strict`: `False` loads the layers `config.json` asks for even if the weights hold more,
        and ignores tensors the model has no leaf for. Shapes must match either way.
    - `quantize`: `None`; or `"nf4"`, `"int8"` or an [`eqx_lean.quant.QuantConfig`][] to
        load the decoder's linear layers as [`eqx_lean.quant.QuantizedLinear`][]s (QLoRA's
        base). Each weight is quantised as it streams from the file, a few rows at a time, from
        its values in `dtype`: the process holds the quantised model plus a few MiB, never a
        full-precision layer. The result equals quantising the model loaded without it
        ([`eqx_lean.quant.quantize_linears`][]). Embeddings, norms, biases and the head stay
        in `dtype`. With `sharding`, each quantised weight is placed as the sharding given
        for the weight places it, its NF4 codes split between rows (see
        [`eqx_lean.load_tensors`][]). A checkpoint saved quantised (a
        `quantization_config` in `config.json`, as `*-bnb-4bit` repositories) is refused,
        and so are bitsandbytes' tensors under a `config.json` that lost that field.
    - `file_backed`: `True`, on CPU, makes every weight the checkpoint file's own pages
        instead of a copy (see [`eqx_lean.load_tensors`][]): the load reads nothing until the
        weights are used and takes no anonymous memory, for a frozen base (inference, LoRA).
        The checkpoint must be one eqx_lean saved ([`save_hf`][], each stacked weight in one
        file), loaded in its stored dtype.

    **Returns:**

    The [`Decoder`][] model.
    """
    quant = quant_config(quantize)
    if isinstance(path, eqx_lean.Checkpoint):
        return _load_opened(path, path.source, dtype, sharding, strict, quant, file_backed)
    path = os.fspath(path)
    _require_weights(path)
    with eqx_lean.open_checkpoint(path, files=["config.json", _GENERATION]) as checkpoint:
        return _load_opened(checkpoint, path, dtype, sharding, strict, quant, file_backed)


def _load_opened(
    checkpoint: eqx_lean.Checkpoint,
    path: str,
    dtype: Any,
    sharding: Any,
    strict: bool,
    quant: QuantConfig | None = None,
    file_backed: bool = False,
) -> Decoder:
    config_file = os.path.join(path, "config.json")
    try:
        raw = checkpoint.file("config.json")
    except KeyError:
        raise ValueError(
            "`path` must be opened with its config: `eqx_lean.open_checkpoint(path, "
            "files=['config.json', ...])`."
        ) from None
    if raw is None:
        raise FileNotFoundError(
            f"`path` must be a HF checkpoint directory holding config.json; {config_file} does "
            "not exist."
        )
    refuse_prequantized(raw, config_file)
    hf = parse_config_json(raw, config_file)
    stored = eqx_lean.checkpoint_tensors(checkpoint)  # headers only
    # A Gemma3ForConditionalGeneration is read as its text tower, whose names are prefixed.
    names: Any = _hf_name
    prefix = _LAYER_PREFIX
    if is_multimodal(hf):
        names = TowerNames(tower_prefix(stored, config_file), _hf_name)
        prefix = names.prefix + "layers."
    # Before the config is built: it may list one entry per layer (Qwen2's `layer_types`).
    _check_layer_count(declared_layers(hf), stored, path, strict, prefix)
    config = config_from_file(hf, config_file)
    if stated_dtype(hf) is None:
        config = _with_stored_dtype(config, stored, path, dtype is not None, names)
    config = _with_generation_eos(checkpoint, path, config)
    dtype = _resolve_dtype(config, dtype)
    like = abstract_model(config, dtype)
    refuse_bitsandbytes(
        {name: jnp.dtype(struct.dtype).name for name, struct in stored.items()},
        set(_tensor_names(like, names)),
        f"the weights in {path} hold",
        config_file,
    )
    _check_shapes(stored, path, config, like, names)
    layers = None if strict else config.num_hidden_layers
    if names is not _hf_name:
        # The vision tower's tensors stay in the file: checked here, then loaded around.
        if strict:
            check_extras(stored, set(_tensor_names(like, names)) | {_HEAD}, config_file)
        strict, layers = False, config.num_hidden_layers
    stored_head = _HEAD in stored
    if quant is not None:
        if config.tie_word_embeddings and stored_head:
            raise ValueError(
                f"{config_file} ties the head to the embeddings but the checkpoint stores a "
                "head: load it without `quantize` (then `eqx_lean.quant.quantize_linears`)."
            )
        return load_quantized(checkpoint, like, names, quant, strict, layers, sharding, file_backed)
    if not (config.tie_word_embeddings and stored_head):
        return eqx_lean.load_tensors(
            checkpoint,
            like,
            names,
            sharding=sharding,
            layers=layers,
            strict=strict,
            file_backed=file_backed,
        )
    # A tied checkpoint that stores its head anyway (some writers do): load it beside the
    # embedding, check that they are one matrix, and keep the embedding alone.
    untied = dataclasses.replace(config, tie_word_embeddings=False)
    model = eqx_lean.load_tensors(
        checkpoint,
        abstract_model(untied, dtype),
        names,
        sharding=sharding,
        layers=layers,
        strict=strict,
        file_backed=file_backed,
    )
    assert model.lm_head is not None
    if not bool(jnp.array_equal(model.lm_head.weight, model.embed_tokens.weight)):
        raise _untied_error(config_file)
    return Decoder(model.embed_tokens, model.layers, model.norm, None, config)


def _with_stored_dtype(
    config: DecoderConfig, stored: Mapping[str, Any], path: str, given: bool, names: Any = None
) -> DecoderConfig:
    """`config` in the dtype its weights are stored in, for a `config.json` that states none:
    what `transformers`' `from_pretrained` loads (its `dtype="auto"`), never a narrower one.
    Weights stored in several dtypes are refused unless the load is `given` its own."""
    held = set(_tensor_names(abstract_model(config), names)) | {_HEAD}
    found: dict[str, str] = {}  # each floating dtype, with the first tensor stored in it
    for name, struct in stored.items():
        if name in held and jnp.issubdtype(struct.dtype, jnp.floating):
            found.setdefault(jnp.dtype(struct.dtype).name, name)
    if len(found) == 1 and next(iter(found)) in DTYPE_NAMES:
        return dataclasses.replace(config, dtype=next(iter(found)))
    if given or not found:
        return config
    config_file = os.path.join(path, "config.json")
    shown = ", ".join(f"{dtype} ({name!r})" for dtype, name in found.items())
    what = "in several dtypes" if len(found) > 1 else "in a dtype a model here is not built in"
    raise ValueError(
        f"{config_file} gives no `dtype` (nor `torch_dtype`), so the model would take the "
        f"weights' own, but the weights in {path} are stored {what}: {shown}. State the model's "
        f"dtype (one of {DTYPE_NAMES}) as `dtype` in config.json, or pass `dtype=` to load_hf."
    )


_GENERATION = "generation_config.json"


def _with_generation_eos(
    checkpoint: eqx_lean.Checkpoint, path: str, config: DecoderConfig
) -> DecoderConfig:
    """`config` with `generation_config.json`'s `eos_token_id`, if the checkpoint has that file
    (as `transformers`, whose `generate` reads the generation config, not `config.json`), each
    id checked to be a token of the vocabulary, and the file's text (which `save_hf` keeps)."""
    try:
        raw = checkpoint.file(_GENERATION)
    except KeyError:  # opened by the caller without it
        return config
    if raw is None:
        return config
    where = os.path.join(path, _GENERATION)
    try:
        generation = json.loads(raw.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{where} must hold a JSON object, but it is not valid JSON: {e}"
        ) from None
    if not isinstance(generation, dict):
        raise ValueError(f"{where} must hold a JSON object; got a {type(generation).__name__}.")
    eos = generation.get("eos_token_id")
    if eos is None:
        eos = []  # no end ids: transformers' `generate` then never stops
    ids = eos if isinstance(eos, list) else [eos]
    what = f"`eos_token_id` in {where} (a token of the {config.vocab_size}-token vocabulary)"
    if len(ids) > 1 or isinstance(eos, list):
        what = f"each id of {what}"
    checked = tuple(
        arguments.integer(i, what, minimum=0, maximum=config.vocab_size - 1) for i in ids
    )
    return dataclasses.replace(
        config,
        generation_eos_token_id=checked,
        generation_config_text=raw.decode("utf-8", errors="surrogateescape"),
    )


def _generation_file(config: DecoderConfig, path: str | os.PathLike) -> bytes:
    """`generation_config.json` for a model of `config` saved to `path`: the file the model's
    checkpoint had (else the one `path` holds), byte for byte, while the model's stop ids are
    the ones it gives; else that file with the model's stop ids in `eos_token_id`, its other
    fields kept; else a new one with `config.json`'s `bos_token_id` and the model's stop
    ids."""
    stop = list(config.stop_token_ids)
    eos: Any = stop[0] if len(stop) == 1 else (stop or None)
    text = config.generation_config_text
    if text is None:
        text = _existing_generation_text(path)
    if text is not None:
        generation = json.loads(text)
        held = generation.get("eos_token_id")
        held = [] if held is None else held if isinstance(held, list) else [held]
        if held == stop:
            return text.encode("utf-8", errors="surrogateescape")
        generation["eos_token_id"] = eos
    else:
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos}
    # transformers' own layout (`GenerationConfig.to_json_string`).
    return (json.dumps(generation, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _existing_generation_text(path: str | os.PathLike) -> str | None:
    """The text of `path`'s own `generation_config.json` when it holds a JSON object (a save
    over a checkpoint keeps its sampling fields), else None (no file, or one `transformers`
    could not read either: the save then writes a new one)."""
    try:
        raw = (Path(path) / _GENERATION).read_bytes()
    except OSError:  # no such file, a directory, unreadable: nothing to keep
        return None
    text = raw.decode("utf-8", errors="surrogateescape")
    try:
        generation = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return text if isinstance(generation, dict) else None


def save_hf(
    model: Decoder,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int = 2 * 2**30,
    other_weights: Literal["refuse", "keep", "drop"] = "refuse",
    files: Mapping[str, bytes | os.PathLike] | None = None,
    merge_adapters: bool = False,
) -> None:
    """Writes `model` as a HuggingFace checkpoint that `transformers` loads.

    Writes `config.json` and, with [`eqx_lean.save_tensors`][], `model.safetensors` or, when
    the model exceeds `max_shard_bytes`, numbered shards and `model.safetensors.index.json`.
    One tensor (one layer's slice of a stacked leaf) is copied to host memory at a time.

    It also writes `generation_config.json`, so that the stop ids the model holds
    (`model.config.stop_token_ids`, such as Llama-3-Instruct's `<|eot_id|>` beside
    `<|end_of_text|>`) survive the save for `transformers` and [`load_hf`][]. For a model
    loaded from a checkpoint with that file (else, saved over a directory that has one), the
    file is written back byte for byte while the model's stop ids are the ones it gives; if
    they differ, the same file with the model's ids as `eos_token_id` and its other fields
    kept (transformers' JSON layout); where there is no such file, a new one with
    `config.json`'s `bos_token_id` and the model's stop ids. A `generation_config.json` in
    `files` is written as given instead.

    The weights, `config.json` and `generation_config.json` are one unit: they are written
    into a new directory beside `path` that replaces `path` in one atomic step, so after a
    crash at any point `path` holds exactly the old checkpoint or exactly the new one, config
    included. Other files in `path` (tokenizer) are copied into the new directory; see
    [`eqx_lean.save_stacked`][] for what a save owns, carries over and refuses.

    A model with LoRA adapters is refused unless `merge_adapters` is set: merge them first
    ([`merge_lora`][]), save the adapters alone ([`save_adapters`][]), or let the save merge
    them. Quantised layers ([`eqx_lean.quant.QuantizedLinear`][]) are written dequantised, in
    the dtype they were quantised from, one layer at a time: the checkpoint holds the weights
    the model computes with, and the save never holds a dequantised stack.

    **Arguments:**

    - `model`: the [`Decoder`][] model.
    - `path`: the directory to write (created if needed).
    - `max_shard_bytes`: the largest shard size (a single larger tensor gets its own shard).
    - `other_weights`: what to do with weight files in `path` that this save does not write
        (such as a `consolidated.safetensors` or a `pytorch_model.bin`): `"refuse"` raises an
        error naming them, `"keep"` copies them, `"drop"` leaves them out.
    - `files`: more files for the same atomic directory, by name: their bytes, or a path to
        copy (such as the base checkpoint's tokenizer files). Not `config.json`, which this
        writes; a `generation_config.json` given here replaces the one written from the model.
    - `merge_adapters`: write each LoRA adapter folded into its base weight, `W + scale * B A`
        in float32 rounded once to the weight's dtype (as [`merge_lora`][] computes it), as
        each layer is written. `model` is not changed. This is how adapters trained on a
        quantised base are merged: into its dequantised weights, which are what they were
        trained against, written in the dtype the base was quantised from.
    """
    # Here: `eqx_lean.lora` imports `eqx_lean.hf` modules.
    from ..lora import lora_paths
    from ..lora._merge import merged_on_write

    model = merged_on_write(model, merge_adapters=merge_adapters)
    adapted = list(lora_paths(model))
    if adapted:
        raise ValueError(
            f"`model` must have plain projections to be saved as a HF checkpoint; its {adapted} "
            "hold unmerged LoRA adapters, which `transformers` would not load (it would draw "
            "fresh projections in their place). Merge them as the save writes them with "
            "`merge_adapters=True`, or into the base weights first with `merge_lora(model)`, or "
            "save the adapters alone with `save_adapters(model, path)`."
        )
    if files is not None and "config.json" in files:
        raise ValueError("`files` must not hold 'config.json': save_hf writes it from the model.")
    config = model.config.to_hf()
    config["dtype"] = jnp.dtype(model.dtype).name
    eqx_lean.save_tensors(
        path,
        model,
        _hf_name,
        max_shard_bytes=max_shard_bytes,
        files={
            _GENERATION: _generation_file(model.config, path),
            **(files or {}),
            "config.json": (json.dumps(config, indent=2) + "\n").encode(),
        },
        other_weights=other_weights,
    )
