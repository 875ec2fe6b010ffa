"""Several data-parallel ranks' TrainData in one process (a thread each), agreeing through
an in-memory stand-in for the trainer's all-reduce: enough to test layouts without torchrun."""

from __future__ import annotations

import threading

import torch
from corpora import step_windows

from data_pipeline.build import build_train_data
from data_pipeline.loader import Collective


class Ranks:
    """`n` ranks of one data config; `steps(k)` runs k steps on all of them together."""

    def __init__(self, n: int):
        self.n, self.barrier, self.values = n, threading.Barrier(n), [None] * n

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
        # plain threads, no ThreadPoolExecutor: a loader worker forked from a pool's thread
        # fails at its exit (the pool's exit hook joins its threads, the forking one too:
        # exit code 1, which DataLoader raises in this process as a worker failure)
        per_rank, errors = [None] * self.n, []

        def rank_steps(rank: int) -> None:
            try:
                per_rank[rank] = _steps(datas[rank], k)
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=rank_steps, args=(r,)) for r in range(self.n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return [[w for rank in per_rank for w in rank[step]] for step in range(k)]

    def epoch(self, datas: list) -> list[list[list[int]]]:
        """The global batches up to the end of source 0's current epoch (the step at which
        the next one begins for every reader)."""
        batches, epoch = [], datas[0].stats().get("data/0/epoch", 0)
        while datas[0].stats().get("data/0/epoch", 0) == epoch:
            batches += self.steps(datas, 1)
        return batches


def resumed(n: int, state: dict, k: int, data, tokenizer, *shape: int) -> list:
    """k global batches of `n` ranks continuing from a data state (merge_states of
    another layout's ranks); `shape`: seq_len, global batch, micro-batch."""
    ranks = Ranks(n)
    datas = ranks.build(data, tokenizer, *shape)
    for part in datas:
        part.load_state_dict(state)
    return ranks.steps(datas, k)


def _steps(data, k: int) -> list[list[list[int]]]:
    return [step_windows(data.next_step()) for _ in range(k)]
