import pickle
import re
import shutil

import pytest

from data_pipeline import tokenizer as tk
from data_pipeline.build import build_tokenizer
from data_pipeline.config import DataConfig
from data_pipeline.embedded import embedded_documents


def test_round_trip_and_special_ids(embedded_tokenizer):
    tok = embedded_tokenizer
    assert tok.vocab_size == 4096
    assert (tok.sp.unk_id(), tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, 3)
    docs = embedded_documents()[:300]
    ids = tok.encode_batch([d.text for d in docs])
    assert all(tok.decode(i) == d.text for i, d in zip(ids, docs, strict=True))
    odd = "  indented\n\ttab, émigré, 東京, emoji 🙂, \x00 nul"
    assert tok.decode(tok.encode(odd)) == odd  # byte fallback: nothing is unknown
    assert tok.sp.unk_id() not in tok.encode(odd)


def test_cache_trains_once(cache_dir, embedded_tokenizer, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(tk, "train_tokenizer", fail)
    assert build_tokenizer(DataConfig(), cache_dir).path == embedded_tokenizer.path
    with pytest.raises(AssertionError, match="retrained"):  # another sample, another model
        build_tokenizer(DataConfig(validation_fraction=0.5), cache_dir)


def test_a_resumed_run_goes_on_with_its_checkpoints_tokenizer(
    tmp_path, embedded_tokenizer, monkeypatch
):
    """The model a checkpoint holds is the run's tokenizer on resume, whatever the cache
    holds (here an empty one: another node's, or keyed by another sentencepiece); a
    configured tokenizer must be that model; a checkpoint without one: as a new run."""

    def fail(*a, **k):
        raise AssertionError("trained a tokenizer")

    monkeypatch.setattr(tk, "train_tokenizer", fail)
    saved = tmp_path / "step_000004/tokenizer.model"
    saved.parent.mkdir()
    saved.write_bytes(embedded_tokenizer.path.read_bytes())
    empty_cache = tmp_path / "cache"
    resumed = build_tokenizer(DataConfig(), empty_cache, saved)
    assert resumed.sha256 == embedded_tokenizer.sha256 and resumed.path.parent.parent == empty_cache
    assert build_tokenizer(DataConfig(), empty_cache, saved).path == resumed.path
    same = DataConfig(tokenizer={"path": str(embedded_tokenizer.path)})
    assert build_tokenizer(same, empty_cache, saved).path == embedded_tokenizer.path
    other = tmp_path / "other.model"
    model = saved.read_bytes()
    other.write_bytes(model[:-1] + bytes([model[-1] ^ 1]))  # another model file
    with pytest.raises(ValueError, match=r"data\.tokenizer\.path: .*other\.model is not the "
                       r"tokenizer the checkpoint was trained with"):  # fmt: skip
        build_tokenizer(DataConfig(tokenizer={"path": str(other)}), empty_cache, saved)
    with pytest.raises(AssertionError, match="trained a tokenizer"):
        build_tokenizer(DataConfig(), empty_cache, tmp_path / "none/tokenizer.model")
    # the checkpoint deleted (the run's rotation): the run still saves the model into new
    # checkpoints, and its loader workers load it by path
    shutil.rmtree(saved.parent)
    assert resumed.path.read_bytes() == embedded_tokenizer.path.read_bytes()
    assert pickle.loads(pickle.dumps(resumed)).encode("text") == embedded_tokenizer.encode("text")


def test_tokenizer_survives_pickling(embedded_tokenizer):
    """DataLoader workers started by spawn receive the tokenizer pickled."""
    again = pickle.loads(pickle.dumps(embedded_tokenizer))
    assert again.path == embedded_tokenizer.path
    assert again.encode("pickled text") == embedded_tokenizer.encode("pickled text")


def test_training_pieces_fit_sentencepiece():
    long_line = "word " * 3000
    text = f"short paragraph\n\n{long_line}\nnext line\n\n\n\n"
    pieces = list(tk.training_pieces([text]))
    assert pieces[0] == "short paragraph"
    assert all(0 < len(p.encode()) <= tk.MAX_PIECE_INPUT_BYTES for p in pieces)
    assert "".join(pieces[1:-1]) == long_line


def test_bad_model_file(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"cannot load sentencepiece model .*bad\.model"):
        tk.Tokenizer(bad)


def test_a_vocabulary_larger_than_the_text_allows_names_the_key_and_the_limit(tmp_path):
    texts = ["a small corpus of a few words, said twice.", "a few words said twice."]
    with pytest.raises(ValueError) as err:
        tk.train_tokenizer(texts, 4096, tmp_path / "t.model")
    assert re.fullmatch(
        r"data\.tokenizer\.vocab_size: 4096 pieces cannot be learned from this text "
        r"\(at most \d+\): set a smaller vocab_size, or train on more text",
        str(err.value),
    )
    assert not (tmp_path / "t.model").exists()
