"""The fused linear + cross-entropy on a GPU: measured peak memory, time, and agreement with the
textbook loss (float32 logits, `log_softmax`), each method in a fresh process.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/fused_loss_gpu.py

Cases: `f32`, the gradient with respect to the hidden states and the head at 16,384 tokens x
hidden 256 x vocab 128,256 in float32 (the size of `tests/test_linear_cross_entropy.py`'s
plan); `bf16`, the gradient with respect to the hidden states alone (a frozen head, as in LoRA)
at 2 x 2,048 tokens x hidden 4,096 x vocab 128,256 in bfloat16 (Llama-3.1-8B's head).
Per method: `peak_bytes_in_use` after one compiled call (minus the inputs' bytes), and the
median of 5 timed calls after it. Methods: `textbook`, `fused` (the default 64 MiB chunks),
`fused@N` (chunks of N MiB); name them on the command line to choose (default: textbook and
fused, twice, alternated).
"""

import os
import statistics
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp


CASES = {
    "f32": dict(batch=1, seq=16_384, hidden=256, vocab=128_256, dtype="float32", argnums=(0, 1)),
    "bf16": dict(batch=2, seq=2048, hidden=4096, vocab=128_256, dtype="bfloat16", argnums=(0,)),
}
MiB = 2**20


def textbook(hidden: Any, weight: Any, labels: Any) -> Any:
    logits = jnp.einsum("...h,vh->...v", hidden, weight).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    counted = labels != -100
    picked = jnp.take_along_axis(log_probs, jnp.where(counted, labels, 0)[..., None], axis=-1)
    total = -jnp.sum(jnp.where(counted, picked[..., 0], 0.0))
    return total / jnp.sum(counted, dtype=jnp.float32)


def loss_fn(method: str) -> Any:
    """`"textbook"`, `"fused"` (the default chunks) or `"fused@N"` (chunks of N MiB)."""
    if method == "textbook":
        return textbook
    from eqx_lean.nn import linear_cross_entropy

    chunk = None if method == "fused" else int(method.split("@")[1]) * MiB
    return lambda h, w, labels: linear_cross_entropy(h, w, labels, chunk_bytes=chunk)


def inputs(case: dict[str, Any]) -> tuple[Any, Any, Any]:
    k = jax.random.split(jax.random.key(0), 3)
    dtype = jnp.dtype(case["dtype"])
    h = jax.random.normal(k[0], (case["batch"], case["seq"], case["hidden"]), dtype)
    w = (jax.random.normal(k[1], (case["vocab"], case["hidden"]), dtype) * 0.02).astype(dtype)
    labels = jax.random.randint(k[2], (case["batch"], case["seq"]), 0, case["vocab"])
    labels = labels.at[:, : case["seq"] // 4].set(-100)  # a masked prompt
    return h, w, labels


def child(case_name: str, method: str) -> None:
    case = CASES[case_name]
    args = inputs(case)
    jax.block_until_ready(args)
    device = jax.devices()[0]
    base = device.memory_stats()["peak_bytes_in_use"]
    f = jax.jit(jax.value_and_grad(loss_fn(method), argnums=case["argnums"]))
    compiled = f.lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    peak = device.memory_stats()["peak_bytes_in_use"] - base
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    analysis = compiled.memory_analysis()
    temp = 0 if analysis is None else analysis.temp_size_in_bytes
    print(
        f"| {case_name} | {method} | {peak / MiB:,.0f} MiB | {temp / MiB:,.0f} MiB | "
        f"{statistics.median(times) * 1e3:.2f} ms |",
        flush=True,
    )


def compare(case_name: str) -> None:
    case = CASES[case_name]
    args = inputs(case)
    results = {}
    for method in ("textbook", "fused"):
        f = jax.jit(jax.value_and_grad(loss_fn(method), argnums=case["argnums"]))
        results[method] = f(*args)
    (l1, g1), (l2, g2) = results["fused"], results["textbook"]
    diffs = [
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        / float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        for a, b in zip(g1, g2, strict=True)
    ]
    print(
        f"{case_name}: loss fused {float(l1):.7f} textbook {float(l2):.7f} "
        f"(relative {abs(float(l1) / float(l2) - 1):.2e}); gradients' largest difference "
        f"relative to their largest element: {', '.join(f'{d:.2e}' for d in diffs)}",
        flush=True,
    )


def main() -> None:
    if len(sys.argv) == 3:
        if sys.argv[1] == "compare":
            compare(sys.argv[2])
        else:
            child(sys.argv[1], sys.argv[2])
        return
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    print("| case | method | peak over inputs | XLA temporaries | median time |")
    print("| --- | --- | --- | --- | --- |")
    methods = sys.argv[1:] or ["textbook", "fused", "textbook", "fused"]
    for case in CASES:
        for method in methods:
            subprocess.run([sys.executable, __file__, case, method], env=env, check=False)
    for case in CASES:
        subprocess.run([sys.executable, __file__, "compare", case], env=env, check=False)


if __name__ == "__main__":
    main()
