"""Rotary embeddings as HuggingFace configures them (`default` and `llama3` frequencies), their
application in HF's `rotate_half` layout, and the causal (sliding-window) attention mask.

Both config forms are read: transformers ≥ 5's `rope_parameters` dict (with `rope_theta` in it),
and transformers 4's top-level `rope_theta` beside an optional `rope_scaling` dict (whose kind
is `rope_type` or, in older files, `type`). Every place a file can name a rotary kind is read,
and a kind not computed here, or two places that disagree, is refused (see `read_rope`): a
scaled rope is never computed as the default one.
"""

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .. import _arguments as arguments


_REFUSED = ("linear", "dynamic", "yarn", "longrope", "proportional")


@dataclasses.dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's rotary frequency scaling (`rope_type: "llama3"`), HuggingFace's field names.

    Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are stretched
    by `factor`, those shorter than `original_max_position_embeddings / high_freq_factor` kept,
    and those between interpolated smoothly, exactly as `transformers` computes them.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        # Each wavelength bound divides by a factor: a factor of 0 or below, or a context that
        # is not a positive integer, computes frequencies transformers would not.
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = arguments.number(getattr(self, name), f"llama3 rope `{name}`", above=0)
            object.__setattr__(self, name, value)
        context = arguments.integer(
            self.original_max_position_embeddings,
            "llama3 rope `original_max_position_embeddings`",
            minimum=1,
        )
        object.__setattr__(self, "original_max_position_embeddings", context)
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "llama3 rope `high_freq_factor` must exceed `low_freq_factor`; got "
                f"{self.high_freq_factor!r} and {self.low_freq_factor!r}."
            )


