"""XLA's memory plan for the same programs compiled for XLA:CPU and for an H100, without a GPU.

eqx_lean's platform tricks (Threefry lowered unrolled, loop-invariant code motion disabled in
the writes, floating rows written as unsigned-integer bits, scan's optimisation barrier) were
measured on XLA:CPU. This script compiles each program twice, for this process's CPU and for a
compile-only H100 (`jax.experimental.topologies` with XLA's `h100_sxm.txtpb` device
description, `eqx_lean/_memory/gpu_specs/`), and prints XLA's `memory_analysis()`
(temporary and output bytes), the compile time, and a hash of the optimised program (equal
hashes: the same compiled program, so a trick that leaves it unchanged does nothing there).
Nothing runs: the H100 figures are XLA's plan, not a measured peak.

The H100 part runs in a subprocess with a separate venv holding `jax[cuda12]` (the CUDA plugin
is what compiles for a GPU; no GPU is needed):

    python3 -m venv /work/venvs/jax-cuda
    /work/venvs/jax-cuda/bin/pip install "jax[cuda12]==0.10.2" equinox==0.13.8 jaxtyping numpy
    PYTHONPATH=. python benchmarks/gpu_target.py [--cuda-python PATH]

Without that venv the H100 column says so and the script still succeeds. A last table counts
the `stablehlo.while` loops in the writes lowered for `cpu`, `cuda` and `tpu` (lowering only,
in this process).
"""

import argparse
import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple


_REPO = Path(__file__).resolve().parents[1]
_DEFAULT_CUDA_PYTHON = "/work/venvs/jax-cuda/bin/python"
_DEFAULT_TARGET_CONFIG = _REPO / "eqx_lean" / "_memory" / "gpu_specs" / "h100_sxm.txtpb"
_WORKER_ENV = {
    "JAX_PLATFORMS": "cpu",
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
    "CUDA_VISIBLE_DEVICES": "-1",
}
MiB = 2**20


class Tricks(NamedTuple):
    """Which of eqx_lean's CPU tricks a compiled write uses (see `_lower_build_writes`)."""

    fused: bool
    licm_off: bool
    bit_writes: bool
    loop: bool = True


# One write per variant: every CPU trick on (what eqx_lean compiles on CPU today), each one off
# in turn, all off (JAX's and XLA's defaults), and one layer per call instead of a loop.
WRITE_VARIANTS = {
    "all tricks (what build_stacked compiles for CPU)": Tricks(True, True, True),
    "(a) JAX's Threefry lowering": Tricks(fused=False, licm_off=True, bit_writes=True),
    "(b) LICM enabled": Tricks(fused=True, licm_off=False, bit_writes=True),
    "(c) no bit writes": Tricks(fused=True, licm_off=True, bit_writes=False),
    "no tricks": Tricks(fused=False, licm_off=False, bit_writes=False),
    "all tricks, one layer per call (no loop)": Tricks(True, True, True, loop=False),
    "no tricks, one layer per call (what build_stacked compiles off CPU)": Tricks(
        False, False, False, loop=False
    ),
}


def _lower_build_writes(
    make_layer: Callable[[Any], Any],
    keys_struct: Any,
    dtype: Any,
    sharding: Any,
    *,
    fused: bool,
    licm_off: bool,
    bit_writes: bool,
    loop: bool = True,
    platforms: tuple[str, ...] | None = None,
) -> list[Any]:
    """Lowers `build_stacked`'s per-group writes, each CPU trick switched on or off.

    The one place where this script uses eqx_lean internals, through the documented internal
    module `eqx_lean.internal` (`plan_build`, `Tricks`, `lower_writes`).

    **Arguments:**

    - `make_layer`, `dtype`: as for `eqx_lean.build_stacked`.
    - `keys_struct`: a `ShapeDtypeStruct` of the keys, `(num_layers,)` typed keys.
    - `sharding`: the single-device `Sharding` of every buffer, or `None` where `platforms` is
        given (lowering only).
    - `fused`: lower Threefry unrolled (eqx_lean's override) rather than with JAX's rule.
    - `licm_off`: compile with `while-loop-invariant-code-motion` disabled.
    - `bit_writes`: write floating rows as unsigned-integer bits.
    - `loop`: a `fori_loop` over a run of layers (what `build_stacked` compiles for CPU), or one
        layer per call (what it compiles elsewhere).
    - `platforms`: lower for these platforms (`lowering_platforms`) instead of the buffers'.

    **Returns:**

    One `jax.stages.Lowered` per group of leaves, ready for `.compile()`.
    """
    import jax

    from eqx_lean.internal import Tricks, lower_writes, plan_build

    # The plan only reads the keys' shape and dtype; it wants a concrete array.
    keys = jax.random.split(jax.random.key(0), keys_struct.shape[0])
    assert keys.dtype == keys_struct.dtype, (keys.dtype, keys_struct.dtype)
    plan = plan_build(make_layer, keys, dtype, sharding)
    tricks = Tricks(fused_threefry=fused, licm_off=licm_off, bit_writes=bit_writes, layer_runs=loop)
    return lower_writes(plan, tricks=tricks, lowering_platforms=platforms)


