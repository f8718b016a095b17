"""eqx_lean's internal API: what the repository's tests, benchmarks and example use beyond the
public API. It is not public API and may change without notice; see `README.md` beside this
file for the contract and the list of test seams.

Names are re-exported from the private modules that define them, under their own names, or,
where the private name starts with `_` or would be ambiguous here, under the name given below.
A module object is re-exported only where a test or benchmark patches one of its attributes (a
seam, marked `# Test seam:` where it is defined).
"""

# Every import is a re-export, grouped by concept rather than sorted: ruff's import sorting
# and its unused-import check (which takes `a as b` for a plain import) are off here.
# ruff: noqa: I001, F401

# --- Build engine: plans, compiled writes and their memory (`eqx_lean._core`) ----------------
from .._core import (
    WRITES as WRITES,
    BuildPlan as BuildPlan,
    SMALL_GROUP_BYTES as SMALL_GROUP_BYTES,
    WriteGroup as WriteGroup,
    compile_writes as compile_writes,
    leaf_groups as leaf_groups,
    constrain as constrain,
    build_in_trace as build_in_trace,
    layers_per_call as layers_per_call,
    lower_writes as lower_writes,
    memory_analysis as memory_analysis,
    plan_build as plan_build,
    trace_writes as trace_writes,
    write_temp_bytes as write_temp_bytes,
)
from .._core.writes import _write_slice_donated as write_slice_donated

# --- Structs and bytes of trees (`eqx_lean._core.layout`) ------------------------------------
from .._core import (
    layer_struct as layer_struct,
    shard_bytes as shard_bytes,
    struct_bytes as struct_bytes,
    struct_of as struct_of,
    tree_bytes as tree_bytes,
)

# --- Traced layers and the compiled-program cache (`_core.program`, `_core.compiled_cache`) --
from .._core import CompiledCache as CompiledCache, trace_layer as trace_layer
from .._core.program import (
    EMBED_MAX_BYTES as EMBED_MAX_BYTES,
    _value_key as value_key,
    jaxpr_key as jaxpr_key,
)

# --- Chunked writes of loads (`_core.chunks`, `_core.chunk_plan`, `_core.chunk_writes`) ------
from .._core import chunks as chunks  # seam module: `HOST_WRITES`, `_HOST_PIECE_BYTES`
from .._core.chunk_plan import BufferPlan as BufferPlan
from .._core.chunk_writes import (
    _COMPILED as CHUNK_WRITES,
    ALIGN as CHUNK_ALIGN,
    _call_offsets as call_offsets,
)
from .._core.chunks import (
    allocate_buffers as allocate_buffers,
    compile_chunk_writes as compile_chunk_writes,
    fill_chunks as fill_chunks,
    lower_chunk_write as lower_chunk_write,
    plan_chunks as plan_chunks,
)

# --- Platform tricks (`eqx_lean._platform`) --------------------------------------------------
from .. import _platform as platform_tricks  # seam module: `_malloc_trim`, `platform_of`, ...
from .._platform import (
    ZERO_COPY_ALIGNMENT as ZERO_COPY_ALIGNMENT,
    Tricks as Tricks,
    host_zeros as host_zeros,
    lower as lower,
    release_freed_host_memory as release_freed_host_memory,
)

# --- Checks of scalar arguments and config fields (`eqx_lean._arguments`) -------------------
from .._arguments import (
    boolean as check_boolean,
    integer as check_integer,
    number as check_number,
    optional_integer as check_optional_integer,
)

# --- Private JAX and its fallbacks (`eqx_lean._compat`, `_scan.linear_call`, `_threefry`) ----
from .. import _compat as compat  # seam module: the homes of `shard_alike`, cached probes
from .._compat import (
    can_override_lowering as can_override_lowering,
    private_jax_allowed as private_jax_allowed,
    shard_alike as shard_alike,
    without_private_jax as without_private_jax,
)
from .._scan.linear_call import (
    has_custom_transpose as has_custom_transpose,
    linear_call_with_transpose as linear_call_with_transpose,
)
from .._scan import remat as remat  # seam module: `_made_by_jax`, `_remat3`, `check_remat`
from .._threefry import (
    _threefry2x32_rolled as threefry2x32_rolled,
    threefry2x32_unrolled as threefry2x32_unrolled,
)

# --- `build_stacked`'s calls (`eqx_lean._build`) ---------------------------------------------
from .. import _build as build_calls  # seam module: `_runs`

# --- Products of a linear layer (`eqx_lean._product`) ----------------------------------------
from .._product import (
    _accumulated_product as accumulated_product,
    linear_product as linear_product,
)

# --- Filesystem operations of saves (`eqx_lean._io.fs`) --------------------------------------
# The whole module is the seam: every filesystem operation of a save goes through it, its hooks
# (`HOOKS`, `hooked`) drive the kill sweeps, and `tests/test_fs.py` tests its operations.
from .._io import fs as fs