# Every key a rotary scaling of `transformers` reads (`modeling_rope_utils.py`): a `default`
# rope that carries one was meant as a scaling that lost its name.
_SCALING_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "short_factor",
    "long_factor",
)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _number(value: Any) -> bool:
    """A finite number, not a bool (nor an integer beyond every float, which JSON can hold)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _kind(rope: dict[str, Any], field: str) -> str:
    """The rotary kind a dict names: `rope_type`, else the older `type`, else `default`."""
    named = {key: rope[key] for key in ("rope_type", "type") if key in rope}
    for key, value in named.items():
        # transformers keys its rotary functions by this string: null or "" fails there.
        if not isinstance(value, str) or not value:
            raise ValueError(
                f"`{field}.{key}` must name the rotary kind ('default' or 'llama3'); got {value!r}."
            )
    if len(set(named.values())) > 1:
        raise ValueError(
            f"`{field}` must name one rotary kind; its `rope_type` is {named['rope_type']!r} "
            f"and its `type` {named['type']!r} (transformers reads `rope_type` alone)."
        )
    return next(iter(named.values()), "default")


def _read_one(
    rope: dict[str, Any], field: str, hf: dict[str, Any], default_theta: float
) -> tuple[float, Llama3Rope | None]:
    """The rotary embedding one flat dict (`rope_parameters` or `rope_scaling`) describes."""
    kind = _kind(rope, field)
    if kind not in ("default", "llama3"):
        refused = "is not implemented" if kind in _REFUSED else "is unknown"
        raise ValueError(
            f"`{field}` asks for rope_type {kind!r}, which {refused} here: only 'default' and "
            "'llama3' rotary embeddings are computed (not 'linear', 'dynamic', 'yarn', "
            "'longrope' or 'proportional')."
        )
    top_theta = hf.get("rope_theta")
    theta = rope["rope_theta"] if "rope_theta" in rope else hf.get("rope_theta", default_theta)
    if "rope_theta" in rope and top_theta is not None and top_theta != theta:
        raise ValueError(
            f"`rope_theta` must be given once or agree: the top level says {top_theta!r}, "
            f"`{field}.rope_theta` {theta!r}."
        )
    if not _number(theta) or theta <= 0:
        raise ValueError(f"`rope_theta` must be a positive number; got {theta!r}.")
    for where, values in (("", hf), (f"{field}.", rope)):
        partial = values.get("partial_rotary_factor")
        if partial is not None and (partial != 1.0 or isinstance(partial, bool)):
            raise ValueError(
                f"`{where}partial_rotary_factor` must be 1 (rotary embeddings on the whole "
                f"head); got {partial!r}."
            )
    if kind == "default":
        # A factor of 1 scales nothing in any kind; any other scaling value was meant for a
        # scaled rope whose name was lost, which transformers would silently compute as default.
        meant = {
            key: rope[key]
            for key in _SCALING_KEYS
            if rope.get(key) is not None and not (key == "factor" and rope[key] == 1)
        }
        if meant:
            raise ValueError(
                f"`{field}` names rope_type 'default' but gives scaling parameters {meant}, "
                "which the default rotary embedding does not use: name the scaling its "
                "`rope_type`, or remove them."
            )
        return float(theta), None
    missing = [name for name in _LLAMA3_KEYS if rope.get(name) is None]
    if missing:
        raise ValueError(f"`{field}` of rope_type 'llama3' must give {missing}; it does not.")
    for name in _LLAMA3_KEYS:
        wanted = int if name == "original_max_position_embeddings" else float
        value = rope[name]
        if not _number(value) or (wanted is int and not isinstance(value, int)):
            raise ValueError(
                f"`{field}.{name}` must be a{'n integer' if wanted is int else ' number'}; "
                f"got {value!r}."
            )
        if value <= 0:  # a wavelength bound divides by it
            raise ValueError(f"`{field}.{name}` must be above 0; got {value!r}.")
    scaling = Llama3Rope(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )
    return float(theta), scaling


def read_rope(hf: dict[str, Any], default_theta: float) -> tuple[float, Llama3Rope | None]:
    """The rotary base and scaling of a HuggingFace config dictionary, from every place a
    `config.json` can name them; anything not computed here, or contradictory, is refused.

    The places, as transformers 5 reads them: the `rope_parameters` dict (transformers 5) and
    the legacy `rope_scaling` dict (transformers 4; transformers 5 reads it *instead of*
    `rope_parameters` when both are given), each naming its kind by `rope_type` or the older
    `type`; the top-level `rope_theta` and `partial_rotary_factor` (used where the dict gives
    none). Refused: a kind other than `default` and `llama3`; a null or empty kind; a dict whose
    `rope_type` and `type` differ; `rope_parameters` and `rope_scaling` that describe different
    embeddings; a `rope_theta` given twice with two values; a `default` rope with scaling
    parameters (a `factor` other than 1, ...); per-layer-type dicts (Gemma 3's
    `{"full_attention": {...}, "sliding_attention": {...}}`: these families rotate every layer
    alike); a top-level `rope_type` that disagrees.

    **Arguments:**

    - `hf`: the `config.json` dictionary, in either form.
    - `default_theta`: the family's base when the file gives none.

    **Returns:**

    `(rope_theta, scaling)`, `scaling` being `None` for the default rotary embeddings.
    """
    readings = []
    for field in ("rope_parameters", "rope_scaling"):
        rope = hf.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ValueError(f"`{field}` must be a JSON object or null; got {rope!r}.")
        per_layer = [key for key, value in rope.items() if isinstance(value, dict)]
        if per_layer:
            raise ValueError(
                f"`{field}` must be one flat dict of rotary parameters; it gives them per "
                f"layer type ({per_layer}), as Gemma 3 does, but the Mistral, Llama and Qwen2 "
                "families rotate every layer alike (and transformers does not read this form "
                "for them)."
            )
        if rope:  # an empty dict names nothing: transformers reads the other one, or defaults
            readings.append((field, _read_one(rope, field, hf, default_theta)))
    if not readings:
        readings.append(("rope_theta", _read_one({}, "rope_parameters", hf, default_theta)))
    if len(readings) == 2 and readings[0][1] != readings[1][1]:
        described = [
            f"`{field}` {_describe(theta, scaling)}" for field, (theta, scaling) in readings
        ]
        raise ValueError(
            "`rope_parameters` and `rope_scaling` must describe the same rotary embedding "
            "(transformers 5 reads `rope_scaling` when both are given, ignoring the other); "
            f"they differ: {described[0]}, {described[1]}."
        )
    theta, scaling = readings[-1][1]
    top = hf.get("rope_type")
    if top is not None and top != ("default" if scaling is None else "llama3"):
        raise ValueError(
            f"`rope_type` at the top level of the config ({top!r}) must agree with the rotary "
            f"embedding its rope dicts describe ({_describe(theta, scaling)}); transformers "
            "reads the kind from `rope_parameters` or `rope_scaling` only."
        )
    return theta, scaling


def _describe(theta: float, scaling: Llama3Rope | None) -> str:
    kind = "'default'" if scaling is None else f"'llama3' {dataclasses.asdict(scaling)}"
    return f"rope_type {kind} with rope_theta {theta!r}"


def rope_parameters(theta: float, scaling: Llama3Rope | None) -> dict[str, Any]:
    """transformers-5's `rope_parameters` dictionary for `theta` and `scaling`."""
    if scaling is None:
        return {"rope_theta": theta, "rope_type": "default"}
    return {"rope_theta": theta, "rope_type": "llama3", **dataclasses.asdict(scaling)}