def _program_text(compiled: Any) -> str:
    """The optimised HLO without what differs between identical programs.

    Dropped: the module header (a fingerprint), the source-location tables, metadata and
    frontend attributes; instruction names are numbered in order of appearance.
    """
    lines = compiled.as_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY")))
    text = "\n".join(lines[start:])
    text = re.sub(r", (metadata|frontend_attributes)=\{[^}]*\}", "", text)
    names: dict[str, str] = {}
    text = re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%{len(names)}"), text)
    return re.sub(r"\b(constant|param|arg_tuple)[\w.]*", r"\1", text)


def _compile(lowered: Any) -> dict[str, Any]:
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    text = _program_text(compiled)
    return {
        "temp": analysis.temp_size_in_bytes,
        "out": analysis.output_size_in_bytes,
        "seconds": seconds,
        "program": hashlib.sha1(text.encode()).hexdigest()[:8],
        "loops": len(re.findall(r" while\(", text)),
    }


def _compile_all(lowered: list[Any]) -> dict[str, Any]:
    """The groups' writes run one after another: the largest temporaries bound the build."""
    figures = [_compile(x) for x in lowered]
    programs = "".join(f["program"] for f in figures)
    return {
        "temp": max(f["temp"] for f in figures),
        "out": sum(f["out"] for f in figures),
        "seconds": sum(f["seconds"] for f in figures),
        "program": hashlib.sha1(programs.encode()).hexdigest()[:8],
        "loops": sum(f["loops"] for f in figures),
    }


def _models() -> dict[str, Callable[[Any], Any]]:
    """The default bench's block, and the same block with orthogonal (QR-based) matrices."""
    import equinox as eqx
    import jax

    from eqx_lean.internal import PRESETS, Block

    config = PRESETS["default"]

    def default_block(key: Any) -> Any:
        return Block(config, key=key)

    def is_linear(x: Any) -> bool:
        return isinstance(x, eqx.nn.Linear)

    def weights(block: Any) -> list[Any]:
        return [m.weight for m in jax.tree.leaves(block, is_leaf=is_linear) if is_linear(m)]

    def orthogonal_block(key: Any) -> Any:
        block = Block(config, key=key)
        old = weights(block)
        keys = jax.random.split(jax.random.fold_in(key, 1), len(old))
        orthogonal = jax.nn.initializers.orthogonal()
        new = [orthogonal(k, w.shape, w.dtype) for k, w in zip(keys, old, strict=True)]
        return eqx.tree_at(weights, block, new)

    return {"default block": default_block, "orthogonal block": orthogonal_block}


