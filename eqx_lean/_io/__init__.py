"""Streaming checkpoint I/O: models with stacked layers to and from safetensors files.

- `names`: tensor-name templates (`TensorName`, `{i}` for the layer index);
- `safetensors`: the file format: headers, indexes, memory maps of open files;
- `snapshot`: a checkpoint opened whole (every file at once, relative to one directory), so
  a load never mixes two saves;
- `checks`: what a checkpoint must hold for a load (layer count, unmapped tensors);
- `load`: `load_stacked`, `load_tensors`, `checkpoint_tensors`;
- `save`: `save_stacked`, `save_tensors`;
- `directory`: a checkpoint directory as one unit (the destinations a save refuses; building
  beside the destination and swapping atomically), with `owned` (what a save owns), `carry`
  (what it carries over or refuses, kept up to date until the swap) and `leftovers` (what saves
  leave beside their destination, their locks, `remove_leftovers`);
- `fs`: every filesystem change of a save, each with a hook before and after (fault injection).
"""

from .leftovers import Leftovers as Leftovers, remove_leftovers as remove_leftovers
from .load import (
    checkpoint_tensors as checkpoint_tensors,
    load_stacked as load_stacked,
    load_tensors as load_tensors,
)
from .names import LAYER as LAYER, TensorName as TensorName
from .save import save_stacked as save_stacked, save_tensors as save_tensors
from .snapshot import (
    Checkpoint as Checkpoint,
    CheckpointReplacedError as CheckpointReplacedError,
    open_checkpoint as open_checkpoint,
)
