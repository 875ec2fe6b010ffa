import itertools

import numpy as np
import pytest

from data_pipeline.documents import Document, split_of
from data_pipeline.stream import PackedWindows


def corpus(n=60):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "the", "of", "model"]
    return [Document(f"doc{i}", " ".join(rng.choice(words, rng.integers(3, 40)))) for i in range(n)]


def tokens_of(stream):
    return [t for w in stream for t in w.tolist()]


def test_ranks_share_out_documents_without_loss_or_duplication(embedded_tokenizer):
    docs = corpus()
    per_rank = [
        tokens_of(PackedWindows(docs, embedded_tokenizer, 15, rank=r, world_size=3, repeat=False))
        for r in range(3)
    ]
    union = sorted(itertools.chain(*per_rank))
    everything = [t for d in docs for t in [*embedded_tokenizer.encode(d.text), 2]]
    # all tokens except each rank's final partial window (< 16 tokens)
    assert len(everything) - len(union) < 3 * 16
    missing = sorted(everything)
    for t in union:
        missing.remove(t)  # raises if a token appears more often than in the corpus


def test_validation_split_is_disjoint_and_stable(embedded_tokenizer):
    docs = corpus(400)
    train = PackedWindows(docs, embedded_tokenizer, 15, split="train", validation_fraction=0.1)
    val = PackedWindows(docs, embedded_tokenizer, 15, split="validation", validation_fraction=0.1)
    assert {d.id for d in train.documents}.isdisjoint(d.id for d in val.documents)
    assert len(train.documents) + len(val.documents) == 400
    assert 20 <= len(val.documents) <= 60
    assert [split_of(d.id, 0.1) for d in val.documents] == ["validation"] * len(val.documents)
    with pytest.raises(ValueError, match="no validation documents"):
        PackedWindows(docs, embedded_tokenizer, 15, split="validation", validation_fraction=0.0)


def test_resume_from_state_dict_continues_exactly(embedded_tokenizer):
    docs = corpus()
    reference = PackedWindows(docs, embedded_tokenizer, 15, seed=5)
    expected = [w.tolist() for w in itertools.islice(iter(reference), 200)]  # several epochs
    first = PackedWindows(docs, embedded_tokenizer, 15, seed=5)
    it = iter(first)
    got = [next(it).tolist() for _ in range(77)]
    state = first.state_dict()
    resumed = PackedWindows(docs, embedded_tokenizer, 15, seed=5)
    resumed.load_state_dict(state)
    got += [w.tolist() for w in itertools.islice(iter(resumed), 123)]
    assert got == expected


def test_epochs_are_reshuffled(embedded_tokenizer):
    docs = corpus()
    stream = PackedWindows(docs, embedded_tokenizer, 15, seed=1)
    assert list(stream._order(0)) != list(stream._order(1))
    assert sorted(stream._order(0)) == sorted(stream._order(1)) == list(range(len(docs)))
