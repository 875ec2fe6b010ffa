"""The schedule on its own (reports made up, no data): units dealt once per epoch as streams
need them, the next epoch's dealt on as soon as one's queue is empty (no tail), passed
entries forgotten, and a plan that stays cheap at thousands of readers."""

import io
import time

import numpy as np
import torch

from belief_lm.train.trainer_state import data_state
from data_pipeline.build import build_train_data
from data_pipeline.config import DataConfig
from data_pipeline.schedule import Schedule
from data_pipeline.stream import LANE_UNITS, UNIT, position_fields

WINDOW = 10


def report(schedule: Schedule, advance) -> list[np.ndarray]:
    """A step's summed report in which stream h moves `advance(h, deal)` units on (0: it
    stays where it is but reports), as each stream's reader would."""
    deal = schedule.deals[0]
    rows = np.zeros((schedule.readers, 1 + schedule.fields), dtype=np.int64)
    for h in range(schedule.readers):
        rows[h, 0] = 1
        rows[h, 1:] = deal.positions[h]
        rows[h, 1 + UNIT] = min(deal.positions[h, UNIT] + advance(h, deal), deal.lengths[h])
    return [rows.ravel()]


def test_each_epoch_deals_every_unit_once_and_the_next_follows_without_a_tail():
    """Streams read at different speeds: each epoch's units are each passed by one stream
    once, in a new order each epoch; the next epoch's units are dealt while streams still
    read the last one's (a stream's list holds both), the turn is told once per epoch, and
    the lists keep only the entries not yet passed."""
    sizes = np.random.default_rng(0).integers(1, 100, 200)
    schedule = Schedule([sizes], [1.0], [1.0], readers=8, per_reader=1, window=WINDOW, seed=3)
    deal = schedule.deals[0]
    read = {0: [], 1: [], 2: []}  # per epoch, the units streams passed
    turns, overlapped, step = [], False, 0
    while deal.oldest_epoch() < 3:
        assert step < 2000  # (a schedule that never turns must fail, not hang)
        before = deal.positions[:, UNIT].copy()
        entries = [(list(e), base) for e, base in zip(deal.lists, deal.bases, strict=True)]
        overlapped |= any(len({x // len(sizes) for x in e}) > 1 for e, _ in entries)
        moved = report(schedule, lambda h, d, k=step: (h + k) % 3 == 0)
        rows = moved[0].reshape(8, -1)[:, 1 + UNIT]
        passed = [e[before[h] - base : rows[h] - base] for h, (e, base) in enumerate(entries)]
        tokens = sum(int(sizes[entry % len(sizes)]) for p in passed for entry in p)
        units = sum(len(p) for p in passed)  # a document each, a token per size (as guessed)
        turned = schedule.commit(moved, [tokens], [units])
        for entry in (entry for p in passed for entry in p):
            epoch, unit = divmod(entry, len(sizes))
            read.setdefault(epoch, []).append(unit)
        if turned[0]:
            turns.append(step)
        assert max(len(e) for e in deal.lists) <= 10  # passed entries dropped (75 kept a stream)
        step += 1
    for epoch in (0, 1, 2):
        assert sorted(read[epoch]) == list(range(len(sizes))), epoch  # each unit once
    assert read[0] != read[1] != read[2]  # in a new order each epoch
    assert overlapped and len(turns) == 3 and turns[1] - turns[0] > 10


def test_entries_stay_while_a_document_of_theirs_is_open():
    """A stream's entries are dropped once its cursor passed them and no lane holds a
    document of theirs: a unit whose long document is still open keeps its entry (and
    so those after it), however far the cursor goes."""
    sizes = np.full(40, 50)
    schedule = Schedule([sizes], [1.0], [1.0], readers=2, per_reader=1, window=WINDOW, seed=1,
                        lanes=2)  # fmt: skip
    deal = schedule.deals[0]
    first = deal.unit_of(0, 0)
    lanes = deal.positions[0, LANE_UNITS].copy()
    deal.positions[0, LANE_UNITS] = [0, -1]  # stream 0's lane 0 holds a document of entry 0
    for _ in range(6):
        schedule.commit(report(schedule, lambda h, d: 1), [0])
    assert deal.bases[0] == 0 and deal.unit_of(0, 0) == first and deal.positions[0, UNIT] >= 5
    assert deal.bases[1] == deal.positions[1, UNIT]  # stream 1: all it passed, dropped
    deal.positions[0, LANE_UNITS] = lanes  # the document ends
    schedule.commit(report(schedule, lambda h, d: 0), [0])
    assert deal.bases[0] == deal.positions[0, UNIT]


def test_a_plan_for_2048_readers_is_cheap():
    """The old plan dealt every unit to every reader for each reader: O(readers^2 x units)
    (minutes at 2,048 readers). Now: a deal per epoch, O(readers) per step."""
    sizes = np.random.default_rng(0).integers(100, 10_000, 2048 * 8)
    started = time.perf_counter()
    schedule = Schedule([sizes], [0.25], [1.0], readers=2048, per_reader=1, window=129, seed=0)
    for step in range(50):
        schedule.commit(report(schedule, lambda h, d, k=step: (h + k) % 7 == 0), [1000])
    assert time.perf_counter() - started < 30  # about 1 s here; the bound is far above it


def test_2048_readers_start_step_and_resume_in_one_process(embedded_tokenizer):
    """build_train_data, steps and a resume at 2,048 readers (each reader's first unit is
    a document of the embedded corpus), bounded far above what it takes (seconds). The
    data state a checkpoint saves (data_state.pt) holds per source each stream's packed
    position (its 8 open documents' lanes included: 31 integers), its list's length and
    base, and its entries (2,048 streams of 8 lanes hold 7,028 of the 2,361 units: the
    corpus is dealt about 3 times over at once): at most 8 bytes per integer of a
    stream, a lane's entry per stream, each unit once, and 16 KB besides (600 KB here of a
    707 KB bound); a state that kept documents or windows would grow with their tokens,
    one that kept every entry ever dealt with the epochs."""
    data = DataConfig(readers=2048, num_workers=0)
    cpu = torch.device("cpu")
    started = time.perf_counter()
    train = build_train_data(data, embedded_tokenizer, 32, 2048, 2048, 0, 1, cpu)
    train.next_step()
    train.next_step()
    state = train.state_dict()
    saved = io.BytesIO()
    torch.save(data_state(train), saved)
    units = sum(len(deal.sizes) for deal in train.schedule.deals)
    lanes = data.open_documents  # entries a stream holds: about one a lane, and the units
    integers = 2048 * (position_fields(lanes) + 2 + lanes) + units
    assert len(saved.getvalue()) <= 8 * integers + 16_384, (len(saved.getvalue()), integers)
    expected = train.next_step()
    resumed = build_train_data(data, embedded_tokenizer, 32, 2048, 2048, 0, 1, cpu)
    resumed.load_state_dict(state)
    assert all(
        torch.equal(a, b) for pair in zip(resumed.next_step(), expected, strict=True)
        for a, b in zip(*pair, strict=True)
    )  # fmt: skip
    assert time.perf_counter() - started < 120


def test_the_first_units_to_finish_do_not_decide_the_estimate_alone():
    """Units that held no tokens (a held-out giant, unusable rows) finish first; taken
    alone as the measurement they made every unit look empty, and the whole queue was
    handed out at once (a tail as long as the epoch). The first guess weighs as an eighth
    of the source, so the estimate moves to the measured ratio as the source is read."""
    sizes = np.full(200, 100)
    schedule = Schedule([sizes], [0.1], [1.0], readers=8, per_reader=1, window=WINDOW, seed=0)
    deal = schedule.deals[0]
    handed = deal.handed
    schedule.commit(report(schedule, lambda h, d: 1), [0])  # each stream passed its first unit
    assert deal.ratio > 0.07 and deal.handed - handed <= 32  # kept supplied, not given all 200
    for _ in range(10):  # 80 more units (40% of the source) with 0.3 tokens per size
        schedule.commit(report(schedule, lambda h, d: 1), [8 * 100 * 0.3])
    assert 0.2 < deal.ratio < 0.3
