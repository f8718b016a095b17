"""The scan engine: `fold` and `scan` over a stack of layers, forward and backward.

- `forward`: `fold` and `scan` themselves, which check their inputs, hoist the closure, pick
  the backward and run the loop.
- `checks`: what `fold` and `scan` check of their inputs before JAX sees them.
- `remat`: the `remat=` option (gradient checkpointing).
- `backward`: the reverse mode that reads layer `i` by index and writes its gradient in place.
- `layer_vjp`: one layer's VJP inside `backward`'s loops: how the step's inputs split, what its
  linearisation saves or recomputes.
- `linear_call`: the primitive through which reverse mode runs `backward` (its custom
  transpose), where private JAX is allowed.
- `public_vjp`: `backward` as a public `jax.custom_vjp`, everywhere else.
- `batching`: which inputs an enclosing `vmap` batches, for the public path's choice.
- `fallback`: the scans JAX differentiates itself, where the custom backward is not used.
- `gather`: ZeRO-3, each layer of a sharded stack gathered just before it runs.
"""

from .forward import fold as fold, scan as scan
