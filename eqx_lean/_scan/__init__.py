"""The scan engine: `fold` and `scan` over a stack of layers, forward and backward.

- `forward`: `fold` and `scan` themselves, which check their inputs, hoist the closure, pick
  the backward and run the loop.
"""

from .forward import fold as fold, scan as scan
