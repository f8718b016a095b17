"""Fine-tuning as users run it: gradient accumulation, and saving and resuming a run exactly.

No oracle beyond the library itself: an accumulated step must equal the large-batch step (up to
float32 rounding), and a resumed run must equal an uninterrupted one bit for bit.
"""

import dataclasses
import json
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import assert_bitwise_equal, subprocess_env

from eqx_lean.hf import (
    DecoderConfig,
    FinetuneSettings,
    FinetuneState,
    adamw,
    finetune,
    init,
    load_state,
    make_lora_step,
    next_token_loss,
    save_hf,
    save_state,
)
from eqx_lean.internal import batches
from eqx_lean.lora import LoraConfig, add_lora, lora_filter


ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = dataclasses.replace(
    DecoderConfig.tiny(), hidden_size=32, intermediate_size=64, vocab_size=64, sliding_window=None
)
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"))


def _rows(count: int = 12, seq: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (count, seq), np.int32)


def _split(seed: int = 0):
    model = init(CONFIG, key=jax.random.key(seed), dtype=jnp.float32, std=0.2)
    model = add_lora(model, LORA, key=jax.random.key(seed + 1))
    # B starts at zero (the model starts unchanged); nonzero B makes A's gradient nonzero too.
    adapters, frozen = eqx.partition(model, lora_filter(model))
    adapters = jax.tree.map(lambda a: a + 0.05, adapters)
    return adapters, frozen


def _max_rel(a, b) -> float:
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)))
    return worst


def test_accumulated_step_equals_the_large_batch_step():
    # SGD with momentum: the update is linear in the gradient, so float32 rounding of the
    # accumulated gradient shows as such (Adam's g / sqrt(v) magnifies it where g is near 0).
    optimizer = optax.sgd(0.5, momentum=0.9)
    ids = jnp.asarray(_rows(8))
    results = []
    for accum in (1, 4):
        adapters, frozen = _split()
        opt_state = optimizer.init(adapters)
        step = make_lora_step(optimizer, grad_accum=accum)
        # The second step also compares the accumulated momentum.
        adapters, opt_state, _ = step(frozen, adapters, opt_state, ids, None)
        adapters, opt_state, loss = step(frozen, adapters, opt_state, ids, None)
        results.append((adapters, opt_state, loss))
    (a1, o1, l1), (a2, o2, l2) = results
    assert _max_rel(l2, l1) < 1e-6
    assert _max_rel(a2, a1) < 1e-6
    # The momentum is a sum of raw gradients: a few float32 ulps of the largest.
    assert _max_rel(o2, o1) < 1e-5


# Prompts of different lengths in each row (the first position is never a target): the four
# micro-batches of two rows count 30, 1, 0 and 12 of the batch's 43 targets.
PROMPTS = (0, 1, 15, 16, 16, 16, 5, 15)


def _masked(ids: np.ndarray) -> np.ndarray:
    labels = ids.copy()
    for row, prompt in enumerate(PROMPTS):
        labels[row, :prompt] = -100
    return labels


# The update is zero and the state's trace is the gradient itself, exactly.
GRADIENT_OF = optax.chain(optax.trace(decay=0.0), optax.scale(0.0))


def test_accumulation_with_masked_labels_equals_the_one_batch_loss():
    """HF's `num_items_in_batch`: micro-batches whose counted targets differ (30, 1, 0, 12)
    give the mean over all 43 of the batch, and its gradient, not the mean of the micro-batch
    means. The reference: the one-batch textbook loss (`fused=False`) and its gradient by JAX."""
    ids = _rows(8)
    labels = _masked(ids)
    counts = [int(np.sum(labels[r : r + 2, 1:] != -100)) for r in range(0, 8, 2)]
    assert counts == [30, 1, 0, 12]
    adapters, frozen = _split()

    @jax.jit
    def loss_and_grads(adapters, ids, labels):
        def loss_of(adapters):
            model = eqx.combine(adapters, frozen)
            return next_token_loss(model, ids, labels=labels, fused=False)

        return jax.value_and_grad(loss_of)(adapters)

    with jax.default_matmul_precision("highest"):
        expected, expected_grads = loss_and_grads(adapters, jnp.asarray(ids), jnp.asarray(labels))
        # What averaging the micro-batch means would give instead (the third counts nothing:
        # NaN there, so over the three that count): 0.09 % from the batch's mean on this
        # random model, a hundred times the tolerance below.
        means = [
            loss_and_grads(adapters, jnp.asarray(ids[r : r + 2]), jnp.asarray(labels[r : r + 2]))[0]
            for r in (0, 2, 6)
        ]
        step = make_lora_step(GRADIENT_OF, grad_accum=4)
        state = GRADIENT_OF.init(adapters)
        _, state, loss = step(frozen, adapters, state, jnp.asarray(ids), None, jnp.asarray(labels))
    assert abs(float(np.mean(means)) / float(expected) - 1) > 1e-4
    assert _max_rel(loss, expected) < 1e-6
    assert _max_rel(state[0].trace, expected_grads) < 1e-5


