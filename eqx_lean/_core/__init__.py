"""The build engine under `build_stacked`, the loaders, `init.chunked` and `memory.estimate`.

The public functions are built from it. It is not public API and may change between releases;
the repository's tests, benchmarks and example reach what they use of it through
`eqx_lean.internal` (see its `README.md`).

- `layout`: how a layer splits into array leaves and a static part (`Layout`), the checks of
  `keys` and of a stacked module's layer axis, the stacked leaves' structs (`stacked_structs`)
  and write groups; the one home of the struct of a value (`struct_of`, and one layer's:
  `layer_struct`) and of bytes (`struct_bytes`, `shard_bytes`, `tree_bytes`).
- `rules`: what every user rule shares: the path convention (`PATH_CONVENTION`), the error a
  failing user rule or name function is re-raised as (`rule_error`), and `TreeDtypeRule`, the
  base of dtype rules resolved against the whole tree.
- `dtypes`: the dtype policy: one leaf's dtype (`leaf_dtype`, `check_dtype_policy`), the
  ready-made rules of `eqx_lean.dtypes` (by module type, by rank), resolved against the whole
  tree, and the one dtype resolver (`resolve_dtypes`).
- `sharding`: the one sharding resolver (`resolve_shardings`), its validator (`check_spec`)
  and error format, meshes (`current_mesh`, `mesh_of`), the layer axis; `fsdp`; `constrain`,
  the one way to constrain a traced array to a sharding.
- `program`: `make_layer` traced once (`trace_layer`), with a key by content.
- `writes`: allocation, donated row writes, the build plan (`plan_build`), its compiled writes
  (`compile_writes`, cached by content in `WRITES`; `lower_writes` for inspection), run on
  preallocated buffers by `run_writes` (`build_in_trace`: the same writes, traced into an
  outer program).
- `compiled_cache`: compiled programs kept by content (`CompiledCache`, one type for the
  builds' writes, the chunk writes and `init.chunked`'s tile draws, each with its own key recipe;
  `settings_key`, `clear_caches`).
- `chunks`: the loaders' engine: buffers filled from host data in bounded pieces
  (`plan_chunks`, `allocate_buffers`, `compile_chunk_writes`, `fill_chunks`; `lower_chunk_write`
  for inspection), by host writes on CPU or compiled chunk writes elsewhere (`HOST_WRITES`
  switches the first off); `chunk_plan`: the plan's types (`BufferPlan`, `ChunkGroup`, the
  `Reader` and `Releaser` a fill takes); `chunk_writes`: those compiled writes (`shard_map` on
  a mesh).

Platform tricks live in `eqx_lean._platform` (re-exported here: `Tricks`, `lower`), private JAX
in `eqx_lean._compat`.
"""

from .._platform import Tricks as Tricks, lower as lower
from .compiled_cache import (
    CompiledCache as CompiledCache,
    clear_caches as clear_caches,
    settings_key as settings_key,
)
from .dtypes import (
    DtypePolicy as DtypePolicy,
    ForModules as ForModules,
    ForVectors as ForVectors,
    check_dtype_policy as check_dtype_policy,
    for_modules as for_modules,
    for_vectors as for_vectors,
    is_floating as is_floating,
    leaf_dtype as leaf_dtype,
    resolve_dtypes as resolve_dtypes,
)
from .layout import (
    SMALL_GROUP_BYTES as SMALL_GROUP_BYTES,
    Layout as Layout,
    is_array_like as is_array_like,
    layer_struct as layer_struct,
    leaf_groups as leaf_groups,
    num_layers_of_keys as num_layers_of_keys,
    num_layers_of_stack as num_layers_of_stack,
    shard_bytes as shard_bytes,
    stacked_structs as stacked_structs,
    struct_bytes as struct_bytes,
    struct_of as struct_of,
    tree_bytes as tree_bytes,
    zeros_like_struct as zeros_like_struct,
)
from .program import (
    LayerProgram as LayerProgram,
    aval_key as aval_key,
    closed_jaxpr_key as closed_jaxpr_key,
    has_tracers as has_tracers,
    trace_layer as trace_layer,
)
from .sharding import (
    PATH_CONVENTION as PATH_CONVENTION,
    KeyPath as KeyPath,
    LayerAxis as LayerAxis,
    ShardingPolicy as ShardingPolicy,
    TreeDtypeRule as TreeDtypeRule,
    axis_names as axis_names,
    check_layer_axis as check_layer_axis,
    check_spec as check_spec,
    constrain as constrain,
    current_mesh as current_mesh,
    describe_raised as describe_raised,
    fsdp as fsdp,
    has_explicit_axes as has_explicit_axes,
    mesh_of as mesh_of,
    per_layer_sharding as per_layer_sharding,
    resolve_shardings as resolve_shardings,
    rule_error as rule_error,
    stacked_sharding as stacked_sharding,
    stacked_shardings as stacked_shardings,
)
from .writes import (
    WRITES as WRITES,
    BuildPlan as BuildPlan,
    WriteGroup as WriteGroup,
    allocate as allocate,
    as_bits as as_bits,
    build_in_trace as build_in_trace,
    compile_writes as compile_writes,
    delete_arrays as delete_arrays,
    is_traced as is_traced,
    layers_per_call as layers_per_call,
    lower_writes as lower_writes,
    memory_analysis as memory_analysis,
    plan_build as plan_build,
    run_writes as run_writes,
    trace_writes as trace_writes,
    update_rows as update_rows,
    write_layer as write_layer,
    write_temp_bytes as write_temp_bytes,
)
