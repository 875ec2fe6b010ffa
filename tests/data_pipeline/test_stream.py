"""The training stream: global epochs (every document once, whatever the row groups or the
documents' lengths), padding only at an epoch's end, positions that continue exactly at
any data-parallel size and worker count, mixtures, the validation split, and what a state
may be loaded into."""

import copy
import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from corpora import (
    EOS,
    NEVER,
    around_turns,
    documents_per_step,
    documents_so_far,
    each_once,
    expected_documents,
    fineweb_rows,
    heavy_tailed_rows,
    one_row_group_files,
    read_documents,
    source,
    split_after_eos,
    states_equal,
    step_windows,
    stream_documents,
    take,
    write_fineweb,
    write_openwebtext_jsonl,
    write_parquet,
)
from ranks import Ranks, resumed

from data_pipeline.build import build_train_data, build_validation_data
from data_pipeline.config import DataConfig
from data_pipeline.documents import text_id
from data_pipeline.stream import UNIT, Position, slot_source

CPU = torch.device("cpu")
SEQ = 32


def padding(steps: list, seq_len: int) -> float:
    """The share of the steps' label slots without a token (a window of n tokens has n - 1)."""
    slots = sum(len(step) for step in steps) * seq_len
    return 1 - sum(max(len(w) - 1, 0) for step in steps for w in step) / slots


def test_one_epoch_delivers_every_document_once_whatever_the_row_groups(
    tmp_path, embedded_tokenizer
):
    """Row groups of 1, 7, 256 and 1000 rows, 8 readers over 2 data-parallel ranks with 2
    loader workers each (as training builds them): the windows until epoch 0 is read whole
    hold every training document of it exactly once, and no padding (the next epoch's
    first documents fill its last steps); the next epoch then delivers them all again."""
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
    assert stream_documents(epoch0, ranks.origins, epoch=0) == expected  # each exactly once
    stats = datas[0].stats()
    assert stats["data/0/held_out"] + stats["data/0/documents"] >= len(rows)
    epochs = epoch0 + ranks.epoch(datas)
    assert stream_documents(epochs, ranks.origins, epoch=1) == expected
    assert padding(epochs, SEQ) == 0
    for d in datas:
        d.close()


HEAVY_TAILED = {"files": 3, "rows": 1500, "median": 600, "giants": 3, "giant_chars": 40_000}
"""A corpus whose lengths vary like web text, with three documents each longer than the
share of one of 64 readers (about 10K tokens of 400K)."""


@pytest.fixture(scope="module")
def heavy_tailed(tmp_path_factory):
    root = tmp_path_factory.mktemp("heavy")
    spec = HEAVY_TAILED
    rows = heavy_tailed_rows(spec["rows"], spec["median"], spec["giants"], spec["giant_chars"])
    per_file = len(rows) // spec["files"]
    for f in range(spec["files"]):
        write_parquet(root / f"{f:03d}.parquet", rows[f * per_file : (f + 1) * per_file], 100)
    data = DataConfig(
        sources=[{"uri": f"{root}/*.parquet", "id_column": "id"}], validation_fraction=0.05,
        num_workers=2, seed=11,
    )  # fmt: skip
    return data, rows


@pytest.mark.parametrize(
    ("readers", "per_reader", "seq", "ranks"),
    [(4, 1, 128, 1), (16, 2, 64, 2), (64, 1, 32, 1), (64, 1, 32, 2)],
)
def test_heavy_tailed_documents_each_once_an_epoch_without_padding(
    heavy_tailed, embedded_tokenizer, readers, per_reader, seq, ranks
):
    """Real length distributions (lognormal, giants longer than a reader's share of an
    epoch), 2 loader workers per rank, until epoch 2's units are being dealt: epoch 0's
    documents each read once (those still open, the giants among them, begun and read on
    in order), every slot of every step a full window (the turns included), and the turns'
    steps drawing on as many documents as the others (in the tail an epoch used to end
    with, the last steps drew on one document)."""
    data, rows = heavy_tailed
    data = data.model_copy(update={"readers": readers})
    group = Ranks(ranks)
    datas = group.build(data, embedded_tokenizer, seq, readers * per_reader, readers * per_reader)
    steps, turns = [], []
    while datas[0].schedule.deals[0].epoch < 2:
        assert len(steps) < NEVER
        epoch = datas[0].schedule.deals[0].epoch
        steps += group.steps(datas, 1)
        if datas[0].schedule.deals[0].epoch > epoch:
            turns.append(len(steps))
    expected = expected_documents(embedded_tokenizer, rows, 0.05)
    each_once(expected, *documents_so_far(steps, group.origins, epoch=0))
    assert padding(steps, seq) == 0
    documents = documents_per_step(group.origins)
    around = around_turns(documents, turns)
    assert min(documents) >= readers  # a stream, and a document of its own, for each reader
    assert sum(around) / len(around) >= 0.8 * sum(documents) / len(documents), around
    for d in datas:
        d.close()


