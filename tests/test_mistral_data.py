"""The fine-tuning data loader of the Mistral example: text, JSONL, bytes, `tokenizer.json`."""

import json

import numpy as np
import pytest

from eqx_lean.hf import HFTokenizer, load_rows
from eqx_lean.internal import (
    ByteTokenizer,
    batches,
    check_ids,
    load_tokenizer,
    pack,
    read_documents,
)


def write_word_tokenizer(path) -> None:
    """A word-level `tokenizer.json` with a known vocabulary and a `<s>` prefix, as Mistral's
    post-processor adds the begin-of-sequence token."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "again": 5}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    tokenizer.save(str(path))


def test_text_file_is_one_document(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("line one\n\nline {two}\n", encoding="utf-8")
    assert read_documents(path) == ["line one\n\nline {two}\n"]


def test_jsonl_documents(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"text": "first", "id": 1}), "", json.dumps({"text": "sécond\nline"})]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert read_documents(path) == ["first", "sécond\nline"]
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r'line 2 must be a JSON object with a string "text"'):
        read_documents(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1 must be a JSON object"):
        read_documents(path)


def test_bytes_are_token_ids():
    assert ByteTokenizer().encode("Aé\n") == [65, 0xC3, 0xA9, 10]


def test_tokenizer_json_is_used_when_present(tmp_path):
    write_word_tokenizer(tmp_path / "tokenizer.json")
    tokenizer = load_tokenizer(tmp_path, vocab_size=6)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.encode("hello world again hello") == [1, 3, 4, 5, 3]


def test_bytes_fallback_needs_a_256_token_vocabulary(tmp_path):
    assert isinstance(load_tokenizer(tmp_path, vocab_size=256), ByteTokenizer)
    with pytest.raises(ValueError, match="has no tokenizer.json.*at least 256"):
        load_tokenizer(tmp_path, vocab_size=128)


def test_pack_joins_documents_with_eos_and_drops_the_remainder():
    rows = pack(["abc", "de"], ByteTokenizer(), seq_len=3, eos_token_id=2)
    np.testing.assert_array_equal(rows, [[97, 98, 99], [2, 100, 101]])  # the final EOS is cut
    assert rows.dtype == np.int32
    rows = pack(["abc", "de"], ByteTokenizer(), seq_len=2, eos_token_id=None)
    np.testing.assert_array_equal(rows, [[97, 98], [99, 100]])
    with pytest.raises(ValueError, match="at least `seq_len`=16 tokens.*holds 7"):
        pack(["abc", "de"], ByteTokenizer(), seq_len=16, eos_token_id=2)
    with pytest.raises(ValueError, match="`seq_len` must be at least 2"):
        pack(["abc"], ByteTokenizer(), seq_len=1, eos_token_id=None)


def test_load_rows_with_tokenizer_json(tmp_path):
    write_word_tokenizer(tmp_path / "tokenizer.json")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n" + json.dumps({"text": "again"}))
    rows = load_rows(data, tmp_path, vocab_size=6, eos_token_id=2, seq_len=4)
    np.testing.assert_array_equal(rows, [[1, 3, 4, 2]])  # then <s> again </s>: cut
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 4\)"):
        load_rows(data, tmp_path, vocab_size=4, eos_token_id=2, seq_len=4)


def test_check_ids():
    check_ids(np.array([[0, 255]]), 256)
    with pytest.raises(ValueError, match=r"from 0 to 256"):
        check_ids(np.array([[0, 256]]), 256)


def test_batches_cover_every_row_each_pass():
    rows = np.arange(10, dtype=np.int32)[:, None] * np.ones((1, 3), np.int32)
    stream = batches(rows, batch_size=4, seed=0)
    seen = np.concatenate([next(stream)[:, 0] for _ in range(5)])  # two passes
    assert sorted(seen[:10].tolist()) == list(range(10))
    assert sorted(seen[10:20].tolist()) == list(range(10))
    assert next(batches(rows, batch_size=25, seed=1)).shape == (25, 3)  # more than one pass
    with pytest.raises(ValueError, match="`batch_size` must be a positive integer"):
        next(batches(rows, batch_size=0, seed=0))
