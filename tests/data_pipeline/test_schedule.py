"""The schedule on its own (reports made up, no data): units dealt once per epoch as streams
need them, readers joining streams only in the tail, epochs that turn for everyone at
once, and a plan that stays cheap at thousands of readers."""

import time

import numpy as np
import torch

from data_pipeline.build import build_train_data
from data_pipeline.config import DataConfig
from data_pipeline.schedule import JOIN_DELAY, Schedule
from data_pipeline.stream import AHEAD, UNIT

WINDOW = 10


def report(schedule: Schedule, advance) -> list[np.ndarray]:
    """A step's summed report in which stream h moves `advance(h, deal)` units on (0: it
    stays where it is but reports), as the readers first in each stream's order would."""
    deal = schedule.deals[0]
    rows = np.zeros((schedule.readers, 1 + schedule.fields), dtype=np.int64)
    for h in set(deal.follow.tolist()):
        rows[h, 0] = 1
        rows[h, 1:] = deal.positions[h]
        rows[h, 1 + UNIT] = min(deal.positions[h, UNIT] + advance(h, deal), len(deal.lists[h]))
    return [rows.ravel()]


def test_each_epoch_deals_every_unit_once_as_streams_need_them_then_turns():
    sizes = np.random.default_rng(0).integers(1, 100, 200)
    schedule = Schedule([sizes], [1.0], [1.0], readers=8, per_reader=1, window=WINDOW, seed=3)
    read = {0: [], 1: [], 2: []}  # per epoch, the units streams passed
    epochs, step = [], 0
    while schedule.deals[0].epoch < 3:
        deal = schedule.deals[0]
        epoch, lists = deal.epoch, [list(units) for units in deal.lists]
        before = deal.positions[:, UNIT].copy()
        turned = schedule.commit(report(schedule, lambda h, d, k=step: (h + k) % 3 == 0), [0])
        for h, units in enumerate(lists):  # the units each stream passed in this step
            passed = units[before[h] : len(units) if turned[0] else deal.positions[h, UNIT]]
            read[epoch] += passed
        if turned[0]:
            epochs.append(step)
            assert (deal.follow == np.arange(8)).all() and deal.handed > 0  # a fresh deal
        step += 1
    for epoch in (0, 1, 2):
        assert sorted(read[epoch]) == list(range(len(sizes))), epoch  # each unit once
    assert read[0] != read[1] != read[2]  # in a new order each epoch
    # streams are supplied ahead of their reading (TARGET_STEPS steps of estimated work)
    assert len(epochs) == 3 and epochs[1] - epochs[0] > 10


def test_readers_join_only_in_the_tail_and_no_stream_gets_more_than_it_can_fill():
    sizes = np.full(40, 50)
    schedule = Schedule([sizes], [1.0], [1.0], readers=8, per_reader=1, window=WINDOW, seed=1)
    deal = schedule.deals[0]
    while deal.handed < len(deal.order):  # in the bulk nobody joins
        # a loader worker may make the next step before it has this one's reports
        assert schedule.view_needed(schedule.step + 1) == schedule.step
        schedule.commit(report(schedule, lambda h, d: h % 2), [0])
        assert (deal.follow == np.arange(8)).all()
    emptied = deal.emptied
    assert schedule.view_needed(schedule.step) == schedule.step  # the tail: in step
    # streams 0-3 run out; 4 and 5 read their ends ahead: 3 and 25 windows left
    for h in range(8):
        deal.positions[h, UNIT] = len(deal.lists[h]) if h < 4 else len(deal.lists[h]) - 1
    deal.positions[4, AHEAD], deal.positions[5, AHEAD] = 3 * WINDOW, 25 * WINDOW - 4
    deal._index()
    if schedule.step < emptied + JOIN_DELAY - 1:
        schedule.commit([np.zeros(8 * (1 + schedule.fields), dtype=np.int64)], [0])
    deal.join(np.ones(8, dtype=np.int64), WINDOW)
    members = np.bincount(deal.follow, minlength=8)
    assert members[:4].sum() == 0 and members[4] <= 3 and members.sum() == 8
    assert members[5] >= 2  # the stream with most work left takes the most readers


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
    a document of the embedded corpus), bounded far above what it takes (seconds)."""
    data = DataConfig(readers=2048, num_workers=0)
    cpu = torch.device("cpu")
    started = time.perf_counter()
    train = build_train_data(data, embedded_tokenizer, 32, 2048, 2048, 0, 1, cpu)
    train.next_step()
    train.next_step()
    state = train.state_dict()
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