def test_a_batch_with_nothing_counted_gives_nan_as_transformers():
    ids = _rows(4)
    labels = np.full_like(ids, -100)
    adapters, frozen = _split()
    step = make_lora_step(GRADIENT_OF, grad_accum=2)
    state = GRADIENT_OF.init(adapters)
    _, _, loss = step(frozen, adapters, state, jnp.asarray(ids), None, jnp.asarray(labels))
    assert np.isnan(float(loss))


def test_finetune_draws_each_rows_labels_with_it():
    """`finetune(labels=...)`: the losses are those of `make_lora_step` on the batches
    `batches` draws, each with its rows' labels; a masked run differs from an unmasked one,
    and resuming refuses other labels."""
    rows = _rows(10)
    labels = _masked(rows)  # the first eight rows masked, the last two not
    settings = dataclasses.replace(SETTINGS, steps=2)
    _, losses, _ = finetune(_base(), rows, LORA, settings, labels=labels)
    _, unmasked, _ = finetune(_base(), rows, LORA, settings)
    assert losses != unmasked

    # The same steps by hand: the adapters finetune starts from, the same draws.
    key = jax.random.split(jax.random.key(settings.seed))[0]
    model = add_lora(_base(), LORA, key=key)
    adapters, frozen = eqx.partition(model, lora_filter(model))
    optimizer = adamw(settings.learning_rate, weight_decay=settings.weight_decay)
    state = optimizer.init(adapters)
    step = make_lora_step(optimizer, grad_accum=settings.grad_accum)
    order = batches(np.arange(len(rows)), settings.batch_size, seed=settings.seed)
    expected = []
    for _ in range(settings.steps):
        take = next(order)
        batch, batch_labels = jnp.asarray(rows[take]), jnp.asarray(labels[take])
        adapters, state, loss = step(frozen, adapters, state, batch, None, batch_labels)
        expected.append(float(loss))
    assert losses == expected


def test_resume_refuses_other_labels(tmp_path: pathlib.Path):
    rows = _rows(10)
    short = dataclasses.replace(SETTINGS, steps=1)
    finetune(_base(), rows, LORA, short, save_state=tmp_path / "s", labels=_masked(rows))
    for other in (None, rows):  # no labels, other labels
        with pytest.raises(ValueError, match="other settings or data"):
            finetune(_base(), rows, LORA, SETTINGS, resume=tmp_path / "s", labels=other)
    with pytest.raises(ValueError, match="`labels` must be integers of `rows`' shape"):
        finetune(_base(), rows, LORA, SETTINGS, labels=rows[:, :-1])


def test_grad_accum_refuses_a_batch_it_cannot_split():
    adapters, frozen = _split()
    optimizer = adamw(1e-2)
    step = make_lora_step(optimizer, grad_accum=3)
    with pytest.raises(ValueError, match="multiple of `grad_accum`"):
        step(frozen, adapters, optimizer.init(adapters), jnp.asarray(_rows(8)), None)
    with pytest.raises(ValueError, match="positive integer"):
        make_lora_step(optimizer, grad_accum=0)


def test_batches_resume_from_a_step():
    rows = _rows(7)
    straight = batches(rows, 3, seed=5)
    all_batches = [next(straight) for _ in range(9)]
    resumed = batches(rows, 3, seed=5, start=4)
    for expected in all_batches[4:]:
        np.testing.assert_array_equal(next(resumed), expected)


