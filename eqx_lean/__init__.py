"""Memory-lean construction, scanning and loading of stacked-layer Equinox models."""

from . import dtypes as dtypes, init as init, memory as memory, nn as nn, quant as quant
from ._build import (
    allocate_stacked as allocate_stacked,
    build_stacked as build_stacked,
    layer_at as layer_at,
    stack as stack,
    unstack as unstack,
    write_layer as write_layer,
)
from ._compilation_cache import use_compilation_cache as use_compilation_cache
from ._core import clear_caches as clear_caches, fsdp as fsdp
from ._io import (
    Checkpoint as Checkpoint,
    CheckpointReplacedError as CheckpointReplacedError,
    Leftovers as Leftovers,
    TensorName as TensorName,
    checkpoint_tensors as checkpoint_tensors,
    load_stacked as load_stacked,
    load_tensors as load_tensors,
    open_checkpoint as open_checkpoint,
    remove_leftovers as remove_leftovers,
    save_stacked as save_stacked,
    save_tensors as save_tensors,
)
from ._scan import fold as fold, scan as scan
from ._scan.remat import LAYER_CARRY as LAYER_CARRY, NestedRemat as NestedRemat


__version__ = "0.2.0"