def _figures(sharding: Any) -> dict[str, dict[str, Any]]:
    """Every figure, compiled for the device of `sharding`; keyed by the table's row names."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax import lax

    import eqx_lean
    from eqx_lean.internal import PRESETS

    num_layers = PRESETS["default"].num_layers
    key_dtype = jax.random.key(0).dtype
    key = jax.ShapeDtypeStruct((), key_dtype, sharding=sharding)
    keys = jax.ShapeDtypeStruct((num_layers,), key_dtype, sharding=sharding)
    bf16 = jnp.bfloat16

    def cast(tree: Any) -> Any:
        floating = eqx.is_inexact_array
        return jax.tree.map(lambda x: x.astype(bf16) if floating(x) else x, tree)

    results: dict[str, dict[str, Any]] = {}

    def record(name: str, compute: Callable[[], dict[str, Any]]) -> None:
        results[name] = compute()
        print(f"  {name}: {results[name]}", file=sys.stderr, flush=True)

    for model, make in _models().items():

        def vmapped(keys: Any, make: Any = make) -> Any:
            return cast(eqx.filter(eqx.filter_vmap(make)(keys), eqx.is_array))

        name = f"{model}: jit(filter_vmap + cast), {num_layers} layers"
        record(name, lambda f=vmapped: _compile(jax.jit(f).trace(keys).lower()))

    def embedding(key: Any) -> Any:
        return jax.random.normal(key, (32000, 4096)).astype(bf16)

    def lecun(key: Any) -> Any:
        return jax.nn.initializers.lecun_normal()(key, (14336, 4096)).astype(bf16)

    record("32000x4096 normal + cast", lambda: _compile(jax.jit(embedding).trace(key).lower()))
    record("14336x4096 lecun_normal + cast", lambda: _compile(jax.jit(lecun).trace(key).lower()))

    for model, make in _models().items():
        for variant, t in WRITE_VARIANTS.items():
            name = f"{model}: build_stacked writes, {variant}"
            lowered = _lower_build_writes(
                make, keys, bf16, sharding,
                fused=t.fused, licm_off=t.licm_off, bit_writes=t.bit_writes, loop=t.loop,
            )  # fmt: skip
            record(name, lambda x=lowered: _compile_all(x))

    # Scan's forward loop (`eqx_lean.scan` run without a gradient) over a bfloat16 stack with a
    # float32 activation: XLA:CPU computes in float32, and would hoist the whole stack's
    # conversion out of the loop if the stack were not tied to the loop index.
    stack = jax.ShapeDtypeStruct((8, 4096, 4096), bf16, sharding=sharding)
    activation = jax.ShapeDtypeStruct((16, 4096), jnp.float32, sharding=sharding)

    def forward(stack: Any, h: Any, barrier: bool) -> Any:
        def body(state: Any, _: Any) -> Any:
            h, i = state
            layers, at = lax.optimization_barrier((stack, i)) if barrier else (stack, i)
            w = lax.dynamic_index_in_dim(layers, at, keepdims=False)
            return (jnp.tanh(h @ w), i + 1), None

        return lax.scan(body, (h, jnp.zeros((), jnp.int32)), length=stack.shape[0])[0][0]

    def public_scan(stack: Any, h: Any) -> Any:
        step = lambda layer, h, _: (jnp.tanh(h @ layer), None)  # noqa: E731
        return eqx_lean.scan(stack, h, call=step)[0]

    for label, barrier in (("with", True), ("without", False)):
        name = f"(d) scan forward, 8 x 4096x4096 bf16, {label} barrier"
        f = jax.jit(lambda s, h, b=barrier: forward(s, h, b))
        record(name, lambda f=f: _compile(f.trace(stack, activation).lower()))
    name = "(d) scan forward, 8 x 4096x4096 bf16, eqx_lean.scan"
    record(name, lambda: _compile(jax.jit(public_scan).trace(stack, activation).lower()))
    return results


def _h100_worker(target_config: Path) -> None:
    """Prints the figures compiled for a compile-only H100 as one JSON line on stdout."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    topology = topologies.get_topology_desc(
        platform="cuda", topology="1x1x1", target_config=target_config.read_text()
    )
    (device,) = topology.devices
    print(f"H100 target: {device.device_kind}", file=sys.stderr, flush=True)
    results = _figures(SingleDeviceSharding(device))
    print(json.dumps({"jax": jax.__version__, "device": device.device_kind, "figures": results}))


def _run_h100(cuda_python: str, target_config: Path) -> dict[str, Any] | str:
    """The H100 figures from the CUDA venv, or why there are none."""
    if not Path(cuda_python).exists():
        return f"skipped: no venv at {cuda_python}"
    env = {**os.environ, **_WORKER_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [cuda_python, __file__, "--h100-worker", "--target-config", str(target_config)]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        return f"failed: `{' '.join(command)}` exited with {done.returncode} (see stderr above)"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n: float | None) -> str:
    return "—" if n is None else f"{n / MiB:.1f} MiB"


