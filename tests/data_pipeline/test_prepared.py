"""The offline path: prepare into megatron's indexed format, read back with GPTDataset."""

import itertools
import json

import pytest
import torch
from corpora import read_documents, source, take, worker_tokens, write_openwebtext_jsonl
from megatron.core.datasets.indexed_dataset import IndexedDataset

from data_pipeline.build import build_tokenizer, build_train_data
from data_pipeline.config import DataConfig
from data_pipeline.documents import split_of
from data_pipeline.prepared import prepare
from data_pipeline.stream import MixedWindows, StreamSettings
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


def test_prepared_samples_are_shuffled_and_each_read_once_by_2x2_streams(
    prepared, embedded_tokenizer
):
    out, _, meta = prepared
    prepared_source = source(f"prepared:{out}")
    settings = StreamSettings(33, split="train", seed=4, epochs=1)
    streams = []
    for rank in range(2):
        dataset = MixedWindows([prepared_source], [1.0], None, settings, rank, world_size=2)
        streams += worker_tokens(dataset, num_workers=2)
    windows = [tuple(s[i : i + 33]) for s in streams for i in range(0, len(s), 33)]
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

    def build():
        return build_train_data(data, embedded_tokenizer, 32, 4, 0, 1, CPU)

    reference = take(build(), 40)
    first = build()
    take(first, 13)
    resumed = build()
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 27) == reference[13:]
    counts = resumed.stats()
    assert counts["documents"] > 0 and counts["tokens"] > 0


def test_prepared_data_refuses_another_tokenizer(tmp_path, prepared, embedded_tokenizer):
    out, _, _ = prepared
    other = train_tokenizer(
        itertools.repeat("some other text entirely", 50), 300, tmp_path / "o.model"
    )
    data = DataConfig(sources=[f"prepared:{out}"], num_workers=0)
    with pytest.raises(
        ValueError, match=r"was tokenized with .*tokenizer\.model, not with .*o\.model"
    ):
        build_train_data(data, other, 32, 4, 0, 1, CPU)