@pytest.mark.parametrize(("readers", "ranks"), [(64, 2), (512, 8)])
def test_each_unit_is_tallied_once(heavy_tailed, embedded_tokenizer, readers, ranks):
    """The units a stream's cursor passed are reported once (their tallies feed the skip
    check's statistics), by the process reading the stream, across an epoch's turn."""
    data, _ = heavy_tailed
    data = data.model_copy(update={"readers": readers, "num_workers": 0})
    group = Ranks(ranks)
    datas = group.build(data, embedded_tokenizer, 32, readers, readers)
    deal = datas[0].schedule.deals[0]
    while deal.positions[:, UNIT].sum() <= len(deal.sizes):  # into epoch 1's units
        assert datas[0].step < NEVER
        group.steps(datas, 1)
    totals = datas[0].totals[0]
    assert totals["units"] == deal.positions[:, UNIT].sum()


def test_a_small_source_turns_many_epochs_inside_a_large_ones(
    tmp_path, heavy_tailed, embedded_tokenizer
):
    """A 1:1 mixture of the heavy-tailed corpus and 400 short documents (an epoch of about
    50 steps): every epoch of the small source delivers its documents once; the mixture
    has no padding."""
    data, _ = heavy_tailed
    small = [f"short document {i} " * (3 + i % 7) for i in range(400)]
    write_openwebtext_jsonl(
        tmp_path / "small.jsonl", [json.dumps({"text": t}).encode() for t in small]
    )
    sources = [*data.model_dump()["sources"], str(tmp_path / "small.jsonl")]
    mixture = DataConfig.model_validate(data.model_dump() | {"sources": sources, "readers": 8})
    group = Ranks(1)
    datas = group.build(mixture, embedded_tokenizer, SEQ, 16, 16)
    steps = group.steps(datas, 260)
    epochs = datas[0].schedule.deals[1].oldest_epoch()  # the small source's complete epochs
    assert epochs >= 3
    small_windows = [
        [(w, o) for w, o in zip(step, origins, strict=True) if o[0] == 1]
        for step, origins in zip(steps, group.origins, strict=True)
    ]
    windows = [[w for w, _ in step] for step in small_windows]
    origins = [[o for _, o in step] for step in small_windows]
    expected = expected_documents(
        embedded_tokenizer, [{"id": text_id(t), "text": t} for t in small], 0.05
    )
    for epoch in range(epochs):
        assert stream_documents(windows, origins, epoch) == expected, epoch
    assert padding(steps, SEQ) == 0
    datas[0].close()


