"""The training stream: global epochs (every document once, whatever the row groups),
positions that continue exactly at any data-parallel size and worker count, mixtures,
padding, the validation split, and what a state may be loaded into."""

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from corpora import (
    EOS,
    fineweb_rows,
    one_row_group_files,
    read_documents,
    source,
    split_after_eos,
    step_windows,
    take,
    write_fineweb,
    write_openwebtext_jsonl,
)
from ranks import Ranks, resumed

from data_pipeline.build import build_train_data, build_validation_data
from data_pipeline.config import DataConfig
from data_pipeline.documents import split_of
from data_pipeline.loader import merge_states
from data_pipeline.stream import epoch_shares, slot_source

CPU = torch.device("cpu")
SEQ = 32


def expected_documents(tokenizer, rows, fraction) -> Counter:
    train = [r["text"] for r in rows if split_of(r["id"], fraction) == "train"]
    return Counter(tuple(ids) for ids in tokenizer.encode_batch(train, add_eos=True))


def reader_windows(global_batches: list, readers: int, per_reader: int) -> list[list]:
    """Each logical reader's windows in order (slots are reader-major within a step)."""
    out = [[] for _ in range(readers)]
    for batch in global_batches:
        for r in range(readers):
            out[r] += batch[r * per_reader : (r + 1) * per_reader]
    return out


def delivered(global_batches: list, readers: int) -> Counter:
    """Every reader's complete documents; each reader's windows end at a document's end."""
    documents = Counter()
    for windows in reader_windows(global_batches, readers, 1):
        complete, rest = split_after_eos([t for w in windows for t in w])
        assert rest == []  # only a reader's final window of an epoch may be short
        documents.update(complete)
    return documents


def test_one_epoch_delivers_every_document_once_whatever_the_row_groups(
    tmp_path, embedded_tokenizer
):
    """Row groups of 1, 7, 256 and 1000 rows, 8 readers over 2 data-parallel ranks with 2
    loader workers each (as training builds them): the windows up to the global epoch
    boundary hold every training document exactly once; the next epoch then delivers them
    all again."""
    rows = one_row_group_files(tmp_path / "unequal", (1, 7, 256, 1000), chars=80)
    data = DataConfig(
        sources=[{"uri": f"{tmp_path}/unequal/*.parquet", "id_column": "id"}],
        validation_fraction=0.1, num_workers=2, seed=3,
    )  # fmt: skip
    ranks = Ranks(2)
    datas = ranks.build(data, embedded_tokenizer, SEQ, global_batch=8, micro=2)
    assert [d.num_workers for d in datas] == [2, 2]  # 2 readers in each worker
    expected = expected_documents(embedded_tokenizer, rows, 0.1)
    assert len(expected) > 1000
    epoch0 = ranks.epoch(datas)
    assert delivered(epoch0, 8) == expected  # every training document, each exactly once
    stats = datas[0].stats()
    assert stats["data/0/held_out"] + stats["data/0/documents"] == stats["data/0/rows"] == len(rows)
    padding = sum(not w for batch in epoch0 for w in batch)
    assert padding < 0.1 * 8 * len(epoch0), padding  # shares are balanced by size
    assert delivered(ranks.epoch(datas), 8) == expected
    for d in datas:
        d.close()


def test_shares_are_balanced_by_size_and_cover_every_unit():
    from data_pipeline.sources import Unit

    units = [Unit(0, g, 0, n, n) for g, n in enumerate([1, 7, 256, 1000, 30, 30, 31])]
    for epoch in range(3):
        shares = epoch_shares(units, 4, seed=5, epoch=epoch)
        assert sorted(i for share in shares for i in share) == list(range(len(units)))
    assert epoch_shares(units, 4, 5, 0) != epoch_shares(units, 4, 5, 1)  # reshuffled