def _seconds(n: float | None) -> str:
    return "—" if n is None else f"{n:.2f} s"


def _program(figures: dict[str, Any]) -> str:
    if "program" not in figures:
        return "—"
    return f"`{figures['program']}`, {figures['loops']} loops"


def _table(cpu: dict[str, dict[str, Any]], h100: dict[str, Any] | str) -> str:
    gpu = h100["figures"] if isinstance(h100, dict) else {}
    lines = [
        "| figure | temp, CPU | temp, H100 | output, CPU | output, H100 "
        "| compile, CPU | compile, H100 | program, CPU | program, H100 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    if isinstance(h100, str):
        lines.append(f"| H100 target {h100} | | | | | | | | |")
    for name, c in cpu.items():
        g = gpu.get(name, {})
        lines.append(
            f"| {name} | {_mib(c['temp'])} | {_mib(g.get('temp'))} | {_mib(c['out'])} "
            f"| {_mib(g.get('out'))} | {_seconds(c['seconds'])} | {_seconds(g.get('seconds'))} "
            f"| {_program(c)} | {_program(g)} |"
        )
    return "\n".join(lines)


def _while_loops() -> str:
    """`stablehlo.while` loops in the writes of a split and two draws, lowered per platform."""
    import jax
    import jax.numpy as jnp

    def split_and_draw(key: Any) -> dict[str, Any]:
        kw, kb = jax.random.split(key)
        return {"w": jax.random.normal(kw, (1024, 1024)), "b": jax.random.uniform(kb, (1024,))}

    keys = jax.ShapeDtypeStruct((4,), jax.random.key(0).dtype)
    lines = [
        "| writes of `split` + `normal` (1024x1024) + `uniform` (1024) lowered for "
        "| `stablehlo.while`, JAX's Threefry | `stablehlo.while`, fused override |",
        "| --- | --- | --- |",
    ]
    for platform in ("cpu", "cuda", "tpu"):
        counts = []
        for fused in (False, True):
            lowered = _lower_build_writes(
                split_and_draw, keys, jnp.bfloat16, None,
                fused=fused, licm_off=True, bit_writes=True, platforms=(platform,),
            )  # fmt: skip
            counts.append(sum(x.as_text().count("stablehlo.while") for x in lowered))
        lines.append(f"| {platform} | {counts[0]} | {counts[1]} |")
    lines.append("\nEach count includes the writes' own loop over layers (one per group).")
    return "\n".join(lines)


def _malloc_trim_seconds() -> float | None:
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    start = time.perf_counter()
    trim(0)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--cuda-python",
        default=_DEFAULT_CUDA_PYTHON,
        help="python of a venv with jax[cuda12] and equinox (default: %(default)s)",
    )
    parser.add_argument(
        "--target-config",
        type=Path,
        default=_DEFAULT_TARGET_CONFIG,
        help="XLA GPU device description (default: %(default)s)",
    )
    parser.add_argument("--h100-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # Measure this checkout's eqx_lean, whatever copy is installed.
    sys.path.insert(0, str(_REPO))
    if args.h100_worker:
        _h100_worker(args.target_config)
        return

    start = time.perf_counter()
    import jax
    from jax.sharding import SingleDeviceSharding

    print(f"CPU: jax {jax.__version__}", file=sys.stderr, flush=True)
    cpu = _figures(SingleDeviceSharding(jax.devices("cpu")[0]))
    loops = _while_loops()
    trim = _malloc_trim_seconds()
    h100 = _run_h100(args.cuda_python, args.target_config)
    where = h100 if isinstance(h100, str) else f"{h100['device']}, jax {h100['jax']}"
    print(
        f"\nCPU: {jax.devices('cpu')[0].device_kind}, jax {jax.__version__}; H100 target: {where}"
    )
    print(
        "XLA temporaries: the largest of a build's groups of writes; compile: summed; program: a "
        "hash of the optimised HLO (names, metadata and source locations left out), equal for "
        "identical compiled programs, and its number of while loops.\n"
    )
    print(_table(cpu, h100))
    print()
    print(loops)
    if trim is not None:
        print(
            f"\n`malloc_trim(0)` after the CPU figures: {trim * 1e3:.1f} ms (glibc, CPU heap only)"
        )
    print(f"\nWhole script: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