@pytest.mark.parametrize("turn", [False, True])
def test_a_state_continues_exactly_at_another_data_parallel_size(
    tmp_path, embedded_tokenizer, turn
):
    """8 readers: 2 ranks to a step in the bulk of the epoch, or at its turn (streams
    holding units of both epochs), then 1 rank and 4 ranks from the saved state give
    exactly the global batches of an uninterrupted single rank, into the next epoch; its
    epoch 0 holds every training document once."""
    rows = write_fineweb(tmp_path / "fw", files=4, rows_per_file=20, row_group_size=7, chars=400)
    data = DataConfig(
        sources=[{"uri": f"{tmp_path}/fw/sample/10BT/*.parquet", "id_column": "id"}],
        num_workers=0, validation_fraction=0.1, seed=5,
    )  # fmt: skip
    single = Ranks(1)
    datas = single.build(data, embedded_tokenizer, SEQ, global_batch=8, micro=2)
    deal = datas[0].schedule.deals[0]
    reference = []
    while deal.epoch == 0:
        assert len(reference) < NEVER
        reference += single.steps(datas, 1)
    turned = len(reference)  # the first step whose schedule holds epoch 1's units
    reference += single.epoch(datas) + single.steps(datas, 6)  # epoch 0 read, then on
    assert stream_documents(reference, single.origins, epoch=0) == expected_documents(
        embedded_tokenizer, rows, 0.1
    )
    stop = turned if turn else 3
    two = Ranks(2)
    first = two.build(data, embedded_tokenizer, SEQ, global_batch=8, micro=2)
    assert two.steps(first, stop) == reference[:stop]
    state = first[1].state_dict()
    assert states_equal(state, first[0].state_dict())  # every rank holds the whole state
    assert (state["schedule"]["sources"][0]["epoch"] == 1) == turn
    for n in (1, 4):
        continued = resumed(n, state, len(reference) - stop, data, embedded_tokenizer, SEQ, 8, 2)
        assert continued == reference[stop:], f"continued on {n} rank(s)"


def test_heavy_tailed_data_continues_exactly_on_two_one_and_four_ranks(
    heavy_tailed, embedded_tokenizer
):
    """64 readers on the heavy-tailed corpus: 2 ranks (2 workers each) stopped three steps
    after the epoch's turn continue on 1 rank (no workers) and on 4 ranks (1 worker each)
    with exactly the global batches of an uninterrupted single rank."""
    data, _ = heavy_tailed
    data = data.model_copy(update={"readers": 64, "num_workers": 0})
    single = Ranks(1)
    datas = single.build(data, embedded_tokenizer, SEQ, 64, 64)
    reference = []
    while not reference or datas[0].schedule.deals[0].epoch == 0:
        assert len(reference) < NEVER
        reference += single.steps(datas, 1)
    stop = len(reference) + 3  # three steps after the turn
    reference += single.steps(datas, 9)
    two = Ranks(2)
    first = two.build(data.model_copy(update={"num_workers": 2}), embedded_tokenizer, SEQ, 64, 64)
    assert two.steps(first, stop) == reference[:stop]
    state = first[0].state_dict()
    for part in first:
        part.close()
    for n, workers in ((1, 0), (4, 1)):
        resumed_data = data.model_copy(update={"num_workers": workers})
        continued = resumed(n, state, len(reference) - stop, resumed_data, embedded_tokenizer,
                            SEQ, 64, 64)  # fmt: skip
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


def test_a_state_from_before_line_starts_loads_where_the_cuts_are_the_same(
    fineweb, tmp_path, embedded_tokenizer, monkeypatch
):
    """States saved before line files were cut at line starts have no record of the cuts:
    they load where no line file is read in parts at line starts (parquet, a remote line
    file: the same units), and are refused, saying why, where one is."""
    import data_pipeline.sources

    root, _ = fineweb
    lines = tmp_path / "x.jsonl"
    write_openwebtext_jsonl(lines, [json.dumps(r).encode() for r in fineweb_rows(40)])
    cases = [(f"hf:{root}:sample-10BT", True, True), (str(lines), True, False)]
    for uri, local, loads in [*cases, (str(lines), False, True)]:  # (uri, local, loads)
        monkeypatch.setattr(data_pipeline.sources, "is_local", lambda path, local=local: local)
        data = DataConfig(sources=[uri], num_workers=0)
        saved = build_train_data(data, embedded_tokenizer, SEQ, 4, 2, 0, 1, CPU)
        saved.next_step()
        state = saved.state_dict()
        del state["basis"]["cuts"]
        resumed = build_train_data(data, embedded_tokenizer, SEQ, 4, 2, 0, 1, CPU)
        if loads:
            resumed.load_state_dict(state)
            assert resumed.step == 1
        else:
            with pytest.raises(ValueError, match=r"cut into other units .* line starts"):
                resumed.load_state_dict(state)


