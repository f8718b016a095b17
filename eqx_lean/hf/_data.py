"""Fine-tuning data: a text file or JSONL documents, tokenised and packed into fixed-length rows.

Documents are tokenised with the checkpoint's `tokenizer.json` (through the `tokenizers`
package) when there is one, else as bytes (token id = byte value). They are concatenated, each
followed by the end-of-sequence token, and cut into rows of `seq_len` tokens (the remainder is
dropped), on which the causal-LM loss counts every next token. `pack_documents` packs
documents whole instead, with segment ids and positions restarting per document, for a model
that attends within each document.
"""

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

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


class PackedRows(NamedTuple):
    """Documents packed into fixed-length rows: four int32 arrays `[rows, seq_len]`."""

    input_ids: np.ndarray
    """The tokens; `pad_token_id` after a row's last document."""
    labels: np.ndarray
    """HF's unshifted `labels`: the tokens, with `-100` at each document's first token (it is
    not predicted from the document before) and on the padding."""
    segment_ids: np.ndarray
    """Each token's document, numbered from 1 along each row; 0 on the padding."""
    positions: np.ndarray
    """Each token's position in its document (0 at its first token; 0, 1, ... on the
    padding)."""


def pack_documents(
    documents: Sequence[Sequence[int]], seq_len: int, *, pad_token_id: int = 0
) -> PackedRows:
    """Packs tokenised documents into rows of `seq_len` tokens, each document whole in one row
    (in order: a document that does not fit the rest of a row starts the next), for a model
    called with `segment_ids=` and `positions=` (attention within each document, positions
    restarting at each): each document is then computed as if it were alone.

    **Arguments:**

    - `documents`: token ids, one sequence per document (add an end-of-sequence token
        yourself where the model expects one). A document longer than `seq_len` is cut into
        pieces of `seq_len`, each a document of its own.
    - `seq_len`: the row length, at least 2.
    - `pad_token_id`: the token that fills the end of a row.

    **Returns:**

    A [`PackedRows`][eqx_lean.hf.PackedRows] of `input_ids`, `labels`, `segment_ids` and
    `positions`, each int32 `[rows, seq_len]`.

    **Example:**

    ```python
    from eqx_lean.hf import pack_documents

    rows = pack_documents([[5, 6, 7], [8, 9], [10, 11, 12, 13]], 6)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [10, 11, 12, 13, 0, 0]]
    assert rows.segment_ids.tolist() == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]]
    assert rows.positions.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    assert rows.labels.tolist() == [[-100, 6, 7, -100, 9, -100], [-100, 11, 12, 13, -100, -100]]
    ```
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(
            f"`seq_len` must be an integer of at least 2 (a token and its successor); got "
            f"{seq_len!r}."
        )
    pieces: list[list[int]] = []
    for number, document in enumerate(documents):
        tokens = [int(t) for t in document]
        if not tokens:
            raise ValueError(f"`documents[{number}]` is empty: a document needs a token.")
        pieces.extend(tokens[i : i + seq_len] for i in range(0, len(tokens), seq_len))
    rows: list[list[list[int]]] = []
    for piece in pieces:
        if not rows or sum(map(len, rows[-1])) + len(piece) > seq_len:
            rows.append([])
        rows[-1].append(piece)
    shape = (len(rows), seq_len)
    ids = np.full(shape, pad_token_id, np.int32)
    labels = np.full(shape, -100, np.int32)
    segments = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    for r, row in enumerate(rows):
        start = 0
        for number, piece in enumerate(row, start=1):
            end = start + len(piece)
            ids[r, start:end] = piece
            labels[r, start + 1 : end] = piece[1:]
            segments[r, start:end] = number
            positions[r, start:end] = np.arange(len(piece))
            start = end
        positions[r, start:] = np.arange(seq_len - start)
    return PackedRows(ids, labels, segments, positions)


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
