"""Memory-lean initialisers for single huge tensors (`eqx_lean.init`)."""

from ._init import chunked as chunked
