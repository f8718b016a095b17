"""The five seed write-ups (`/work/shared/seeds/`) replayed as compile-only memory plans.

Each case compiles its programs for a target (`eqx_lean.memory.target`) from this machine,
without the GPUs or TPUs, and prints one row per program: target, per-device peak, device
memory, whether it fits, compile seconds. Nothing runs and nothing large is allocated.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/plan_seeds.py            # every case
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/plan_seeds.py --case flax_dense

Needs the `plan` extra (JAX's CUDA plugin and libtpu, pinned to the tested JAX) and optax for
the training steps. `JAX_PLATFORMS=cpu` must be set before JAX starts (see `docs/planning.md`).
"""

import argparse
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqx_lean
import eqx_lean.hf as hf
from eqx_lean import lora
from eqx_lean.internal import layer_struct, struct_bytes
from eqx_lean.memory import plan, target


GiB = 2**30
CASES: dict[str, Callable[[], None]] = {}


def case(fn: Callable[[], None]) -> Callable[[], None]:
    CASES[fn.__name__] = fn
    return fn


def row(
    name: str, spec: str, peak: int, device_memory: int, seconds: float, note: str = ""
) -> None:
    fits = "yes" if peak <= device_memory else "NO"
    print(
        f"  {name:<44} {spec:<10} peak {peak / GiB:9.2f} GiB of {device_memory / GiB:6.2f} GiB"
        f"  fits {fits:<3}  compile {seconds:6.1f} s  {note}",
        flush=True,
    )


def plan_row(name: str, p: Any, note: str = "") -> None:
    note = f"args {p.argument / GiB:.2f}, temp {p.temp / GiB:.2f} GiB; {note}".rstrip("; ")
    if p.refused:
        note = (note + " XLA refused: " + p.refused[:120]).strip()
    row(name, p.target, p.peak, p.device_memory, p.compile_seconds, note)


def bytes_without_keys(tree: Any) -> int:
    """The bytes of `tree`'s leaves (arrays, structs or abstract values), key arrays left out."""
    return sum(
        struct_bytes(x)
        for x in jax.tree.leaves(tree)
        if not jnp.issubdtype(x.dtype, jax.dtypes.extended)
    )


def key_struct(sharding: Any, n: int | None = None) -> jax.ShapeDtypeStruct:
    dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
    return jax.ShapeDtypeStruct(() if n is None else (n,), dtype, sharding=sharding)


def one_device_mesh(spec: str) -> Mesh:
    """A one-axis mesh over the target's first device only (one GPU, one TPU chip)."""
    return Mesh(np.array(target(spec).devices[:1]), ("data",))


