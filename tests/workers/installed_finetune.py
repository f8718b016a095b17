"""Run by `tests/test_install.py` with the interpreter of a fresh virtual environment that has
the wheel installed, from a directory outside the checkout: checks that `eqx_lean`,
`eqx_lean.hf` and `eqx_lean.lora` come from that environment, writes a tiny random checkpoint
into `./base`, loads it, fine-tunes LoRA adapters for a few steps and checks that the loss
falls. Prints `eqx_lean from <file>` and `losses [...]`.

Its own process, because it is the installed package that is under test: only a fresh
interpreter of the new environment imports it rather than this checkout. The test runs this file
by its absolute path with `python -P`, so that this folder, inside the checkout, is not put on
`sys.path` either.

    cd SCRATCH && VENV/bin/python -P /abs/path/tests/workers/installed_finetune.py
"""

import dataclasses
import math
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


# isort: off
# `eqx_lean.lora` first: alone, before `eqx_lean.hf`, it must import (it imports the HF decoder).
import eqx_lean.lora
import eqx_lean
import eqx_lean.hf

# isort: on
from eqx_lean.hf import DecoderConfig, adamw, init, load_hf, make_lora_step, save_hf
from eqx_lean.lora import LoraConfig, add_lora, lora_filter


def main() -> None:
    prefix = os.path.realpath(sys.prefix)
    for module in (eqx_lean, eqx_lean.hf, eqx_lean.lora):
        assert module.__file__ is not None
        assert os.path.realpath(module.__file__).startswith(prefix + os.sep), module.__file__
    config = dataclasses.replace(
        DecoderConfig.tiny(), hidden_size=32, intermediate_size=64, vocab_size=64
    )
    save_hf(init(config, key=jax.random.key(0), std=0.2), "base")
    model = add_lora(
        load_hf("base"),
        LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj")),
        key=jax.random.key(1),
    )
    adapters, frozen = eqx.partition(model, lora_filter(model))
    optimizer = adamw(3e-2)
    opt_state = optimizer.init(adapters)
    step = make_lora_step(optimizer, grad_accum=2)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 16), np.int32))
    losses = []
    for _ in range(4):
        adapters, opt_state, loss = step(frozen, adapters, opt_state, ids, None)
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    print("eqx_lean from", os.path.realpath(eqx_lean.__file__))
    print("losses", losses)


if __name__ == "__main__":
    main()
