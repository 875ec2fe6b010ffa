"""The offline path: prepare into megatron's indexed format, read back with GPTDataset."""

import itertools
import json

import pytest
import torch
from corpora import NEVER, read_documents, source, write_openwebtext_jsonl
from megatron.core.datasets.indexed_dataset import IndexedDataset
from ranks import Ranks, resumed

from data_pipeline.build import build_tokenizer, build_train_data
from data_pipeline.config import DataConfig
from data_pipeline.documents import split_of
from data_pipeline.prepared import prepare
from data_pipeline.tokenizer import train_tokenizer

CPU = torch.device("cpu")


@pytest.fixture
def prepared(tmp_path, fineweb, embedded_tokenizer):
    src = source(f"hf:{fineweb[0]}:sample-10BT", id_column="id")
    out = tmp_path / "prepared"
    meta = prepare(src, embedded_tokenizer, out, validation_fraction=0.2, workers=2, progress=False)
    return out, src, meta


def test_prepare_writes_every_document_once_in_its_split(prepared, embedded_tokenizer):
    out, src, meta = prepared
    docs, _ = read_documents(src)
    for split in ("train", "validation"):
        texts = [d.text for d in docs if split_of(d.id, 0.2) == split]
        indexed = IndexedDataset(str(out / split))
        assert len(indexed) == len(texts) == meta[f"{split}_documents"] > 0
        expected = embedded_tokenizer.encode_batch(texts, add_eos=True)
        assert [indexed[i].tolist() for i in range(len(indexed))] == expected  # reading order
        assert sum(map(len, expected)) == meta[f"{split}_tokens"]
    assert (out / "tokenizer.model").read_bytes() == embedded_tokenizer.path.read_bytes()


def test_prepared_samples_are_shuffled_and_each_read_once_per_epoch(prepared, embedded_tokenizer):
    """8 readers over 2 data-parallel ranks: one epoch's windows are megatron's samples,
    each once, whatever the layout; each window's pieces name the documents and tokens it
    holds."""
    out, _, meta = prepared
    data = DataConfig(sources=[f"prepared:{out}"], num_workers=0, seed=4)
    ranks = Ranks(2)
    datas = ranks.build(data, embedded_tokenizer, 32, global_batch=8, micro=2)
    epoch = ranks.epoch(datas)  # (its last steps hold epoch 1's first samples)
    windows = [
        tuple(w)
        for step, origins in zip(epoch, ranks.origins, strict=True)
        for w, origin in zip(step, origins, strict=True)
        if w and origin[1] == 0
    ]
    documents = IndexedDataset(str(out / "train"))
    for step, origins in zip(epoch, ranks.origins, strict=True):
        for window, origin in zip(step, origins, strict=True):
            pieces = [documents[d][first : first + n].tolist() for (*_, d), first, n in origin[5]]
            assert list(itertools.chain(*pieces)) == window
    prepared_source = source(f"prepared:{out}")
    prepared_source.open(datas[0].settings)
    gpt = prepared_source.samples("train")  # megatron's GPTDataset, built by open()
    assert len(gpt) == (meta["train_tokens"] - 1) // 32  # samples overlap by one token
    samples = [
        tuple(gpt[i]["tokens"].tolist() + gpt[i]["labels"][-1:].tolist()) for i in range(len(gpt))
    ]
    assert sorted(windows) == sorted(samples)
    assert sorted(gpt.document_index) == list(range(meta["train_documents"]))
    assert list(gpt.document_index) != sorted(gpt.document_index)  # documents shuffled
    assert list(gpt.shuffle_index) != sorted(gpt.shuffle_index)  # and samples


def test_training_blends_prepared_and_streaming_sources_and_resumes(
    tmp_path, prepared, embedded_tokenizer
):
    out, _, _ = prepared
    write_openwebtext_jsonl(
        tmp_path / "b.jsonl", [json.dumps({"text": f"word {i} " * 40}).encode() for i in range(80)]
    )
    data = DataConfig(
        sources=[f"prepared:{out}", {"uri": str(tmp_path / "b.jsonl"), "weight": 0.5}],
        num_workers=2,
    )
    assert build_tokenizer(data, "/nonexistent").path == out / "tokenizer.model"

    def build(ranks, workers):
        update = {"num_workers": workers}
        return ranks.build(data.model_copy(update=update), embedded_tokenizer, 32, 8, 2)

    single = Ranks(1)
    reference = single.steps(build(single, 2), 40)
    two = Ranks(2)
    first = build(two, 0)
    assert two.steps(first, 13) == reference[:13]
    state = first[1].state_dict()
    without_workers = data.model_copy(update={"num_workers": 0})
    assert resumed(4, state, 27, without_workers, embedded_tokenizer, 32, 8, 2) == reference[13:]
    counts = first[0].stats()
    assert counts["data/0/samples"] > 0 and counts["data/1/documents"] > 0


def test_a_prepared_state_continues_at_another_data_parallel_size_across_epochs(
    prepared, embedded_tokenizer
):
    """Prepared data alone, 8 readers: 2 ranks stopped in the step before the next epoch's
    samples are dealt, then 1 rank and 4 ranks from the saved state give exactly the
    global batches of an uninterrupted single rank, into the next epoch (reshuffled)."""
    out, _, _ = prepared
    data = DataConfig(sources=[f"prepared:{out}"], num_workers=0, seed=4)
    single = Ranks(1)
    datas = single.build(data, embedded_tokenizer, 32, global_batch=8, micro=2)
    reference = []
    while datas[0].schedule.deals[0].epoch == 0:
        assert len(reference) < NEVER
        reference += single.steps(datas, 1)
    stop = len(reference) - 1
    reference += single.steps(datas, 5)
    two = Ranks(2)
    first = two.build(data, embedded_tokenizer, 32, global_batch=8, micro=2)
    assert two.steps(first, stop) == reference[:stop]
    state = first[0].state_dict()
    assert state["schedule"]["sources"][0]["epoch"] == 0
    for n in (1, 4):
        continued = resumed(n, state, 6, data, embedded_tokenizer, 32, 8, 2)
        assert continued == reference[stop:], f"continued on {n} rank(s)"


def test_prepared_data_refuses_another_tokenizer(tmp_path, prepared, embedded_tokenizer):
    out, _, _ = prepared
    other = train_tokenizer(
        itertools.repeat("some other text entirely", 50), 300, tmp_path / "o.model"
    )
    data = DataConfig(sources=[f"prepared:{out}"], num_workers=0)
    with pytest.raises(
        ValueError, match=r"was tokenized with .*tokenizer\.model, not with .*o\.model"
    ):
        build_train_data(data, other, 32, 4, 4, 0, 1, CPU)
