"""Measured GPU memory and time of eqx_lean's main jobs, for calibrating plans made without one.

Run on a machine with a GPU (each case in a fresh process, with
`XLA_PYTHON_CLIENT_PREALLOCATE=false` so that JAX allocates what it uses and no more):

    PYTHONPATH=. python benchmarks/gpu_calibrate.py [--out DIR] [--cases PREFIX ...]

Each case prints one JSON line and the script ends with a table. Cases:

- `build:METHOD:PRESET:ALLOCATOR`: the construction methods of `python -m eqx_lean.bench`
  (`build_stacked`, `filter_jit(filter_vmap)`, eager `filter_vmap`, each followed by the cast
  to bfloat16) on the bench's `default` and `mistral7b` block stacks, under JAX's default
  allocator (`bfc`) and `XLA_PYTHON_CLIENT_ALLOCATOR=platform`. Peak is
  `memory_stats()["peak_bytes_in_use"]` minus the bytes in use before construction.
- `load:PRESET`: `load_stacked` of a bfloat16 checkpoint (written by `save_stacked` in another
  process first) onto the GPU; the GPU peak over idle and the host's anonymous peak.
- `lora7b:BxS`: one LoRA AdamW step of the Mistral example at Mistral-7B v0.1 shape (bfloat16
  base built on the GPU with `build_stacked`, rank 16 on all seven projections, `remat=True`),
  the measured peak beside XLA's `memory_analysis()` of the same compiled step on this GPU.
- `torch_peft7b:BxS`: the same step in PyTorch with `transformers` and `peft` (gradient
  checkpointing, AdamW), as the speed and memory reference: `torch.cuda.max_memory_allocated`.

Step times are the median of the steps after the first (which compiles).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


_REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
MiB = 2**20
CHECKPOINT = Path("/tmp/eqx_lean_calibrate_ckpt")

CASES = [
    *(
        f"build:{method}:{preset}:bfc"
        for preset in ("default", "mistral7b")
        for method in ("build_stacked", "filter_jit(filter_vmap)", "filter_vmap")
    ),
    "build:build_stacked:default:platform",
    "build:filter_jit(filter_vmap):default:platform",
    "load:large",
    "lora:v0.1:1x256",
    "lora:v0.1:4x1024",
    "torch_peft:v0.1:1x256",
    "torch_peft:v0.1:4x1024",
]


def _gpu_stats() -> dict[str, Any]:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return {"in_use": stats.get("bytes_in_use"), "peak": stats.get("peak_bytes_in_use")}


def _minus(a: int | None, b: int | None) -> int | None:
    """`a - b`, or None where the platform reports no memory statistics (CPU)."""
    return None if a is None or b is None else a - b


def _block_names(path: Any, leaf: Any) -> str:
    import jax

    return "layers.{i}" + jax.tree_util.keystr(path)


def _make_blocks(preset: str, method: str) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp

    from eqx_lean.internal import METHODS, PRESETS, Block

    config = PRESETS[preset]
    keys = jax.random.split(jax.random.key(0), config.num_layers)
    jax.block_until_ready(keys)
    return (lambda k: Block(config, key=k)), (METHODS[method], keys, jnp.bfloat16)


def case_build(method: str, preset: str) -> dict[str, Any]:
    import jax

    from eqx_lean.internal import tree_bytes

    make, (build, keys, dtype) = _make_blocks(preset, method)
    idle = _gpu_stats()
    start = time.perf_counter()
    blocks = jax.block_until_ready(build(make, keys, dtype))
    seconds = time.perf_counter() - start
    after = _gpu_stats()
    final = tree_bytes(blocks)
    result: dict[str, Any] = {"final_bytes": final, "seconds": seconds}
    if idle["peak"] is not None and after["peak"] is not None:
        result["peak_over_idle_bytes"] = after["peak"] - idle["in_use"]
        result["ratio"] = result["peak_over_idle_bytes"] / final
    if method == "filter_jit(filter_vmap)":
        import equinox as eqx

        from eqx_lean.internal import cast_floating

        compiled = (
            jax.jit(
                lambda k: eqx.filter(cast_floating(eqx.filter_vmap(make)(k), dtype), eqx.is_array)
            )
            .lower(keys)
            .compile()
        )
        analysis = compiled.memory_analysis()
        assert analysis is not None
        result["xla_temp_bytes"] = analysis.temp_size_in_bytes
        result["xla_output_bytes"] = analysis.output_size_in_bytes
    return result


def case_load(preset: str) -> dict[str, Any]:
    import equinox as eqx
    import jax

    import eqx_lean
    from eqx_lean.internal import peak_rss_bytes, rss_bytes, tree_bytes

    make, (_, keys, dtype) = _make_blocks(preset, "build_stacked")
    if not CHECKPOINT.exists():
        raise RuntimeError("run the `save` step first")
    like = eqx.filter_eval_shape(eqx_lean.build_stacked, make, keys, dtype)
    idle = _gpu_stats()
    host_idle = rss_bytes()
    start = time.perf_counter()
    blocks = jax.block_until_ready(eqx_lean.load_stacked(CHECKPOINT, like, _block_names))
    seconds = time.perf_counter() - start
    after = _gpu_stats()
    final = tree_bytes(blocks)
    return {
        "final_bytes": final,
        "seconds": seconds,
        "gib_per_s": final / GiB / seconds,
        "peak_over_idle_bytes": _minus(after["peak"], idle["in_use"]),
        "host_peak_over_idle_bytes": peak_rss_bytes() - host_idle,
    }


def save_checkpoint(preset: str) -> dict[str, Any]:
    import shutil

    import jax

    import eqx_lean
    from eqx_lean.internal import tree_bytes

    make, (_, keys, dtype) = _make_blocks(preset, "build_stacked")
    blocks = jax.block_until_ready(eqx_lean.build_stacked(make, keys, dtype))
    shutil.rmtree(CHECKPOINT, ignore_errors=True)
    start = time.perf_counter()
    eqx_lean.save_stacked(CHECKPOINT, blocks, _block_names)
    return {"bytes": tree_bytes(blocks), "seconds": time.perf_counter() - start}


def _shape(spec: str) -> tuple[int, int]:
    batch, seq = spec.split("x")
    return int(batch), int(seq)


def case_lora(preset: str, spec: str, steps: int = 5) -> dict[str, Any]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(_REPO))
    from eqx_lean.hf import DecoderConfig, init, make_lora_step
    from eqx_lean.internal import LORA_TARGETS, tree_bytes
    from eqx_lean.lora import LoraConfig, add_lora, lora_filter
    from examples.mistral7b.train import adamw

    batch, seq = _shape(spec)
    config = DecoderConfig.preset(preset)
    idle = _gpu_stats()
    start = time.perf_counter()
    model = init(config, key=jax.random.key(0), dtype=jnp.bfloat16)
    model = add_lora(
        model,
        LoraConfig(r=16, lora_alpha=16, target_modules=tuple(LORA_TARGETS)),
        key=jax.random.key(1),
    )
    jax.block_until_ready(model)
    build_seconds = time.perf_counter() - start
    build_peak = _minus(_gpu_stats()["peak"], idle["in_use"])
    adapters, frozen = eqx.partition(model, lora_filter(model))
    optimizer = adamw(1e-4, weight_decay=0.0)
    opt_state = optimizer.init(adapters)
    step = make_lora_step(optimizer, remat=True)
    ids = jax.random.randint(jax.random.key(2), (batch, seq), 0, config.vocab_size)
    resident = _gpu_stats()["in_use"]
    start = time.perf_counter()
    compiled = step.lower(frozen, adapters, opt_state, ids, None).compile()
    compile_seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    assert analysis is not None
    seconds, loss = [], None
    for _ in range(steps):
        start = time.perf_counter()
        adapters, opt_state, loss = compiled(frozen, adapters, opt_state, ids, None)
        float(loss)
        seconds.append(time.perf_counter() - start)
    peak = _gpu_stats()["peak"]
    return {
        "base_bytes": tree_bytes(frozen),
        "adapter_bytes": tree_bytes(adapters),
        "build_seconds": build_seconds,
        "build_peak_over_idle_bytes": build_peak,
        "resident_before_step_bytes": _minus(resident, idle["in_use"]),
        "peak_over_idle_bytes": _minus(peak, idle["in_use"]),
        "step_peak_over_resident_bytes": _minus(peak, resident),
        "xla_temp_bytes": analysis.temp_size_in_bytes,
        "xla_argument_bytes": analysis.argument_size_in_bytes,
        "xla_output_bytes": analysis.output_size_in_bytes,
        "xla_alias_bytes": analysis.alias_size_in_bytes,
        "compile_seconds": compile_seconds,
        "step_seconds": statistics.median(seconds[1:]),
        "first_step_seconds": seconds[0],
        "loss": float(loss) if loss is not None else None,
        "tokens_per_s": batch * seq / statistics.median(seconds[1:]),
    }


def case_torch_peft(preset: str, spec: str, steps: int = 5) -> dict[str, Any]:
    import peft
    import torch
    import transformers

    batch, seq = _shape(spec)
    sys.path.insert(0, str(_REPO))
    from eqx_lean.hf import DecoderConfig

    ours = DecoderConfig.preset(preset)
    config = transformers.MistralConfig(**ours.to_hf())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        model = transformers.MistralForCausalLM(config)
        torch.set_default_dtype(torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.LoraConfig(r=16, lora_alpha=16, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(model, lora)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    build_seconds = time.perf_counter() - start
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0
    )
    ids = torch.randint(0, ours.vocab_size, (batch, seq), device=device)
    cuda = device == "cuda"
    resident = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds, loss = [], None
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        seconds.append(time.perf_counter() - start)
    return {
        "versions": (
            f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"peft {peft.__version__}"
        ),
        "attn_implementation": model.config._attn_implementation,
        "build_seconds": build_seconds,
        "resident_before_step_bytes": resident,
        "peak_over_idle_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "step_peak_over_resident_bytes": (torch.cuda.max_memory_allocated() - resident)
        if cuda
        else None,
        "step_seconds": statistics.median(seconds[1:]),
        "first_step_seconds": seconds[0],
        "loss": float(loss.item()) if loss is not None else None,
        "tokens_per_s": batch * seq / statistics.median(seconds[1:]),
    }


def run_case(name: str) -> dict[str, Any]:
    kind, *args = name.split(":")
    if kind == "build":
        return case_build(args[0], args[1])
    if kind == "save":
        return save_checkpoint(args[0])
    if kind == "load":
        return case_load(args[0])
    if kind == "lora":
        return case_lora(args[0], args[1])
    if kind == "torch_peft":
        return case_torch_peft(args[0], args[1])
    raise ValueError(name)


def _environment() -> dict[str, Any]:
    import equinox
    import jax

    return {
        "jax": jax.__version__,
        "equinox": equinox.__version__,
        "device": str(jax.devices()[0].device_kind),
        "memory_limit_bytes": (jax.devices()[0].memory_stats() or {}).get("bytes_limit"),
    }


def _spawn(name: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=str(_REPO))
    if name.endswith(":platform"):
        env["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--case", name],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"case": name, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"case": name, "error": done.stderr[-1500:]}
    result = json.loads(lines[-1])
    result["case"] = name
    result["process_seconds"] = time.perf_counter() - start
    return result


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, int) and abs(value) >= MiB:
        return f"{value / MiB:,.1f} MiB"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--case", help="run one case in this process (internal)")
    parser.add_argument("--cases", nargs="*", default=None, help="case name prefixes to run")
    parser.add_argument("--out", type=Path, default=None, help="write results.jsonl here")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    if args.case:
        if args.case == "env":
            print(json.dumps(_environment()))
        else:
            print(json.dumps(run_case(args.case)))
        return
    cases = [c for c in CASES if args.cases is None or any(c.startswith(p) for p in args.cases)]
    loads = [c for c in cases if c.startswith("load:")]
    saves = ["save:" + c.split(":")[1] for c in loads]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    results = []
    # Each result is printed and appended as soon as it is known, so that a run cut short by a
    # time limit still leaves the cases it finished.
    for case in ["env", *saves, *cases]:
        results.append(_spawn(case, args.timeout))
        print(json.dumps(results[-1]), flush=True)
        if args.out:
            with (args.out / "results.jsonl").open("a") as f:
                f.write(json.dumps(results[-1]) + "\n")
    print()
    for r in results:
        shown = {k: _fmt(v) for k, v in r.items() if k not in ("case", "error")}
        print(r["case"], "ERROR " + r["error"][-400:] if "error" in r else shown)


if __name__ == "__main__":
    main()
