"""A simple peak-memory predictor from `eval_shape` byte counts, to refuse runs that cannot fit.

The coefficients are conservative fits to measurements on the default configuration (see
`docs/benchmarks.md`); they only need to tell "fits" from "would be killed".
"""

import dataclasses

import equinox as eqx
import jax
import numpy as np

from ._models import Block, BlockConfig, Embeddings


COMPILE_OVERHEAD = 128 * 2**20


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Byte counts of the model a benchmark run builds."""

    construction: int  # every layer at the precision its initialisers use
    final: int  # the result, in the target dtype
    largest_leaf: int  # the largest leaf of one layer, at construction precision
    embeddings_construction: int

    @property
    def float32_model(self) -> int:
        """The whole model at construction precision: a floor for building it all at once."""
        return self.construction + self.embeddings_construction

    def predicted_peak(self, method: str) -> int:
        """Predicted peak resident memory over idle for `method`, in bytes."""
        # Threefry draws take about 4x their output in temporaries (bits, then floats).
        embeddings = self.embeddings_construction * 4
        if method == "build_stacked":
            stack = self.final + 4 * self.largest_leaf + COMPILE_OVERHEAD
            return max(stack, embeddings)
        factor = {
            "filter_vmap": 2.0,
            "filter_jit(filter_vmap)": 3.25,
            "list + jnp.stack": 1.75,
        }[method]
        return int(factor * self.construction) + embeddings + COMPILE_OVERHEAD


def _nbytes(struct: jax.ShapeDtypeStruct, dtype=None) -> int:
    return int(np.prod(struct.shape)) * np.dtype(dtype or struct.dtype).itemsize


def _structs(tree) -> list[jax.ShapeDtypeStruct]:
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.ShapeDtypeStruct)]


def sizes(config: BlockConfig, dtype) -> Sizes:
    key = jax.random.key(0)
    leaves = _structs(eqx.filter_eval_shape(Block, config, key=key))
    embeddings = 0
    final_embeddings = 0
    if config.vocab:
        table_leaves = _structs(eqx.filter_eval_shape(Embeddings, config, key=key))
        embeddings = sum(_nbytes(x) for x in table_leaves)
        final_embeddings = sum(_nbytes(x, dtype) for x in table_leaves)
    return Sizes(
        construction=config.num_layers * sum(_nbytes(x) for x in leaves),
        final=config.num_layers * sum(_nbytes(x, dtype) for x in leaves) + final_embeddings,
        largest_leaf=max(_nbytes(x) for x in leaves),
        embeddings_construction=embeddings,
    )