def test_state_round_trips_bitwise(tmp_path: pathlib.Path):
    adapters, _ = _split()
    optimizer = adamw(1e-2)
    opt_state = optimizer.init(adapters)
    state = FinetuneState(adapters, opt_state, 7, jax.random.key(3), {"seed": 1})
    save_state(tmp_path / "state", state)
    fresh_adapters, _ = _split(seed=9)
    like = FinetuneState(fresh_adapters, optimizer.init(fresh_adapters), 0, jax.random.key(0))
    loaded = load_state(tmp_path / "state", like)
    assert loaded.step == 7 and loaded.info == {"seed": 1}
    assert_bitwise_equal(loaded.adapters, adapters)
    assert_bitwise_equal(loaded.opt_state, opt_state)
    assert_bitwise_equal(jax.random.key_data(loaded.key), jax.random.key_data(state.key))


SETTINGS = FinetuneSettings(steps=5, batch_size=4, learning_rate=1e-2, seed=3, grad_accum=2)
DROPOUT = dataclasses.replace(LORA, lora_dropout=0.1)


def _base():
    return init(CONFIG, key=jax.random.key(0), dtype=jnp.float32, std=0.2)


def test_resumed_run_equals_the_uninterrupted_one(tmp_path: pathlib.Path):
    rows = _rows(10)
    straight, straight_losses, _ = finetune(_base(), rows, DROPOUT, SETTINGS)
    # Two steps, saved; then fresh objects resume and run to the end, saving every step.
    short = dataclasses.replace(SETTINGS, steps=2)
    _, first_losses, _ = finetune(_base(), rows, DROPOUT, short, save_state=tmp_path / "s")
    resumed, later_losses, _ = finetune(
        _base(),
        rows,
        DROPOUT,
        SETTINGS,
        resume=tmp_path / "s",
        save_state=tmp_path / "s",
        save_every=1,
    )
    assert first_losses + later_losses == straight_losses
    assert_bitwise_equal(
        eqx.filter(resumed, lora_filter(resumed)), eqx.filter(straight, lora_filter(straight))
    )
    meta = json.loads((tmp_path / "s" / "finetune_state.json").read_text())
    assert meta["step"] == SETTINGS.steps


def test_resume_refuses_other_settings(tmp_path: pathlib.Path):
    rows = _rows(10)
    short = dataclasses.replace(SETTINGS, steps=1)
    finetune(_base(), rows, LORA, short, save_state=tmp_path / "s")
    other = dataclasses.replace(SETTINGS, learning_rate=1e-3)
    with pytest.raises(ValueError, match="other settings or data"):
        finetune(_base(), rows, LORA, other, resume=tmp_path / "s")
    with pytest.raises(ValueError, match="other settings or data"):
        finetune(_base(), _rows(10, seed=1), LORA, SETTINGS, resume=tmp_path / "s")


def _cli(*args: str, cwd: pathlib.Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "examples.mistral7b", *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow  # three processes, each compiling (about 20 s); the docs run the flags too
def test_cli_resume_in_a_fresh_process_equals_the_straight_run(tmp_path: pathlib.Path):
    """`finetune --save-state` then `--resume` in a new process: same adapters, bit for bit."""
    byte_level = dataclasses.replace(CONFIG, vocab_size=256)  # no tokenizer.json: bytes
    save_hf(init(byte_level, key=jax.random.key(0), std=0.2), tmp_path / "base")
    data = tmp_path / "data.txt"
    data.write_text("fine-tuning resumes exactly where it stopped. " * 20)
    common = ["finetune", "--checkpoint", str(tmp_path / "base"), "--data", str(data)]
    common += ["--targets", "q", "v", "--seq-len", "16", "--batch-size", "4", "--grad-accum", "2"]
    out = _cli(*common, "--steps", "4", "--save-adapters", str(tmp_path / "straight"), cwd=ROOT)
    assert "s/step; peak RSS" in out
    _cli(*common, "--steps", "2", "--save-state", str(tmp_path / "state"), cwd=ROOT)
    out = _cli(
        *common,
        "--steps",
        "4",
        "--resume",
        str(tmp_path / "state"),
        "--save-adapters",
        str(tmp_path / "resumed"),
        cwd=ROOT,
    )
    assert "resumed from" in out
    from safetensors.numpy import load_file

    straight = load_file(tmp_path / "straight" / "adapter_model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "adapter_model.safetensors")
    assert straight.keys() == resumed.keys() and straight
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name])
