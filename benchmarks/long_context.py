"""Long contexts (issue 44): XLA's plans of the Llama-3.1-8B-shaped NF4 LoRA step on one H100
and a v5e-16, compile only, and the context search.

Cases (nothing runs, nothing is allocated; the `plan` extra, `JAX_PLATFORMS=cpu`):

- `plans`: `hf.plan_lora_step` (rank 16 on all seven projections, NF4 base) on one H100 at its
    default fraction (59.36 GiB usable): 1 x 131,072 with `remat=True`, the same with the MLP
    unchunked (what the chunking buys), and `remat="offload"` at 1 x 131,072 and 1 x 344,064:
    arguments, temporaries, the sum (`peak`), XLA's own peak, its host bytes and the verdict.
- `torchtune`: torchtune's configuration (rank 8 on all seven projections, NF4 with
    double-quantised scales) at 2 x 2,048, `remat="offload"` and `remat=True`.
- `search`: `hf.longest_context` (steps of 2,048 tokens, at most 8 compiles): the 8B on one
    H100 with `remat=True` and `"offload"`, torchtune's configuration at batch 2 with
    `"offload"`, and the 8B with a bfloat16 base on a v5e-16 (batch 16, `remat=True`), each
    with its compiles.
- `qwen3`: `hf.longest_context` of a Qwen3-8B-shaped NF4 LoRA step on one H100, `remat=True`
    and `"offload"` (issue 45).
- `tpu_nf4`: the NF4 step against the bfloat16 one at 2,048 tokens on a v5e-16, a v5e-4 and
    4 H100s, 2 and 32 layers: XLA's TPU compiler refuses every NF4 one.

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=. \
        python benchmarks/long_context.py plans torchtune search tpu_nf4 qwen3
"""

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax

from eqx_lean import hf, lora, quant
from eqx_lean.internal import platform_tricks


sys.path.insert(0, "benchmarks")
from fused_loss import ALL_SEVEN, LLAMA_8B  # noqa: E402


GiB = 2**30
RANK16 = lora.LoraConfig(r=16, lora_alpha=32, target_modules=ALL_SEVEN)
RANK8 = lora.LoraConfig(r=8, lora_alpha=16, target_modules=ALL_SEVEN)
DOUBLE_NF4 = quant.QuantConfig(scheme="nf4", double_quant=True)
HEADER = (
    "| step | arguments | temporaries | peak (sum) | XLA's peak | host | fits | compile |\n"
    + "| --- " * 8
    + "|"
)