def test_a_state_of_one_document_per_stream_continues_at_its_position(tmp_path, embedded_tokenizer):
    """A data state saved before streams kept several documents open (format 2: each
    stream's document, unit, row and tokens taken) continues with this run's lanes at its
    position: stopped 3 steps into an epoch, with streams in the middle of documents, the
    rest of the epoch delivers what the first steps did not, every document exactly once."""
    rows = write_fineweb(tmp_path / "fw", files=4, rows_per_file=20, row_group_size=7, chars=400)
    data = DataConfig(
        sources=[{"uri": f"{tmp_path}/fw/sample/10BT/*.parquet", "id_column": "id"}],
        num_workers=0, validation_fraction=0.1, seed=5, open_documents=1,
    )  # fmt: skip
    first = Ranks(1)
    datas = first.build(data, embedded_tokenizer, SEQ, global_batch=8, micro=8)
    before = first.steps(datas, 3)
    state = format_2(datas[0].state_dict())
    assert any(position[2] for position in state["schedule"]["sources"][0]["positions"])
    rest = Ranks(1)
    lanes = data.model_copy(update={"open_documents": 4})
    continued = rest.build(lanes, embedded_tokenizer, SEQ, global_batch=8, micro=8)
    continued[0].load_state_dict(state)
    after = rest.epoch(continued)
    assert stream_documents(
        before + after, first.origins + rest.origins, epoch=0
    ) == expected_documents(embedded_tokenizer, rows, 0.1)


def format_2(state: dict) -> dict:
    """The data state of a run with one lane as the belief-lm before lanes wrote it: per
    stream (unit, row, tokens taken, unit_tokens, unit_bad, ahead) of its document, the
    units of its epoch's list (those passed before its base: stand-ins, never read again),
    whom each reader follows."""
    old = copy.deepcopy(state)
    old["format"] = 2
    old["layout"] = old.pop("basis")  # (its name before)
    del old["layout"]["open_documents"]
    for deal in old["schedule"]["sources"]:
        entries, lengths, bases = deal.pop("entries"), deal["lengths"], deal.pop("bases")
        assert deal["epoch"] == 0  # (entries of epoch 0 are its units)
        lists, at = [], 0
        for length, base in zip(lengths, bases, strict=True):
            kept = entries[at : at + length].tolist()
            lists.append([kept[0]] * int(base) + kept)  # (the units before the base: any)
            at += length
        deal.update(units=np.array([u for units in lists for u in units]),
                    lengths=np.array([len(units) for units in lists]),
                    follow=np.arange(len(lists)), emptied=None)  # fmt: skip
        positions = []
        for position in map(Position.unpack, deal["positions"]):
            unit, row, taken = position.lanes[0][1:] if position.lanes else (*position[:2], 0)
            positions.append([unit, row, taken, *position[2:5]])
        deal["positions"] = np.array(positions)
        del deal["finished_rows"]
    return old


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
    while batches.totals[0]["units"] < len(batches.units[0]):  # the whole file once
        assert batches.step < NEVER
        take(batches, 1)
    stats = batches.stats()
    assert stats["data/0/rows"] - stats["data/0/documents"] == 1 and stats["data/0/rows"] >= 60
    assert stats["data/0/skipped"] == stats["data/0/corrupt"] == 1
    batches.close()


def test_eos_constant_matches_the_tokenizer(embedded_tokenizer):
    assert embedded_tokenizer.eos_id == EOS


def test_a_tiny_corpus_turns_epoch_after_epoch_without_padding(tmp_path, embedded_tokenizer):
    """30 short documents read by 8 readers (epochs of a step or two, each stream holding
    several epochs' units at once): every slot a full window, no warning."""
    docs = [f"a short document number {i} " * 4 for i in range(30)]
    write_openwebtext_jsonl(
        tmp_path / "tiny.jsonl", [json.dumps({"text": t}).encode() for t in docs]
    )
    data = DataConfig(sources=[str(tmp_path / "tiny.jsonl")], num_workers=0, readers=8)
    batches = build_train_data(data, embedded_tokenizer, SEQ, 8, 8, 0, 1, CPU)
    steps = take(batches, 20)
    assert batches.schedule.deals[0].epoch >= 3
    assert all(len(w) == SEQ + 1 for step in steps for w in step)
