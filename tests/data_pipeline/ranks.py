"""Several data-parallel ranks' TrainData in one process (a thread each), agreeing through
an in-memory stand-in for the trainer's all-reduce: enough to test layouts without torchrun."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from corpora import NEVER, step_origins, step_windows

from data_pipeline.build import build_train_data
from data_pipeline.loader import Collective


class Ranks:
    """`n` ranks of one data config; `steps(k)` runs k steps on all of them together."""

    def __init__(self, n: int):
        self.n, self.barrier, self.values = n, threading.Barrier(n), [None] * n
        self.origins: list = []
        """Per step run, where its windows came from (corpora.stream_documents)."""

    def _exchange(self, rank: int, value):
        self.values[rank] = value
        self.barrier.wait()
        values = list(self.values)
        self.barrier.wait()
        return values

    def collective(self, rank: int) -> Collective:
        return Collective(
            sum=lambda t: sum(self._exchange(rank, t)),
            gather=lambda v: self._exchange(rank, v),
        )

    def build(self, data, tokenizer, seq_len: int, global_batch: int, micro: int) -> list:
        cpu = torch.device("cpu")
        built = []
        for rank in range(self.n):
            collective = self.collective(rank)
            built.append(
                build_train_data(
                    data, tokenizer, seq_len, global_batch, micro, rank, self.n, cpu, collective
                )
            )
        return built

    def steps(self, datas: list, k: int) -> list[list[list[int]]]:
        """k global batches: per step, every rank's windows in rank order (as
        corpora.window_tokens: padding dropped, a padding window empty)."""
        # loader workers forked here, one rank after another, as each rank's process would:
        # forked from the pool's threads at once, stopping them stalled (leaked pipes) and
        # they exited with code 1 (the pool's exit hook joined the forking thread)
        for data in datas:
            data.start()
        with ThreadPoolExecutor(self.n) as pool:
            per_rank = list(pool.map(lambda data: _steps(data, k), datas))
        self.origins += [[o for rank in per_rank for o in rank[step][1]] for step in range(k)]
        return [[w for rank in per_rank for w in rank[step][0]] for step in range(k)]

    def epoch(self, datas: list) -> list[list[list[int]]]:
        """The global batches until source 0's oldest epoch in reading is read whole (its
        last steps hold the next epoch's first documents: `stream_documents(...,
        epoch=...)` tells them apart)."""
        deal = datas[0].schedule.deals[0]
        batches, epoch = [], deal.oldest_epoch()
        while not batches or deal.oldest_epoch() == epoch:
            assert len(batches) < NEVER, f"epoch {epoch} not read whole in {NEVER} steps"
            batches += self.steps(datas, 1)
        return batches


def resumed(n: int, state: dict, k: int, data, tokenizer, *shape: int) -> list:
    """k global batches of `n` ranks continuing from a data state (any rank's, of any
    layout); `shape`: seq_len, global batch, micro-batch."""
    ranks = Ranks(n)
    datas = ranks.build(data, tokenizer, *shape)
    for part in datas:
        part.load_state_dict(state)
    steps = ranks.steps(datas, k)
    for part in datas:  # (a worker stopped unasked passes the signal on to its trainer)
        part.close()
    return steps


def _steps(data, k: int) -> list[tuple[list, list]]:
    return [(step_windows(data.next_step()), step_origins(data)) for _ in range(k)]
