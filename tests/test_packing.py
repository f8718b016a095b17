"""Packed rows (`eqx_lean.hf.pack_documents`, and the decoder's `segment_ids=`/`positions=`)
against transformers run on each document alone: a packed document's logits and loss are its
own, whatever shares its row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_lean import hf


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Documents of several lengths, longer than the window of 4 (so the window matters) and one
# longer than a row (cut into two documents).
LENGTHS = (7, 3, 9, 5, 18)
SEQ_LEN = 16


def hf_mistral():
    config = transformers.MistralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_pack_documents_rows():
    rows = hf.pack_documents([[1] * n for n in LENGTHS], SEQ_LEN, pad_token_id=7)
    # 7 + 3 | 9 + 5 | 16 (a cut) | 2 (its rest)
    assert rows.segment_ids.tolist()[0] == [1] * 7 + [2] * 3 + [0] * 6
    assert rows.segment_ids.tolist()[1] == [1] * 9 + [2] * 5 + [0] * 2
    assert rows.input_ids.shape == (4, SEQ_LEN) and rows.input_ids[0, -1] == 7
    assert rows.positions.tolist()[2] == list(range(16))
    assert rows.positions.tolist()[3][:2] == [0, 1]
    assert (rows.labels[rows.segment_ids == 0] == -100).all()
    with pytest.raises(ValueError, match="`seq_len` must be an integer of at least 2"):
        hf.pack_documents([[1, 2]], 1)
    with pytest.raises(ValueError, match=r"`documents\[1\]` is empty"):
        hf.pack_documents([[1, 2], []], 4)


def test_a_packed_row_equals_transformers_on_each_document_alone(tmp_path):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 96, n).tolist() for n in LENGTHS]
    reference = hf_mistral()
    reference.save_pretrained(tmp_path)
    model = hf.load_hf(tmp_path)
    rows = hf.pack_documents(documents, SEQ_LEN)

    @jax.jit
    def run(model, ids, labels, segments, positions):
        packed = {"segment_ids": segments, "positions": positions}
        logits = {kind: model(ids, attention=kind, **packed) for kind in ("blockwise", "eager")}
        loss = hf.next_token_loss(model, ids, labels=labels, **packed)
        return logits, loss

    logits, loss = run(model, *(jnp.asarray(a) for a in rows))
    # Each document (the last one's two pieces each) through transformers alone.
    pieces = [d[i : i + SEQ_LEN] for d in documents for i in range(0, len(d), SEQ_LEN)]
    losses, counted = [], 0
    where = iter(
        (r, np.flatnonzero(rows.segment_ids[r] == s))
        for r in range(rows.input_ids.shape[0])
        for s in range(1, rows.segment_ids[r].max() + 1)
    )
    for piece in pieces:
        r, columns = next(where)
        assert rows.input_ids[r, columns].tolist() == piece
        with torch.no_grad():
            ids = torch.tensor([piece])
            out = reference(ids, labels=ids)
        expected = out.logits[0].numpy()
        for kind in ("blockwise", "eager"):
            got = np.asarray(logits[kind][r, columns])
            assert np.max(np.abs(got - expected)) <= 1e-4 * np.max(np.abs(expected))
        losses.append(float(out.loss) * (len(piece) - 1))
        counted += len(piece) - 1
    np.testing.assert_allclose(float(loss), sum(losses) / counted, rtol=1e-5)


def test_packed_arguments_are_checked():
    model = jax.eval_shape(lambda: hf.init(hf.DecoderConfig.tiny(), key=jax.random.key(0)))
    ids = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="must be given together"):
        model(ids, segment_ids=ids)
    with pytest.raises(ValueError, match="`positions` must be integers of `input_ids`' shape"):
        model(ids, segment_ids=ids, positions=ids[:, :4])
