"""Memory-lean construction, scanning and loading of stacked-layer Equinox models."""

from ._build import (
    allocate_stacked as allocate_stacked,
    build_stacked as build_stacked,
    layer_at as layer_at,
    stack as stack,
    unstack as unstack,
)
from ._scan import fold as fold, NestedRemat as NestedRemat, scan as scan


__version__ = "0.1.0"
