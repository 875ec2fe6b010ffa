"""The stream: exact coverage over ranks x workers, determinism, exact resume, mixtures,
the validation split, and what a state may be loaded into."""

import io
import itertools
import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from corpora import (
    fineweb_rows,
    read_documents,
    source,
    split_after_eos,
    take,
    worker_tokens,
    write_fineweb,
    write_openwebtext_jsonl,
)

from data_pipeline.build import build_train_data, build_validation_data
from data_pipeline.config import DataConfig
from data_pipeline.documents import split_of
from data_pipeline.loader import SNAPSHOT_EVERY
from data_pipeline.stream import MixedWindows, StreamSettings

CPU = torch.device("cpu")


def encoded(tokenizer, texts) -> Counter:
    return Counter(tuple(ids) for ids in tokenizer.encode_batch(list(texts), add_eos=True))


@pytest.mark.parametrize("layout", ["9 row groups", "1 jsonl file"])
def test_every_token_exactly_once_across_2_ranks_x_2_workers(
    tmp_path, fineweb, embedded_tokenizer, layout
):
    root, rows = fineweb
    if layout == "9 row groups":  # more shards than streams: row groups are dealt out
        src = source(f"hf:{root}:sample-10BT", id_column="id")
    else:  # fewer shards than streams: every stream reads the file, keeps every 4th row
        write_openwebtext_jsonl(tmp_path / "one.jsonl", [json.dumps(r).encode() for r in rows])
        src = source(str(tmp_path / "one.jsonl"), id_column="id")
    window = 33
    settings = StreamSettings(window, split="train", validation_fraction=0.1, seed=7, epochs=1)
    streams = []
    for rank in range(2):
        dataset = MixedWindows([src], [1.0], embedded_tokenizer, settings, rank, world_size=2)
        streams += worker_tokens(dataset, num_workers=2)
    assert len(streams) == 4 and all(streams)

    train = [r["text"] for r in rows if split_of(r["id"], 0.1) == "train"]
    expected = encoded(embedded_tokenizer, train)
    assert 90 < len(train) < len(rows)
    seen, partial = Counter(), []
    for tokens in streams:
        assert len(tokens) % window == 0
        complete, rest = split_after_eos(tokens)
        seen.update(complete)
        partial.append(rest)
    assert not seen - expected, "a window holds something twice or not from a document"
    for rest in partial:  # a stream's last emitted document is a prefix of an unseen one
        assert any(doc[: len(rest)] == tuple(rest) for doc in expected - seen)
    emitted = sum(len(t) for t in streams)
    missing = sum(len(doc) * n for doc, n in expected.items()) - emitted
    assert 0 <= missing < len(streams) * window  # only each stream's final partial window


def test_same_seed_same_stream_other_seed_other_order(fineweb, embedded_tokenizer):
    root, _ = fineweb
    src = source(f"hf:{root}:sample-10BT", id_column="id")

    def first(seed):
        dataset = MixedWindows([src], [1.0], embedded_tokenizer, StreamSettings(33, seed=seed))
        return [w.tolist() for w in itertools.islice(dataset, 60)]

    assert first(1) == first(1)
    assert first(1) != first(2)


@pytest.mark.parametrize("stop", [2, 9, 31])
def test_resume_gives_exactly_the_batches_of_an_uninterrupted_run(
    tmp_path, embedded_tokenizer, stop
):
    # 12 files of 4 short documents (~10 windows each): every stop and continuation crosses
    # file boundaries; 60 batches of 4 windows also cross the end of an epoch (~30 batches).
    write_fineweb(tmp_path, files=12, rows_per_file=4, row_group_size=4, chars=300)
    data = DataConfig(
        sources=[{"uri": f"{tmp_path}/sample/10BT/*.parquet", "id_column": "id"}],
        num_workers=2,
        validation_fraction=0.1,
        seed=5,
    )

    def build():
        return build_train_data(data, embedded_tokenizer, 32, 4, dp_rank=0, dp_size=1, device=CPU)

    reference = take(build(), 60)
    first = build()
    assert take(first, stop) == reference[:stop]
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)  # as a checkpoint would
    del first
    resumed = build()
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert take(resumed, 60 - stop) == reference[stop:]
    assert len({str(b) for b in reference}) == 60  # no batch repeats: the test can fail


def test_resume_without_workers(fineweb, embedded_tokenizer):
    root, _ = fineweb
    data = DataConfig(sources=[f"hf:{root}:sample-10BT"], num_workers=0)
    first = build_train_data(data, embedded_tokenizer, 32, 3, 0, 1, CPU)
    reference = take(first, 25)
    first = build_train_data(data, embedded_tokenizer, 32, 3, 0, 1, CPU)
    take(first, 11)
    resumed = build_train_data(data, embedded_tokenizer, 32, 3, 0, 1, CPU)
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 14) == reference[11:]


def test_batches_are_tokens_and_shifted_labels(fineweb, embedded_tokenizer):
    root, _ = fineweb
    data = DataConfig(sources=[f"hf:{root}:sample-10BT"], num_workers=1)
    tokens, labels = next(build_train_data(data, embedded_tokenizer, 32, 3, 0, 1, CPU))
    assert tokens.shape == labels.shape == (3, 32)
    assert tokens.dtype == labels.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], labels[:, :-1])


