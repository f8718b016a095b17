"""Rotary embeddings as HuggingFace configures them (`default`, `llama3`, `linear` and `yarn`
frequencies), their application in HF's `rotate_half` layout, and the causal (sliding-window)
attention mask.

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


_REFUSED = ("dynamic", "longrope", "proportional")
_COMPUTED = ("default", "llama3", "linear", "yarn")


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


@dataclasses.dataclass(frozen=True)
class LinearRope:
    """Linear rotary scaling (`rope_type: "linear"`, position interpolation): every inverse
    frequency divided by `factor`, as `transformers` computes it (Gemma 3's global layers)."""

    factor: float

    def __post_init__(self):
        object.__setattr__(
            self, "factor", arguments.number(self.factor, "linear rope `factor`", above=0)
        )


@dataclasses.dataclass(frozen=True)
class YarnRope:
    """YaRN rotary scaling (`rope_type: "yarn"`), HuggingFace's field names and defaults.

    The inverse frequencies blend interpolated (`/ factor`) and original ones along a ramp
    between the dimensions that rotate `beta_fast` and `beta_slow` times over
    `original_max_position_embeddings` (rounded outwards with `truncate`), and the rotary
    tables are multiplied by `attention_factor` (`None`: `0.1 ln(factor) + 1`, or the ratio of
    that formula at `mscale` and `mscale_all_dim` when both are given), as `transformers` does.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        object.__setattr__(
            self, "factor", arguments.number(self.factor, "yarn rope `factor`", above=0)
        )
        context = arguments.integer(
            self.original_max_position_embeddings,
            "yarn rope `original_max_position_embeddings`",
            minimum=1,
        )
        object.__setattr__(self, "original_max_position_embeddings", context)
        for name in ("beta_fast", "beta_slow"):
            value = arguments.number(getattr(self, name), f"yarn rope `{name}`", above=0)
            object.__setattr__(self, name, value)
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                value = arguments.number(getattr(self, name), f"yarn rope `{name}`", above=0)
                object.__setattr__(self, name, value)
        object.__setattr__(
            self, "truncate", arguments.boolean(self.truncate, "yarn rope `truncate`")
        )

    @property
    def scale(self) -> float:
        """The factor of the rotary tables (`transformers`' `attention_factor`)."""
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(
                mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
            )
        return mscale(self.factor)


RopeScaling = Llama3Rope | LinearRope | YarnRope
"""A rotary scaling this module computes (`None` is the default rotary embedding)."""


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
                f"`{field}.{key}` must name the rotary kind (one of {list(_COMPUTED)}); got "
                f"{value!r}."
            )
    if len(set(named.values())) > 1:
        raise ValueError(
            f"`{field}` must name one rotary kind; its `rope_type` is {named['rope_type']!r} "
            f"and its `type` {named['type']!r} (transformers reads `rope_type` alone)."
        )
    return next(iter(named.values()), "default")


def _read_one(
    rope: dict[str, Any], field: str, hf: dict[str, Any], default_theta: float
) -> tuple[float, RopeScaling | None]:
    """The rotary embedding one flat dict (`rope_parameters` or `rope_scaling`) describes."""
    kind = _kind(rope, field)
    if kind not in _COMPUTED:
        refused = "is not implemented" if kind in _REFUSED else "is unknown"
        raise ValueError(
            f"`{field}` asks for rope_type {kind!r}, which {refused} here: only 'default', "
            "'llama3', 'linear' and 'yarn' rotary embeddings are computed (not 'dynamic', "
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
    if kind == "linear":
        return float(theta), LinearRope(factor=_scaling_number(rope, field, "factor"))
    if kind == "yarn":
        return float(theta), _read_yarn(rope, field, hf)
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


def _scaling_number(rope: dict[str, Any], field: str, name: str) -> float:
    value: Any = rope.get(name)
    if not _number(value) or value <= 0:
        raise ValueError(f"`{field}.{name}` must be a number above 0; got {value!r}.")
    return float(value)


def _read_yarn(rope: dict[str, Any], field: str, hf: dict[str, Any]) -> YarnRope:
    """YaRN's parameters as `transformers` reads them: `original_max_position_embeddings`
    from the dict, else the config's `max_position_embeddings` (its standardisation copies it
    there); `beta_*` of 0 or null mean their defaults; `truncate` from the dict."""
    context = rope.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(
            f"`{field}.original_max_position_embeddings` must be a positive integer; got "
            f"{context!r}."
        )
    optional = {}
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
        if rope.get(name) is not None:
            optional[name] = _scaling_number(rope, field, name)
    return YarnRope(
        factor=_scaling_number(rope, field, "factor"),
        original_max_position_embeddings=context,
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        truncate=arguments.boolean(rope.get("truncate", True), f"`{field}.truncate`"),
        **optional,
    )


def read_rope(hf: dict[str, Any], default_theta: float) -> tuple[float, RopeScaling | None]:
    """The rotary base and scaling of a HuggingFace config dictionary, from every place a
    `config.json` can name them; anything not computed here, or contradictory, is refused.

    The places, as transformers 5 reads them: the `rope_parameters` dict (transformers 5) and
    the legacy `rope_scaling` dict (transformers 4; transformers 5 reads it *instead of*
    `rope_parameters` when both are given), each naming its kind by `rope_type` or the older
    `type`; the top-level `rope_theta` and `partial_rotary_factor` (used where the dict gives
    none). Refused: a kind other than `default`, `llama3`, `linear` and `yarn`; a null or
    empty kind; a dict whose
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
                f"layer type ({per_layer}), as Gemma 3 does, but this family rotates every "
                "layer alike (and transformers does not read this form for it)."
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
    if top is not None and top != _kind_of(scaling):
        raise ValueError(
            f"`rope_type` at the top level of the config ({top!r}) must agree with the rotary "
            f"embedding its rope dicts describe ({_describe(theta, scaling)}); transformers "
            "reads the kind from `rope_parameters` or `rope_scaling` only."
        )
    return theta, scaling


def read_layer_ropes(
    hf: dict[str, Any], global_theta: float, local_theta: float
) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3's two rotary embeddings: the global (`full_attention`) layers' base and scaling,
    and the local (`sliding_attention`) layers' base, whose rope is the default one.

    Read from either form: transformers 5's `rope_parameters` keyed by layer type, or the
    hub's `rope_theta` and `rope_scaling` (the global layers') beside `rope_local_base_freq`
    (the local layers'). A scaled local rope, or both forms at once, is refused.

    **Arguments:**

    - `hf`: the `config.json` dictionary.
    - `global_theta`, `local_theta`: the family's bases when the file gives none.

    **Returns:**

    `(rope_theta, rope_scaling, rope_local_base_freq)`.
    """
    rope = hf.get("rope_parameters")
    layered = isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values())
    if not layered:
        flat = {key: value for key, value in hf.items() if key != "rope_local_base_freq"}
        theta, scaling = read_rope(flat, global_theta)
        local = hf.get("rope_local_base_freq", local_theta)
        if not _number(local) or local <= 0:
            raise ValueError(f"`rope_local_base_freq` must be a positive number; got {local!r}.")
        return theta, scaling, float(local)
    assert isinstance(rope, dict)
    unknown = sorted(set(rope) - {"full_attention", "sliding_attention"})
    if unknown or not all(isinstance(v, dict) for v in rope.values()):
        raise ValueError(
            "`rope_parameters` given per layer type must map 'full_attention' and "
            f"'sliding_attention' to dicts; got {rope!r}."
        )
    for old in ("rope_scaling", "rope_local_base_freq"):
        if hf.get(old) is not None:
            raise ValueError(
                f"`{old}` must not be given beside `rope_parameters` per layer type: give the "
                "rotary embeddings in one form."
            )
    full = rope.get("full_attention", {})
    # A top-level `rope_theta` is the global layers' (as transformers' conversion reads it).
    theta, scaling = _read_one(full, "rope_parameters.full_attention", hf, global_theta)
    sliding = rope.get("sliding_attention", {})
    local, local_scaling = _read_one(sliding, "rope_parameters.sliding_attention", {}, local_theta)
    if local_scaling is not None:
        raise ValueError(
            "`rope_parameters.sliding_attention` must be the default rotary embedding (Gemma 3's "
            f"local layers); got rope_type {_kind_of(local_scaling)!r}."
        )
    return theta, scaling, local


def _kind_of(scaling: RopeScaling | None) -> str:
    """The `rope_type` of a scaling (`None`: 'default')."""
    kinds = {Llama3Rope: "llama3", LinearRope: "linear", YarnRope: "yarn"}
    return "default" if scaling is None else kinds[type(scaling)]


def _describe(theta: float, scaling: RopeScaling | None) -> str:
    kind = (
        "'default'" if scaling is None else f"'{_kind_of(scaling)}' {dataclasses.asdict(scaling)}"
    )
    return f"rope_type {kind} with rope_theta {theta!r}"


def rope_parameters(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """transformers-5's `rope_parameters` dictionary for `theta` and `scaling`."""
    fields = {} if scaling is None else dataclasses.asdict(scaling)
    # YaRN's optional fields are left out when unset, as transformers' own dicts do.
    fields = {name: value for name, value in fields.items() if value is not None}
    return {"rope_theta": theta, "rope_type": _kind_of(scaling), **fields}


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> Float[np.ndarray, " half"]:
    """The rotary inverse frequencies (float32), computed in float32 as `transformers` does.

    **Arguments:**

    - `head_dim`: the rotated dimension (even).
    - `theta`: the rotary base.
    - `scaling`: `None`, or a `Llama3Rope`, `LinearRope` or `YarnRope` scaling.

    **Returns:**

    `head_dim // 2` inverse frequencies.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(theta) ** exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRope):
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if isinstance(scaling, YarnRope):
        return _yarn_frequencies(head_dim, theta, scaling)
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


def _yarn_frequencies(head_dim: int, theta: float, scaling: YarnRope) -> Float[np.ndarray, " half"]:
    """YaRN's inverse frequencies, in float32 where `transformers` computes in float32."""

    def correction_dim(rotations: float) -> float:
        context = scaling.original_max_position_embeddings
        return (head_dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    positions = np.float32(theta) ** (
        np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    )
    extrapolation = np.float32(1.0) / positions
    interpolation = np.float32(1.0) / (np.float32(scaling.factor) * positions)
    ramp = (np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    keep = np.float32(1) - np.clip(ramp, 0, 1).astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def rotary_cos_sin(
    positions: Int[Array, " seq"],
    head_dim: int,
    theta: float,
    dtype: Any,
    scaling: RopeScaling | None = None,
) -> tuple[Float[Array, "seq head_dim"], Float[Array, "seq head_dim"]]:
    """The rotary tables for `positions`, in HF's layout: both halves carry the same angles.

    `scaling` is `None` (default frequencies), a `Llama3Rope`, a `LinearRope` or a `YarnRope`
    (whose tables are multiplied by its attention factor in float32, as `transformers`').
    """
    inv_freq = jnp.asarray(inverse_frequencies(head_dim, theta, scaling))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if isinstance(scaling, YarnRope):
        cos, sin = cos * scaling.scale, sin * scaling.scale
    return cos.astype(dtype), sin.astype(dtype)


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