@pytest.mark.parametrize(("stop", "tail"), [(3, False), (29, True)])
def test_a_state_continues_exactly_at_another_data_parallel_size(
    tmp_path, embedded_tokenizer, stop, tail
):
    """8 readers: 2 ranks to step `stop` (29: in the epoch's tail, some readers done and
    padding), then 1 rank and 4 ranks from the merged state give exactly the global
    batches of an uninterrupted single rank, across the epoch boundary (step 34); its
    epoch holds every training document once."""
    rows = write_fineweb(tmp_path / "fw", files=4, rows_per_file=20, row_group_size=7, chars=400)
    data = DataConfig(
        sources=[{"uri": f"{tmp_path}/fw/sample/10BT/*.parquet", "id_column": "id"}],
        num_workers=0, validation_fraction=0.1, seed=5,
    )  # fmt: skip
    single = Ranks(1)
    datas = single.build(data, embedded_tokenizer, SEQ, global_batch=8, micro=2)
    reference = single.epoch(datas)
    assert delivered(reference, 8) == expected_documents(embedded_tokenizer, rows, 0.1)
    reference += single.steps(datas, 6)  # into the next epoch
    two = Ranks(2)
    first = two.build(data, embedded_tokenizer, SEQ, global_batch=8, micro=2)
    assert two.steps(first, stop) == reference[:stop]
    state = merge_states([d.state_dict() for d in first])
    assert any(state["finished"].values()) == tail and list(state["epochs"]) == [0]
    for n in (1, 4):
        continued = resumed(n, state, len(reference) - stop, data, embedded_tokenizer, SEQ, 8, 2)
        assert continued == reference[stop:], f"continued on {n} rank(s)"


def test_workers_change_nothing_but_speed(tmp_path, embedded_tokenizer):
    write_fineweb(tmp_path / "fw", files=3, rows_per_file=12, row_group_size=5, chars=300)
    base = {"sources": [f"hf:{tmp_path / 'fw'}:sample-10BT"], "seed": 2}

    def build(workers):
        data = DataConfig(**base, num_workers=workers)
        return build_train_data(data, embedded_tokenizer, SEQ, 8, 4, 0, 1, CPU)

    reference = take(build(0), 30)
    two = build(2)
    assert take(two, 12) == reference[:12]
    resumed = build(3)  # more workers on resume
    resumed.load_state_dict(two.state_dict())
    assert take(resumed, 18) == reference[12:]
    two.close()
    resumed.close()


def test_batches_are_tokens_and_shifted_labels(fineweb, embedded_tokenizer):
    root, _ = fineweb
    data = DataConfig(sources=[f"hf:{root}:sample-10BT"], num_workers=1)
    batches = build_train_data(data, embedded_tokenizer, SEQ, 6, 3, 0, 1, CPU).next_step()
    assert len(batches) == 2
    tokens, labels = batches[0]
    assert tokens.shape == labels.shape == (3, SEQ)
    assert tokens.dtype == labels.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], labels[:, :-1])


def test_a_mixture_holds_its_weights_in_every_step(tmp_path, fineweb, embedded_tokenizer):
    """Source B is Greek (the tokenizer has only byte pieces for it): a window made mostly
    of byte tokens (ids 4..259) came from B. Weights 3:1: every window comes from the source
    its slot names, and every step of 16 slots names B 4 times, give or take one."""
    root, _ = fineweb
    rng = np.random.default_rng(0)
    greek = [
        " ".join("".join(chr(0x3B1 + k) for k in rng.integers(0, 24, 5)) for _ in range(60))
        for _ in range(50)
    ]
    write_openwebtext_jsonl(tmp_path / "b.jsonl", [json.dumps({"text": t}).encode() for t in greek])
    weights = [1, 1 / 3]
    data = DataConfig(
        sources=[f"hf:{root}:sample-10BT", {"uri": str(tmp_path / "b.jsonl"), "weight": 1 / 3}],
        num_workers=0,
    )
    steps = take(build_train_data(data, embedded_tokenizer, SEQ, 16, 16, 0, 1, CPU), 40)
    checked = 0
    for k, step in enumerate(steps):
        names = [slot_source(k * 16 + j, weights) for j in range(16)]
        assert 3 <= names.count(1) <= 5
        for window, name in zip(step, names, strict=True):
            if len(window) == SEQ + 1:  # not padding, not an epoch's short last window
                byte_share = np.mean([4 <= t < 260 for t in window])
                assert (byte_share > 0.8) == (name == 1), (k, byte_share, name)
                checked += 1
    assert checked > 500
    slots = [slot_source(n, [3, 1]) for n in range(4000)]
    assert abs(slots.count(1) - 1000) <= 3  # exact in the limit, off by a few at most


