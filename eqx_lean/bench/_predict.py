"""Predicted peaks of the benchmark's methods, from `eqx_lean.memory.estimate`: nothing is built.

`python -m eqx_lean.bench` refuses a method whose predicted peak exceeds the memory available.
"""

import dataclasses

import jax

from .. import memory
from ._models import Block, BlockConfig, Embeddings


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Byte counts and predicted peaks of the model a benchmark run builds."""

    blocks: memory.MemoryEstimate
    embeddings: memory.MemoryEstimate | None

    @property
    def construction(self) -> int:
        """Every block at the precision its initialisers use."""
        return self.blocks.construction_bytes

    @property
    def final(self) -> int:
        """The result, blocks and embeddings, in the target dtype."""
        return self.blocks.final_bytes + self._embeddings_final

    @property
    def float32_model(self) -> int:
        """The whole model at construction precision: a floor for building it all at once."""
        embeddings = self.embeddings.construction_bytes if self.embeddings else 0
        return self.construction + embeddings

    @property
    def largest_write_temp(self) -> int:
        """XLA's temporaries of `build_stacked`'s largest per-layer write."""
        return max(self.blocks.write_temp_bytes, default=0)

    @property
    def _embeddings_final(self) -> int:
        return self.embeddings.final_bytes if self.embeddings else 0

    def predicted_peak(self, method: str) -> int:
        """Predicted peak resident memory over idle for `method`, in bytes."""
        blocks = {
            "build_stacked": self.blocks.build_stacked_peak,
            "filter_vmap": self.blocks.filter_vmap_peak,
            "filter_jit(filter_vmap)": self.blocks.filter_jit_vmap_peak,
            # `estimate` has no model of a Python list stacked afterwards; measured below eager
            # `filter_vmap` (3.15x against 3.71x on the default preset), which stands in for it.
            "list + jnp.stack": self.blocks.filter_vmap_peak,
        }[method]
        if self.embeddings is None:
            return blocks
        # The worker builds the embeddings first, jitted, then the blocks beside them.
        return max(self.embeddings.filter_jit_vmap_peak, self._embeddings_final + blocks)


def sizes(config: BlockConfig, dtype) -> Sizes:
    key_blocks, key_embed = jax.random.split(jax.random.key(0))
    keys = jax.random.split(key_blocks, config.num_layers)
    blocks = memory.estimate(lambda k: Block(config, key=k), keys, dtype)
    embeddings = None
    if config.vocab:
        # One "layer" of embeddings: its jitted figures are those of building it jitted.
        one = jax.random.split(key_embed, 1)
        embeddings = memory.estimate(lambda k: Embeddings(config, key=k), one, dtype)
    return Sizes(blocks, embeddings)