def inverse_frequencies(
    head_dim: int, theta: float, scaling: Llama3Rope | None
) -> Float[np.ndarray, " half"]:
    """The rotary inverse frequencies (float32), computed in float32 as `transformers` does.

    **Arguments:**

    - `head_dim`: the rotated dimension (even).
    - `theta`: the rotary base.
    - `scaling`: `None`, or the `Llama3Rope` scaling.

    **Returns:**

    `head_dim // 2` inverse frequencies.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(theta) ** exponents)
    if scaling is None:
        return inv_freq
    factor = np.float32(scaling.factor)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (np.float32(old_context) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotary_cos_sin(
    positions: Int[Array, " seq"],
    head_dim: int,
    theta: float,
    dtype: Any,
    scaling: Llama3Rope | None = None,
) -> tuple[Float[Array, "seq head_dim"], Float[Array, "seq head_dim"]]:
    """The rotary tables for `positions`, in HF's layout: both halves carry the same angles.

    `scaling` is `None` (default frequencies) or Llama 3.1's `Llama3Rope`.
    """
    inv_freq = jnp.asarray(inverse_frequencies(head_dim, theta, scaling))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _rotate_half(x: Float[Array, "... d"]) -> Float[Array, "... d"]:
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-second, first], axis=-1)


def apply_rotary(
    x: Float[Array, "batch seq heads d"],
    cos: Float[Array, "*rows seq d"],
    sin: Float[Array, "*rows seq d"],
) -> Float[Array, "batch seq heads d"]:
    """Rotates `x` by the angles of `cos` and `sin` (from `rotary_cos_sin`): `[seq, d]` tables
    shared by every row, or `[batch, seq, d]`, one per row (packed rows' positions)."""
    if cos.ndim == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return x * cos + _rotate_half(x) * sin


def attention_mask(
    query_positions: Int[Array, " q"],
    key_positions: Int[Array, " k"],
    sliding_window: int | Int[Array, ""] | None,
) -> Bool[Array, "q k"]:
    """Which keys each query sees: causal, within the window, and never an empty slot (< 0).

    `sliding_window` may be traced (one layer's entry of a per-layer window array).
    """
    q, k = query_positions[:, None], key_positions[None, :]
    visible = (k >= 0) & (k <= q)
    if sliding_window is not None:
        visible = visible & (q - k < sliding_window)
    return visible