def test_mixture_draws_windows_in_proportion_to_the_weights(tmp_path, fineweb, embedded_tokenizer):
    """Source B is Greek (the tokenizer has only byte pieces for it): a window made mostly
    of byte tokens (ids 4..259) came from B. Expected share 1/4; tolerance ±0.03 (about 3
    binomial standard deviations at 2,000 windows)."""
    root, _ = fineweb
    rng = np.random.default_rng(0)
    greek = [
        " ".join("".join(chr(0x3B1 + k) for k in rng.integers(0, 24, 5)) for _ in range(60))
        for _ in range(50)
    ]
    write_openwebtext_jsonl(tmp_path / "b.jsonl", [json.dumps({"text": t}).encode() for t in greek])
    a, b = source(f"hf:{root}:sample-10BT"), source(str(tmp_path / "b.jsonl"))
    dataset = MixedWindows([a, b], [3.0, 1.0], embedded_tokenizer, StreamSettings(33, seed=1))
    windows = [w.numpy() for w in itertools.islice(dataset, 2000)]
    byte_share = [np.mean((w >= 4) & (w < 260)) for w in windows]
    assert all(s < 0.4 or s > 0.8 for s in byte_share)  # every window is from one source
    share_b = np.mean([s > 0.8 for s in byte_share])
    assert abs(share_b - 0.25) < 0.03, share_b


def test_validation_is_fixed_and_disjoint_from_training(fineweb, embedded_tokenizer):
    root, rows = fineweb
    data = DataConfig(sources=[f"hf:{root}:sample-10BT"], validation_fraction=0.25, num_workers=0)
    src = source(f"hf:{root}:sample-10BT")
    val_docs, _ = read_documents(src, split="validation", validation_fraction=0.25)
    train_docs, _ = read_documents(src, split="train", validation_fraction=0.25)
    assert {d.id for d in val_docs}.isdisjoint(d.id for d in train_docs)
    assert len(val_docs) + len(train_docs) == len(rows) and len(val_docs) > 15

    batches = take(build_validation_data(data, embedded_tokenizer, 32, 2, 0, 1, CPU, 40), 40)
    assert len(batches) == 40
    assert batches == take(
        build_validation_data(data, embedded_tokenizer, 32, 2, 0, 1, CPU, 40), 40
    )
    tokens = [t for batch in batches for row in batch for t in row]
    complete, _ = split_after_eos(tokens)
    assert len(complete) > 5
    assert not Counter(complete) - encoded(embedded_tokenizer, (d.text for d in val_docs))
    assert not set(complete) & set(encoded(embedded_tokenizer, (d.text for d in train_docs)))
    assert (
        build_validation_data(
            data.model_copy(update={"validation_fraction": 0}),
            embedded_tokenizer,
            32,
            2,
            0,
            1,
            CPU,
            5,
        )
        == []
    )


def test_a_state_loads_only_into_the_same_layout(fineweb, embedded_tokenizer):
    root, _ = fineweb
    data = DataConfig(sources=[f"hf:{root}:sample-10BT"], num_workers=0)
    saved = build_train_data(data, embedded_tokenizer, 32, 2, 0, 2, CPU)
    next(saved)
    state = saved.state_dict()
    for key, build in {
        "dp_size": lambda: build_train_data(data, embedded_tokenizer, 32, 2, 0, 1, CPU),
        "dp_rank": lambda: build_train_data(data, embedded_tokenizer, 32, 2, 1, 2, CPU),
        "seq_len": lambda: build_train_data(data, embedded_tokenizer, 64, 2, 0, 2, CPU),
        "num_workers": lambda: build_train_data(
            data.model_copy(update={"num_workers": 2}), embedded_tokenizer, 32, 2, 0, 2, CPU
        ),
    }.items():
        with pytest.raises(ValueError, match=f"data state was saved with {key}=.* this run has"):
            build().load_state_dict(state)
    pq.write_table(pa.Table.from_pylist(fineweb_rows(3)), root / "sample" / "10BT" / "new.parquet")
    with pytest.raises(ValueError, match=r"saved with source_sizes=\[9\], this run has .*\[10\]"):
        build_train_data(data, embedded_tokenizer, 32, 2, 0, 2, CPU).load_state_dict(state)


def test_stats_count_rows_documents_skips_and_tokens(tmp_path, embedded_tokenizer):
    rows = [json.dumps(r).encode() for r in fineweb_rows(60)]
    rows[5] = b"{broken"
    write_openwebtext_jsonl(tmp_path / "x.jsonl", rows)
    data = DataConfig(sources=[str(tmp_path / "x.jsonl")], num_workers=2, validation_fraction=0)
    batches = build_train_data(data, embedded_tokenizer, 32, 2, 0, 1, CPU)
    for _ in range(2 * SNAPSHOT_EVERY + 1):
        next(batches)
    stats = batches.stats()  # as of the snapshot after batch 2 x SNAPSHOT_EVERY
    assert stats["rows"] >= stats["documents"] > 0
    assert stats["tokens"] >= 2 * SNAPSHOT_EVERY * 2 * 33
    assert stats["skipped"] == stats["corrupt"] == 1  # in one worker's share of the rows