def fsdp_shardings(tree: Any, mesh: Mesh, axis: str = "data") -> Any:
    """`tree`'s structs, each sharded over `axis` as `eqx_lean.fsdp` shards a layer's leaves
    (its largest divisible dimension; the leading layer axis of a stack is never split)."""
    rule = eqx_lean.fsdp(mesh, axis)

    def shard(path: Any, x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        if x.ndim >= 3:  # a stacked leaf: shard the layer's own dimensions, keep the layer axis
            inner = rule(path, layer_struct(x))
            assert isinstance(inner, NamedSharding)
            sharding = NamedSharding(mesh, P(None, *inner.spec))
        else:
            sharding = rule(path, x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(shard, tree)


def replicated(tree: Any, mesh: Mesh) -> Any:
    def put(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))

    return jax.tree.map(put, tree)


# --- 1. Equinox seed: Mistral-7B's 32 blocks, built on one a100-40gb and on v4-8 ---------------

MISTRAL = hf.DecoderConfig()  # hidden 4096, intermediate 14336, 32 heads, 8 kv heads, 32 blocks


def _mistral_block(key: Any) -> hf.DecoderBlock:
    return hf.make_block(MISTRAL, key=key)


def _cast_bf16(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, tree)


@case
def mistral_build() -> None:
    """build_stacked (bfloat16) vs jitted filter_vmap + cast vs eager filter_vmap, one device."""
    n = MISTRAL.num_hidden_layers
    for spec in ("a100-40gb", "v4-8"):
        where = target(spec)
        mesh = one_device_mesh(spec)
        keys = jax.random.split(jax.random.key(0), n)
        start = time.perf_counter()
        # Placed on the mesh's one device, so that every row is compiled for the target: this
        # table's first edition passed `mesh=` alone, which then left the build on this CPU.
        est = eqx_lean.memory.estimate(_mistral_block, keys, jnp.bfloat16, P(), mesh=mesh)
        seconds = time.perf_counter() - start
        assert est.platform == where.platform, (est.platform, spec)
        temps = f"largest write's temp {est.write_temp_bytes[0] / GiB:.2f} GiB"
        note = f"estimate on {est.platform}, {temps}"
        row(
            "build_stacked (bf16)", spec, est.build_stacked_peak, where.device_memory, seconds, note
        )
        p = plan(
            lambda k: _cast_bf16(eqx.filter_vmap(_mistral_block)(k)),
            key_struct(jax.sharding.SingleDeviceSharding(where.devices[0]), n),
            target=where,
        )
        plan_row("jit(filter_vmap) + cast", p)
        # Eager filter_vmap: every layer exists at float32 before the cast, then the cast's
        # bfloat16 copy is made beside it. A lower bound (the dispatched ops' temporaries and
        # the allocator's slack come on top).
        f32 = est.construction_bytes
        lower = f32 + f32 // 2
        row(
            "eager filter_vmap + cast (lower bound)",
            spec,
            lower,
            where.device_memory,
            0.0,
            "= float32 stack + bf16 copy, not compiled",
        )


# --- 2. Flax seed: a 32768 x 262144 float32 dense layer sharded over 8 H100s -------------------


@case
def flax_dense() -> None:
    """The plain jitted lecun_normal with column-sharded out_shardings vs eqx_lean.init.chunked."""
    spec = "8xh100"
    where = target(spec)
    mesh = where.mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    columns = NamedSharding(mesh, P(None, "model"))
    shape = (32768, 262144)
    key = key_struct(NamedSharding(mesh, P()))
    plain = jax.nn.initializers.lecun_normal()

    def plain_init(k):
        return jax.lax.with_sharding_constraint(plain(k, shape, jnp.float32), columns)

    p = plan(plain_init, key, target=where)
    plan_row("jit(lecun_normal), out column-sharded", p)
    chunked = eqx_lean.init.chunked(plain)
    p = plan(lambda k: chunked(k, shape, jnp.float32, out_sharding=columns), key, target=where)
    plan_row("eqx_lean.init.chunked(lecun_normal)", p)
    # The seed's single-device story: the whole 32 GiB tensor on one H100.
    one = target("h100")
    p = plan(lambda k: plain(k, shape, jnp.float32), key_struct(None), target=one)
    plan_row("jit(lecun_normal), whole tensor, 1 GPU", p)


# --- 3. GPT-NeoX seed: 175B (96 layers, d=12288, MLP 4d, bfloat16), fsdp-sharded --------------

NEOX_D, NEOX_LAYERS = 12288, 96


class NeoxBlock(eqx.Module):
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)

    def __init__(self, d: int, num_heads: int, *, key: Any):
        k = jax.random.split(key, 4)
        self.qkv = eqx.nn.Linear(d, 3 * d, use_bias=False, key=k[0])
        self.out = eqx.nn.Linear(d, d, use_bias=False, key=k[1])
        self.up = eqx.nn.Linear(d, 4 * d, use_bias=False, key=k[2])
        self.down = eqx.nn.Linear(4 * d, d, use_bias=False, key=k[3])
        self.num_heads = num_heads

    def __call__(self, x: Any) -> Any:  # x: [batch, seq, d]
        b, s, d = x.shape
        h = self.num_heads
        q, k, v = jnp.split(x @ self.qkv.weight.T, 3, axis=-1)
        q, k, v = (t.reshape(b, s, h, d // h) for t in (q, k, v))
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d)
        x = x + attn @ self.out.weight.T
        return x + jax.nn.gelu(x @ self.up.weight.T) @ self.down.weight.T


def _neox_block(key: Any) -> NeoxBlock:
    return NeoxBlock(NEOX_D, 96, key=key)


@case
def neox_build() -> None:
    """build_stacked's peak per device, fsdp over 64 and 256 H100s (estimate(..., mesh=))."""
    for spec in ("8x8xh100", "32x8xh100"):
        where = target(spec)
        mesh = where.mesh((len(where.devices),), ("data",), axis_types=(AxisType.Auto,))
        keys = jax.random.split(jax.random.key(0), NEOX_LAYERS)
        start = time.perf_counter()
        est = eqx_lean.memory.estimate(
            _neox_block, keys, jnp.bfloat16, eqx_lean.fsdp(mesh), mesh=mesh
        )
        seconds = time.perf_counter() - start
        row(
            "build_stacked (bf16, fsdp)",
            spec,
            est.build_stacked_peak,
            where.device_memory,
            seconds,
            f"final {est.final_bytes_per_device / GiB:.2f} GiB/device, "
            f"whole stack {est.final_bytes / GiB:.0f} GiB",
        )


@case
def neox_train() -> None:
    """One adam step (value_and_grad through eqx_lean.fold, remat) on 256 H100s, fsdp, donated."""
    import optax

    spec = "32x8xh100"
    where = target(spec)
    mesh = where.mesh((len(where.devices),), ("data",), axis_types=(AxisType.Auto,))
    keys = jax.ShapeDtypeStruct((NEOX_LAYERS,), key_struct(None).dtype)
    blocks = eqx.filter_eval_shape(lambda k: _cast_bf16(eqx.filter_vmap(_neox_block)(k)), keys)
    params = fsdp_shardings(blocks, mesh)
    optimizer = optax.adam(1e-4)
    opt_state = fsdp_shardings(jax.eval_shape(optimizer.init, blocks), mesh)
    batch, seq = len(where.devices), 1024  # one sequence per GPU
    x = jax.ShapeDtypeStruct(
        (batch, seq, NEOX_D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data"))
    )

    def step(params, opt_state, x):
        def loss(params):
            y = eqx_lean.fold(params, x, remat=True)
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    p = plan(step, params, opt_state, x, target=where, donate=(0, 1))
    plan_row(
        "adam step, fold(remat), 256x1024 tokens",
        p,
        f"params {bytes_without_keys(blocks) / len(where.devices) / GiB:.2f} GiB/device",
    )


# --- 4. Llama-3-70B-shaped LoRA step ------------------------------------------------------------

LLAMA70 = hf.DecoderConfig(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    rope_theta=500000.0,
    sliding_window=None,
    model_type="llama",
    bos_token_id=128000,
    eos_token_id=128001,
)
ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@case
def llama70b_lora() -> None:
    """make_lora_step's step, frozen base fsdp-sharded, rank 16 on all seven, 1x1024 tokens."""
    lora_config = lora.LoraConfig(r=16, lora_alpha=16, target_modules=ALL_SEVEN)

    def build() -> hf.Decoder:
        base = hf.init(LLAMA70, key=jax.random.key(0), dtype=jnp.bfloat16)
        return lora.add_lora(base, lora_config, key=jax.random.key(1))

    model = eqx.filter_eval_shape(build)
    adapters, frozen = eqx.partition(model, lora.lora_filter(model))
    optimizer = hf.adamw(1e-4, weight_decay=0.0)
    opt_state = jax.eval_shape(optimizer.init, adapters)
    step = hf.make_lora_step(optimizer, remat=True)
    for spec in ("8xh100", "v5e-256"):
        where = target(spec)
        mesh = where.mesh((len(where.devices),), ("data",), axis_types=(AxisType.Auto,))
        ids = jax.ShapeDtypeStruct((1, 1024), jnp.int32, sharding=NamedSharding(mesh, P()))
        p = plan(
            step,
            fsdp_shardings(frozen, mesh),
            replicated(adapters, mesh),
            replicated(opt_state, mesh),
            ids,
            None,
            target=where,
            donate=(1, 2),
        )
        plan_row(
            "make_lora_step, r=16 x7, remat, 1x1024",
            p,
            f"base {bytes_without_keys(frozen) / GiB:.1f} GiB in all",
        )


@case
def llama70b_qlora() -> None:
    """QLoRA on one H100: the same step on an NF4 base (`plan_lora_step(quantize="nf4")`),
    1x2048 tokens, remat, against the bfloat16 base, which cannot fit (131 GiB of weights)."""
    for quantize in ("nf4", None):
        p = hf.plan_lora_step(
            LLAMA70, "h100", batch_size=1, seq_len=2048, remat=True, quantize=quantize
        )
        plan_row(
            f"make_lora_step, r=16 x7, remat, 1x2048, {quantize or 'bfloat16'} base",
            p,
            "fits" if p.fits else "does not fit",
        )


# --- 5. Haiku seed: an attention block's init, un-jitted vs jitted ------------------------------

ATTN_D, ATTN_HEADS, ATTN_LAYERS = 8192, 64, 8


def _attention_init(key: Any) -> dict[str, Any]:
    """Eight attention blocks' q, k, v, o matrices, each drawn float32 (truncated normal, as
    Haiku's default) and cast to bfloat16."""
    init = jax.nn.initializers.truncated_normal(0.02)
    params = {}
    for i, k in enumerate(jax.random.split(key, ATTN_LAYERS)):
        for name, kk in zip("qkvo", jax.random.split(k, 4), strict=True):
            params[f"{i}.{name}"] = init(kk, (ATTN_D, ATTN_D), jnp.float32).astype(jnp.bfloat16)
    return params


@case
def haiku_attention() -> None:
    """Eight d=8192 attention blocks' init on one H100: jitted plan vs un-jitted op outputs."""
    spec = "h100"
    where = target(spec)
    key = key_struct(None)
    p = plan(_attention_init, key, target=where)
    plan_row(f"jit(init), {ATTN_LAYERS} blocks d={ATTN_D}", p)
    # Un-jitted: every primitive is dispatched as its own program and its output is a real
    # buffer. Count the outputs of every dispatched op as if alive at once (Haiku's eager init
    # keeps the float32 draws until its Python frames drop them): what a run without XLA's
    # liveness analysis holds, not counting each op's own temporaries.
    start = time.perf_counter()
    jaxpr = jax.make_jaxpr(_attention_init)(jax.random.key(0)).jaxpr
    outs = sum(
        bytes_without_keys([v.aval])
        for eqn in jaxpr.eqns
        for v in eqn.outvars
        if hasattr(v, "aval")
    )
    seconds = time.perf_counter() - start
    row(
        "un-jitted init (dispatched outputs summed)",
        spec,
        outs,
        where.device_memory,
        seconds,
        "traced, not compiled",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    names = parser.parse_args().case or list(CASES)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    for name in names:
        doc = CASES[name].__doc__ or ""
        print(f"{name}: {doc.splitlines()[0] if doc else ''}")
        CASES[name]()


if __name__ == "__main__":
    main()
