"""Fine-tuning data: a text file or JSONL documents, tokenised and packed into fixed-length rows.

Documents are tokenised with the checkpoint's `tokenizer.json` (through the `tokenizers`
package) when there is one, else as bytes (token id = byte value). They are concatenated, each
followed by the end-of-sequence token, and cut into rows of `seq_len` tokens (the remainder is
dropped), on which the causal-LM loss counts every next token.
"""

import json
import os
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np


class Tokenizer(Protocol):
    """What packing needs from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """Token id = byte value of the UTF-8 text: no vocabulary file needed (ids 0..255)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, read with the `tokenizers` package.

    Its post-processor's special tokens are added (Mistral's adds the begin-of-sequence
    token), as `transformers` does by default.
    """

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:
            raise ImportError(
                "Reading tokenizer.json needs the `tokenizers` package: from the root of the "
                'eqx_lean checkout, `pip install ".[hf]"`, or `pip install tokenizers`.'
            ) from e
        self._tokenizer = _Tokenizer.from_file(os.fspath(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def load_tokenizer(checkpoint: str | os.PathLike, vocab_size: int) -> Tokenizer:
    """The checkpoint's `tokenizer.json` if it has one, else bytes.

    **Arguments:**

    - `checkpoint`: the HF checkpoint directory.
    - `vocab_size`: the model's vocabulary size, which must cover the byte values (256) when
        falling back to bytes.

    **Returns:**

    An [`HFTokenizer`][] or a [`ByteTokenizer`][].
    """
    path = os.path.join(os.fspath(checkpoint), "tokenizer.json")
    if os.path.isfile(path):
        return HFTokenizer(path)
    if vocab_size < 256:
        raise ValueError(
            f"{checkpoint} has no tokenizer.json, so the data would be read as bytes (ids 0..255), "
            f"but the model's vocabulary has only {vocab_size} tokens: it must have at least 256."
        )
    return ByteTokenizer()


def read_documents(path: str | os.PathLike) -> list[str]:
    """The documents of `path`: the lines of a `.jsonl` file (each a JSON object with a string
    `text` field; blank lines are skipped), or the whole of any other file as one document."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        if not path.endswith(".jsonl"):
            return [f.read()]
        documents = []
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {number} must be a JSON object: {e}.") from e
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(
                    f'{path}, line {number} must be a JSON object with a string "text" field; '
                    f"got {line.strip()[:80]!r}."
                )
            documents.append(record["text"])
    return documents


def pack(
    documents: list[str], tokenizer: Tokenizer, seq_len: int, eos_token_id: int | None
) -> np.ndarray:
    """Tokenises `documents`, joins them (each followed by `eos_token_id` unless None) and cuts
    the stream into rows of `seq_len` tokens, dropping the remainder.

    **Returns:**

    An int32 array of shape `[rows, seq_len]`.
    """
    if seq_len < 2:
        raise ValueError(
            f"`seq_len` must be at least 2 (a token and its successor); got {seq_len}."
        )
    stream: list[int] = []
    for document in documents:
        stream.extend(tokenizer.encode(document))
        if eos_token_id is not None:
            stream.append(eos_token_id)
    rows = len(stream) // seq_len
    if rows == 0:
        raise ValueError(
            f"the data must hold at least `seq_len`={seq_len} tokens to fill one row; it holds "
            f"{len(stream)}."
        )
    return np.asarray(stream[: rows * seq_len], np.int32).reshape(rows, seq_len)


def check_ids(rows: np.ndarray, vocab_size: int) -> None:
    """Refuses token ids outside the model's vocabulary (they would index past the embedding)."""
    if rows.size and (rows.min() < 0 or rows.max() >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}) for this model; the data has ids from "
            f"{rows.min()} to {rows.max()}."
        )


def batches(
    rows: np.ndarray, batch_size: int, *, seed: int, start: int = 0
) -> Iterator[np.ndarray]:
    """Endless batches `[batch_size, seq_len]` of the rows, reshuffled at each pass over them.

    **Arguments:**

    - `rows`: the packed rows `[rows, seq_len]`.
    - `batch_size`: rows per batch.
    - `seed`: the shuffles' seed.
    - `start`: the number of batches to skip, so that a resumed run at step `start` reads the
        batches the uninterrupted run would have read (the shuffles are replayed, not the
        rows copied, so skipping costs no more than drawing the permutations).

    **Returns:**

    An iterator of int32 arrays `[batch_size, seq_len]`.
    """
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer; got {batch_size}.")
    if start < 0:
        raise ValueError(f"`start` must be a non-negative integer; got {start}.")
    rng = np.random.default_rng(seed)
    order: list[Any] = []
    index = 0
    while True:
        while len(order) < batch_size:
            order.extend(rng.permutation(len(rows)).tolist())
        take, order = order[:batch_size], order[batch_size:]
        if index >= start:
            yield rows[take]
        index += 1


def load_rows(
    data: str | os.PathLike,
    checkpoint: str | os.PathLike,
    *,
    vocab_size: int,
    eos_token_id: int | None,
    seq_len: int,
) -> np.ndarray:
    """`data` read, tokenised with the checkpoint's tokenizer (or as bytes) and packed."""
    tokenizer = load_tokenizer(checkpoint, vocab_size)
    rows = pack(read_documents(data), tokenizer, seq_len, eos_token_id)
    check_ids(rows, vocab_size)
    return rows
