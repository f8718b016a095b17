"""The chunked write engine of loads (`eqx_lean/_core/chunks.py`): how it cuts buffers into
calls, and what a compiled chunk write needs beside its buffers (compiled only)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import mesh_of
from jax.sharding import NamedSharding, PartitionSpec as P

from eqx_lean.internal import (
    CHUNK_ALIGN,
    BufferPlan,
    allocate_buffers,
    call_offsets,
    compile_chunk_writes,
    fill_chunks,
    lower_chunk_write,
    memory_analysis,
    plan_chunks,
)


MIB = 2**20


def buffer_plan(shape, dtype=jnp.bfloat16, stacked=True, source=np.float32, sharding=None):
    struct = jax.ShapeDtypeStruct(shape, dtype)
    return BufferPlan(struct, sharding, stacked, np.dtype(source))


# Mistral-7B-shaped: one block's leaves (stacked over 32 layers) and the embedding and head.
BLOCK = [(4096,), (4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (4096,)]
BLOCK += [(14336, 4096), (14336, 4096), (4096, 14336)]


def test_calls_cover_every_row_within_the_chunk_budget():
    plans = [buffer_plan((32, *shape)) for shape in BLOCK]
    plans += [buffer_plan((32000, 4096), stacked=False), buffer_plan((4096,), stacked=False)]
    (stacked, plain) = plan_chunks(plans, 4 * MIB, host_writes=False)
    for group in (stacked, plain):
        staged = sum(p.staged_bytes() for p in group.parts)
        one_row = sum(
            int(np.prod(p.local[p.row_axis + 1 :])) * 4 + CHUNK_ALIGN for p in group.parts
        )
        assert staged <= 4 * MIB + one_row, (staged, one_row)
        for part in group.parts:
            rows = part.local[part.row_axis]
            starts = {
                int(call_offsets(group, 0, call)[1 + group.parts.index(part)])
                for call in range(group.calls)
            }
            covered = set().union(*(range(s, s + part.rows) for s in starts))
            assert covered == set(range(rows)), part.buffer
    assert stacked.local_layers == 32 and plain.local_layers == 1


def test_compiled_write_needs_at_most_one_chunk_beside_its_buffers():
    """float32 values cast into bfloat16 Mistral-7B buffers (13.5 GiB, compiled only): the
    write's temporaries are at most the chunk (the cast values), never a tensor or a layer."""
    plans = [buffer_plan((32, *shape)) for shape in BLOCK]
    plans += [buffer_plan((32000, 4096), stacked=False), buffer_plan((32000, 4096), stacked=False)]
    for group in plan_chunks(plans, 4 * MIB, host_writes=False):
        analysis = memory_analysis(lower_chunk_write(group).compile())
        buffers = sum(int(np.prod(b.shape)) * 2 for b in group.buffers)
        assert analysis.alias_size_in_bytes == buffers  # updated in place
        assert analysis.temp_size_in_bytes <= 4 * MIB, analysis.temp_size_in_bytes


@pytest.mark.cpu_mesh
def test_sharded_compiled_write_is_one_program_for_every_device():
    """float32 values cast into bfloat16 buffers sharded over 8 devices (compiled only): one
    program whose buffers and temporaries are per device."""
    mesh = mesh_of((8,), ("data",))
    plans = [
        buffer_plan((32, 14336, 4096), sharding=NamedSharding(mesh, P(None, "data"))),
        buffer_plan((32, 4096, 14336), sharding=NamedSharding(mesh, P(None, None, "data"))),
        buffer_plan((32, 4096), sharding=NamedSharding(mesh, P())),
        buffer_plan((32000, 4096), stacked=False, sharding=NamedSharding(mesh, P("data"))),
    ]
    for group in plan_chunks(plans, 4 * MIB, host_writes=False):
        analysis = memory_analysis(lower_chunk_write(group).compile())
        per_device = sum(int(np.prod(b.sharding.shard_shape(b.shape))) * 2 for b in group.buffers)
        assert analysis.alias_size_in_bytes == per_device, analysis
        # The chunk is spread over the devices: a device's cast values are its share.
        assert analysis.temp_size_in_bytes <= 4 * MIB // 8 + 64 * 1024, analysis


@pytest.mark.xla_cpu  # host memory is XLA's own buffer (a donation reuses it) on the CPU only
def test_host_buffers_allocated_in_threads_come_back_in_target_order():
    # The host allocations run in a thread pool, one shard each; the buffers must still match
    # their plans one for one (shape, dtype, sharding), be zeros, and be XLA's own memory.
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("data",))
    shardings = [
        None,
        jax.sharding.SingleDeviceSharding(device),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    ]
    shapes = [(3, 5, 7), (9,), (4, 6), (2, 2, 2), (1,), (8, 3)]
    dtypes = [jnp.bfloat16, jnp.float32, jnp.int8]
    plans = [
        buffer_plan(shape, dtypes[j % 3], stacked=len(shape) == 3, sharding=shardings[j % 3])
        for j, shape in enumerate(shapes)
    ]
    buffers = allocate_buffers(plans, host_writes=True)
    for j, (t, buffer) in enumerate(zip(plans, buffers, strict=True)):
        assert buffer.shape == t.struct.shape and buffer.dtype == t.struct.dtype, j
        assert buffer.committed == (t.sharding is not None), j
        if t.sharding is not None:
            assert buffer.sharding.is_equivalent_to(t.sharding, buffer.ndim), j
        np.testing.assert_array_equal(np.asarray(buffer), np.zeros(t.struct.shape, t.struct.dtype))
        before = buffer.unsafe_buffer_pointer()
        updated = jax.jit(lambda x: x + 1, donate_argnums=0)(buffer)
        assert updated.unsafe_buffer_pointer() == before, f"target {j}: donation copied"


@pytest.mark.parametrize("host_writes", [True, False])
def test_zero_size_buffers_are_allocated_and_left_alone(host_writes):
    plans = [buffer_plan((3, 0, 4)), buffer_plan((2, 5), stacked=False)]
    groups = plan_chunks(plans, MIB, host_writes=host_writes)
    assert [p.buffer for g in groups for p in g.parts] == [1]
    buffers = allocate_buffers(plans, host_writes=host_writes)
    assert [b.shape for b in buffers] == [(3, 0, 4), (2, 5)]
    values = np.arange(10, dtype=np.float32).reshape(2, 5)
    compiled = compile_chunk_writes(groups)
    fill_chunks(groups, compiled, buffers, lambda j, layer, index: values[index], lambda *_: None)
    np.testing.assert_array_equal(np.asarray(buffers[1], np.float32), values)