def test_validation_is_fixed_and_disjoint_from_training(fineweb, embedded_tokenizer):
    root, rows = fineweb
    data = DataConfig(sources=[f"hf:{root}:sample-10BT"], validation_fraction=0.25, num_workers=0)
    src = source(f"hf:{root}:sample-10BT")
    val_docs, _ = read_documents(src, split="validation", validation_fraction=0.25)
    train_docs, _ = read_documents(src, split="train", validation_fraction=0.25)
    assert {d.id for d in val_docs}.isdisjoint(d.id for d in train_docs)
    assert len(val_docs) + len(train_docs) == len(rows) and len(val_docs) > 15

    batches = build_validation_data(data, embedded_tokenizer, SEQ, 2, CPU, 40)
    assert len(batches) == 40
    assert all(
        torch.equal(a[0], b[0])
        for a, b in zip(
            batches, build_validation_data(data, embedded_tokenizer, SEQ, 2, CPU, 40), strict=True
        )
    )
    tokens = [t for window in step_windows(batches) for t in window]
    complete, _ = split_after_eos(tokens)
    encoded = Counter(
        tuple(ids) for ids in embedded_tokenizer.encode_batch([d.text for d in val_docs], True)
    )
    assert len(complete) > 5 and not Counter(complete) - encoded
    no_validation = data.model_copy(update={"validation_fraction": 0})
    assert build_validation_data(no_validation, embedded_tokenizer, SEQ, 2, CPU, 5) == []


def test_a_state_loads_only_into_the_same_data(fineweb, embedded_tokenizer):
    root, _ = fineweb
    data = DataConfig(sources=[f"hf:{root}:sample-10BT"], num_workers=0)
    saved = build_train_data(data, embedded_tokenizer, SEQ, 4, 2, 0, 1, CPU)
    saved.next_step()
    state = saved.state_dict()
    for key, build in {
        "seq_len": lambda: build_train_data(data, embedded_tokenizer, 64, 4, 2, 0, 1, CPU),
        "readers": lambda: build_train_data(
            data.model_copy(update={"readers": 2}), embedded_tokenizer, SEQ, 4, 2, 0, 1, CPU
        ),
    }.items():
        with pytest.raises(ValueError, match=f"data state was saved with {key}=.* this run has"):
            build().load_state_dict(state)
    pq.write_table(pa.Table.from_pylist(fineweb_rows(3)), root / "sample" / "10BT" / "new.parquet")
    with pytest.raises(ValueError, match=r"saved with data=.* this run has"):
        build_train_data(data, embedded_tokenizer, SEQ, 4, 2, 0, 1, CPU).load_state_dict(state)


def test_stats_count_rows_documents_skips_and_tokens(tmp_path, embedded_tokenizer):
    rows = [json.dumps(r).encode() for r in fineweb_rows(60, chars=300)]
    rows[5] = b"{broken"
    write_openwebtext_jsonl(tmp_path / "x.jsonl", rows)
    data = DataConfig(
        sources=[str(tmp_path / "x.jsonl")], num_workers=2, validation_fraction=0,
        max_skipped_fraction=0.05,  # 1 bad row of 60, judged once the whole file is read
    )  # fmt: skip
    batches = build_train_data(data, embedded_tokenizer, SEQ, 2, 2, 0, 1, CPU)
    take(batches, 3)
    stats = batches.stats()
    assert stats["data/0/rows"] >= stats["data/0/documents"] > 0
    assert stats["data/0/tokens"] == 3 * 2 * (SEQ + 1) and stats["data/0/epoch"] == 0
    while batches.stats()["data/0/epoch"] == 0:  # the whole file once
        take(batches, 1)
    stats = batches.stats()
    assert (stats["data/0/rows"], stats["data/0/documents"]) == (60, 59)
    assert stats["data/0/skipped"] == stats["data/0/corrupt"] == 1
    batches.close()


def test_eos_constant_matches_the_tokenizer(embedded_tokenizer):
    assert embedded_tokenizer.eos_id == EOS
