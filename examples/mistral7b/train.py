"""Next-token training of a small Mistral on a bundled public-domain text, with optax AdamW.

The text is the US Declaration of Independence (1776, public domain), read as bytes: the
vocabulary is the 256 byte values, so no tokenizer is needed. The last tenth is held out.
"""

import dataclasses
import os
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PRNGKeyArray

from eqx_lean.hf import Decoder, DecoderConfig, adamw, init, make_train_step, next_token_loss


TEXT_PATH = os.path.join(os.path.dirname(__file__), "data", "declaration_of_independence.txt")


def load_text(path: str = TEXT_PATH) -> np.ndarray:
    """The bundled text as a uint8 array of byte values (token ids in [0, 256))."""
    with open(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8)


def split_text(data: np.ndarray, held_out: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Training and held-out parts: the last `held_out` fraction is held out."""
    cut = int(len(data) * (1 - held_out))
    return data[:cut], data[cut:]


def unigram_entropy(data: np.ndarray) -> float:
    """The entropy (nats per byte) of the byte frequencies of `data`: the loss to beat."""
    counts = np.bincount(data, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def batches(data: np.ndarray, batch_size: int, seq_len: int, *, seed: int) -> Iterator[np.ndarray]:
    """Endless random windows of `seq_len` tokens from `data`, shape `[batch_size, seq_len]`."""
    if len(data) <= seq_len:
        raise ValueError(f"`data` must be longer than `seq_len`={seq_len}; got {len(data)}.")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len, batch_size)
        yield np.stack([data[s : s + seq_len] for s in starts]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """A small run that fits this machine: a few hundred steps of a 2-layer byte model."""

    steps: int = 300
    batch_size: int = 16
    seq_len: int = 64
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0


def small_config() -> DecoderConfig:
    """A 2-layer, width-128 Mistral over bytes (vocab 256), window 32, float32:
    `DecoderConfig.tiny()`, the `--preset tiny` of the command line."""
    return DecoderConfig.tiny()


def held_out_loss(model: Decoder, data: np.ndarray, seq_len: int) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of the held-out data."""
    count = (len(data) - 1) // seq_len
    windows = data[: count * seq_len].reshape(count, seq_len).astype(np.int32)
    loss = eqx.filter_jit(next_token_loss)(model, jnp.asarray(windows), remat=False)
    return float(loss)


def train(
    config: DecoderConfig | None = None,
    settings: TrainSettings = TrainSettings(),
    *,
    key: PRNGKeyArray | None = None,
    log_every: int = 50,
) -> tuple[Decoder, list[float], float]:
    """Trains a fresh model on the bundled text.

    **Returns:**

    The trained model, the training losses, and the final held-out loss (nats per byte).
    """
    config = small_config() if config is None else config
    key = jax.random.key(settings.seed) if key is None else key
    train_data, held_out = split_text(load_text())
    model = init(config, key=key)
    optimizer = adamw(settings.learning_rate, settings.weight_decay)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step = make_train_step(optimizer)
    losses = []
    data = batches(train_data, settings.batch_size, settings.seq_len, seed=settings.seed)
    for i in range(settings.steps):
        model, opt_state, loss = step(model, opt_state, jnp.asarray(next(data)))
        losses.append(float(loss))
        if log_every and (i + 1) % log_every == 0:
            print(f"step {i + 1}: loss {np.mean(losses[-log_every:]):.4f}")
    return model, losses, held_out_loss(model, held_out, settings.seq_len)
