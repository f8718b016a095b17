"""Layers and losses for any Equinox model whose activations must stay lean: a fused linear +
cross-entropy that never holds `[tokens, vocab]` logits, blockwise attention that never holds
`[heads, seq, seq]` scores, and a position-wise map (an MLP) over chunks of a long sequence."""

from ._attention import attention as attention
from ._cross_entropy import (
    DEFAULT_CHUNK_BYTES as DEFAULT_CHUNK_BYTES,
    linear_cross_entropy as linear_cross_entropy,
)
from ._positionwise import positionwise as positionwise