@contextlib.contextmanager
def mlp_unchunked() -> Iterator[None]:
    """The decoder's MLP on the whole sequence at once, as before issue 44 (for comparison)."""
    before = platform_tricks.MLP_CHUNK_BYTES
    platform_tricks.MLP_CHUNK_BYTES = 2**62
    try:
        yield
    finally:
        platform_tricks.MLP_CHUNK_BYTES = before


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def row(name: str, target: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    plan = hf.plan_lora_step(LLAMA_8B, target, **kwargs)
    seconds = time.perf_counter() - start
    print(
        f"| {name} | {gib(plan.argument)} | {gib(plan.temp)} | {gib(plan.peak)} | "
        f"{gib(plan.xla_peak)} | {gib(plan.host)} | {plan.fits} | {seconds:.0f} s |",
        flush=True,
    )
    return plan


def unchunked_case() -> None:
    """The 131,072-token row with the MLP unchunked alone (what the chunking buys)."""
    print(HEADER)
    step = dict(batch_size=1, lora_config=RANK16, quantize="nf4")
    with mlp_unchunked():
        row("1 x 131,072, remat=True, MLP unchunked", "h100", seq_len=131_072, remat=True, **step)


def plans_case() -> None:
    print("\nplan_lora_step, Llama-3.1-8B shape, NF4 base, rank 16 x 7, one H100 (59.36 GiB)")
    print(HEADER)
    step = dict(batch_size=1, lora_config=RANK16, quantize="nf4")
    row("1 x 131,072, remat=True", "h100", seq_len=131_072, remat=True, **step)
    with mlp_unchunked():
        row("1 x 131,072, remat=True, MLP unchunked", "h100", seq_len=131_072, remat=True, **step)
    row("1 x 131,072, remat=offload", "h100", seq_len=131_072, remat="offload", **step)
    row("1 x 344,064, remat=offload", "h100", seq_len=344_064, remat="offload", **step)


def torchtune_case() -> None:
    print("\ntorchtune's configuration: rank 8 x 7, NF4 with double-quantised scales, one H100")
    print(HEADER)
    step = dict(batch_size=2, seq_len=2048, lora_config=RANK8, quantize=DOUBLE_NF4)
    for remat in ("offload", True):
        row(f"2 x 2,048, remat={remat}", "h100", remat=remat, **step)


def search_case() -> None:
    print("\nhf.longest_context (steps of 2,048 tokens, at most 8 compiles)")
    print("| model, target, batch, remat | longest | next step | compiles | host | search |")
    print("| --- " * 6 + "|")
    cases = [
        ("8B NF4 rank 16, h100, 1, True", "h100", 1, RANK16, "nf4", True),
        ("8B NF4 rank 16, h100, 1, offload", "h100", 1, RANK16, "nf4", "offload"),
        ("8B double-NF4 rank 8, h100, 2, offload", "h100", 2, RANK8, DOUBLE_NF4, "offload"),
        # NF4 on a TPU is refused by XLA at any length (16-17 GiB of temporaries "required"
        # whatever the layers or chips: `tpu_nf4`), so the v5e-16 answer is a bfloat16 base's.
        ("8B bf16 rank 16, v5e-16, 16, True", "v5e-16", 16, RANK16, None, True),
    ]
    for name, target, batch, lora_config, quantize, remat in cases:
        start = time.perf_counter()
        found = hf.longest_context(
            LLAMA_8B,
            target,
            batch_size=batch,
            lora_config=lora_config,
            quantize=quantize,
            remat=remat,
        )
        seconds = time.perf_counter() - start
        bound = "-" if found.bound is None else f"{found.bound:,}"
        print(
            f"| {name} | {found.size:,} | {bound} | {found.compiles} | {gib(found.plan.host)} | "
            f"{seconds:.0f} s |",
            flush=True,
        )
        print("  tried: " + ", ".join(f"{s:,} {'fits' if f else 'no'}" for s, _, f in found.tried))


QWEN3_8B = hf.DecoderConfig(
    model_type="qwen3",
    vocab_size=151_936,
    hidden_size=4096,
    intermediate_size=12_288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=1_000_000.0,
    sliding_window=None,
    tie_word_embeddings=False,
)


def qwen3_case() -> None:
    """Issue 45's bar: a Qwen3-8B-shaped NF4 LoRA step's longest context on one H100."""
    print("\nhf.longest_context, Qwen3-8B shape, NF4, rank 16 x 7, one H100, batch 1")
    for remat in (True, "offload"):
        start = time.perf_counter()
        found = hf.longest_context(
            QWEN3_8B, "h100", lora_config=RANK16, quantize="nf4", remat=remat
        )
        tried = ", ".join(f"{s:,} {'fits' if f else 'no'}" for s, _, f in found.tried)
        print(
            f"remat={remat}: {found.size:,} tokens ({gib(found.plan.needed)}; host "
            f"{gib(found.plan.host)}), {found.bound:,} does not; {found.compiles} compiles "
            f"({tried}); {time.perf_counter() - start:.0f} s",
            flush=True,
        )


def tpu_nf4_case() -> None:
    """The NF4 step on TPUs: refused by XLA at 2,048 tokens whatever the layers and chips,
    where the bfloat16 base plans in about a GiB (and where one H100 plans NF4 in less)."""
    print("\nplan_lora_step at batch x 2,048, rank 16 x 7, remat=True: NF4 against bfloat16")
    print("| target, layers, base | needed | temporaries | refused |\n" + "| --- " * 4 + "|")
    for target, batch in (("v5e-16", 16), ("v5e-4", 4), ("4xh100", 4)):
        for layers in (2, 32):
            config = dataclasses.replace(LLAMA_8B, num_hidden_layers=layers)
            for quantize in ("nf4", None):
                plan = hf.plan_lora_step(
                    config,
                    target,
                    batch_size=batch,
                    seq_len=2048,
                    lora_config=RANK16,
                    quantize=quantize,
                    remat=True,
                )
                print(
                    f"| {target}, {layers}, {quantize or 'bfloat16'} | {gib(plan.needed)} | "
                    f"{gib(plan.temp)} | {'yes' if plan.refused else 'no'} |",
                    flush=True,
                )


CASES = {
    "plans": plans_case,
    "torchtune": torchtune_case,
    "search": search_case,
    "tpu_nf4": tpu_nf4_case,
    "qwen3": qwen3_case,
    "unchunked": unchunked_case,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("cases", nargs="*", choices=sorted(CASES), default=sorted(CASES))
    args = parser.parse_args()
    print(f"jax {jax.__version__}; config {dataclasses.asdict(LLAMA_8B)['model_type']}")
    for name in args.cases:
        CASES[name]()


if __name__ == "__main__":
    main()
