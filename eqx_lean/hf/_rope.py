"""Rotary embeddings as HuggingFace configures them (`default` and `llama3` frequencies), their
application in HF's `rotate_half` layout, and the causal (sliding-window) attention mask.

Both config forms are read: transformers ≥ 5's `rope_parameters` dict (with `rope_theta` in it),
and transformers 4's top-level `rope_theta` beside an optional `rope_scaling` dict (whose kind
is `rope_type` or, in older files, `type`).
"""

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


_REFUSED = ("linear", "dynamic", "yarn", "longrope")


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
        if not self.factor > 0 or not self.original_max_position_embeddings > 0:
            raise ValueError(
                "llama3 rope `factor` and `original_max_position_embeddings` must be positive; "
                f"got {self.factor!r} and {self.original_max_position_embeddings!r}."
            )
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "llama3 rope `high_freq_factor` must exceed `low_freq_factor`; got "
                f"{self.high_freq_factor!r} and {self.low_freq_factor!r}."
            )


def read_rope(hf: dict[str, Any], default_theta: float) -> tuple[float, Llama3Rope | None]:
    """The rotary base and scaling of a HuggingFace config dictionary.

    **Arguments:**

    - `hf`: the `config.json` dictionary, in either form.
    - `default_theta`: the family's base when the file gives none.

    **Returns:**

    `(rope_theta, scaling)`, `scaling` being `None` for the default rotary embeddings.
    """
    rope = hf.get("rope_parameters")
    field = "rope_parameters"
    if rope is None:
        rope, field = hf.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(rope, dict):
        raise ValueError(f"`{field}` must be a JSON object or null; got {rope!r}.")
    theta = rope.get("rope_theta", hf.get("rope_theta", default_theta))
    if not isinstance(theta, int | float) or theta <= 0:
        raise ValueError(f"`rope_theta` must be a positive number; got {theta!r}.")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(
            "`partial_rotary_factor` must be 1 (rotary embeddings on the whole head); "
            f"got {partial!r}."
        )
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        refused = "is not implemented" if kind in _REFUSED else "is unknown"
        raise ValueError(
            f"`{field}` asks for rope_type {kind!r}, which {refused} here: only 'default' and "
            "'llama3' rotary embeddings are read (not 'linear', 'dynamic', 'yarn' or 'longrope')."
        )
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [name for name in names if name not in rope]
    if missing:
        raise ValueError(f"`{field}` of rope_type 'llama3' must give {missing}; it does not.")
    scaling = Llama3Rope(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )
    return float(theta), scaling


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
    x: Float[Array, "batch seq heads d"], cos: Float[Array, "seq d"], sin: Float[Array, "seq d"]
) -> Float[Array, "batch seq heads d"]:
    """Rotates `x` by the angles of `cos` and `sin` (from `rotary_cos_sin`)."""
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