# --- Checkpoint files: names, formats, saves, loads (`eqx_lean._io`) -------------------------
from .._io import (
    directory as directory,  # seam module: `_lock_occupant`, `_mount_points`
    load as io_load,  # seam module: `_allocate`, `_CHUNK_BYTES`, `_host_slice`, `Maps`
    safetensors as safetensors_format,  # seam module: `_MAX_HEADER_BYTES`
    snapshot as snapshot,  # seam module: `_Opener`
)
from .._io.directory import RELISTS as RELISTS, is_mount_point as is_mount_point
from .._io.names import split_layer as split_layer, stored_layer_count as stored_layer_count
from .._io.safetensors import (
    INDEX_FILE as INDEX_FILE,
    WEIGHTS_FILE as WEIGHTS_FILE,
    index_name as index_name,
)
from .._io.save import ComputedTensor as ComputedTensor
from .._io.snapshot import RETRIES as OPEN_RETRIES

# --- Memory: estimates, plans, targets, tables (`eqx_lean._memory`) --------------------------
from .._memory import (
    estimates as memory_estimates,  # seam module: `_compile_side_by_side`
    plugins as plan_plugins,  # seam module: `_importable`
    targets as memory_targets,  # seam module: `_cuda_plugin_installed`
)
from .._memory.estimates import (
    _eager_dispatches as eager_dispatches,
    _eager_peak as eager_peak,
)
from .._memory.plugins import (
    DEFAULT_NAME as PLAN_PLUGINS_NAME,
    VARIABLE as PLAN_PLUGINS_VARIABLE,
    install_command as plan_plugins_install_command,
    make_visible as make_plan_plugins_visible,
)
from .._memory.cli import main as memory_cli_main
from .._memory.table import format_bytes as format_bytes
from .._memory.targets import _TPUS as TPUS, _topology_devices as topology_devices
from .._memory.training import _fit_one as fit_one

# --- Resident memory of a process (`eqx_lean._rss`) ------------------------------------------
from .. import _rss as rss_reader  # seam module: `_status_text`
from .._rss import (
    MEMORY_FIELDS as MEMORY_FIELDS,
    file_rss_bytes as file_rss_bytes,
    memory_status as memory_status,
    peak_rss_bytes as peak_rss_bytes,
    rss_bytes as rss_bytes,
    rss_high_water_mark as rss_high_water_mark,
    sampled_rss_bytes as sampled_rss_bytes,
    status_kib as status_kib,
)

# --- The persistent compilation cache (`eqx_lean._compilation_cache`) ------------------------
from .._compilation_cache import machine_key as machine_key

# --- Hugging Face layer (`eqx_lean.hf`'s private modules) ------------------------------------
from ..hf import _model as hf_model  # seam module: `_normal_matrix`
from ..hf._adapters import TARGETS as LORA_TARGETS
from ..hf._checkpoint import _hf_name as hf_name
from ..hf._data import (
    ByteTokenizer as ByteTokenizer,
    batches as batches,
    check_ids as check_ids,
    load_tokenizer as load_tokenizer,
    pack as pack,
    read_documents as read_documents,
)
from ..hf._finetune import _abstract_lora_model as abstract_lora_model
from ..hf._generate import _decode_step as jitted_decode_step  # the public one's compiled core
from ..hf._model import RMSNorm as RMSNorm, _mlp_chunk as mlp_chunk
from ..hf._rope import (
    Llama3Rope as Llama3Rope,
    LinearRope as LinearRope,
    YarnRope as YarnRope,
    inverse_frequencies as inverse_frequencies,
)

# --- Lean activations (`eqx_lean.nn`'s private modules) -------------------------------------
from ..nn._positionwise import chunk_positions as chunk_positions

# --- LoRA and PEFT (`eqx_lean.lora`'s private modules) ---------------------------------------
from ..lora._lora import (
    lora_sites as lora_sites,
    module_name as module_name,
    module_names as module_names,
)
from ..lora._merge import _merged_layer as merged_layer
from ..lora._peft import (
    from_peft as from_peft,
    parse_adapter_config as parse_adapter_config,
    to_peft as to_peft,
)
from ..lora._peft_fields import FIELDS as PEFT_FIELDS

# --- Quantisation (`eqx_lean.quant`'s private modules) ---------------------------------------
from ..quant import (
    _load as quant_load,  # seam module: `_CHUNK_VALUES`, `_encode`
    _product as quant_product,  # seam module: `CHUNK_VALUES`
)
from ..quant._array import _bits as float32_bits
from ..quant._codebooks import DYNAMIC8 as DYNAMIC8, NF4 as NF4
from ..quant._dynamic8 import dynamic8_decode as dynamic8_decode, dynamic8_encode as dynamic8_encode
from ..quant._ops import divide_exactly as divide_exactly, widen_exactly as widen_exactly
from ..quant._product import (
    quantized_product as quantized_product,
    rows_per_chunk as rows_per_chunk,
)

# --- The benchmark's models, workers and plot (`eqx_lean.bench`'s private modules) ----------
from ..bench import __main__ as bench_cli  # seam module: `_run_worker`
from ..bench.__main__ import main as bench_main
from ..bench._models import (
    PRESETS as PRESETS,
    Block as Block,
    BlockConfig as BlockConfig,
    _project as project,
    _rms_norm as rms_norm,
    wide_layer as wide_layer,
)
from ..bench._plot import sweep_table as sweep_table, write_plot as write_plot
from ..bench._worker import METHODS as METHODS, cast_floating as cast_floating
