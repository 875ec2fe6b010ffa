"""Per-interval throughput and the per-step logs of a resumed run."""

import json

import pytest
import torch

from belief_lm.config import load_config
from belief_lm.train import metrics
from belief_lm.train.run_dir import drop_metrics_after


def test_a_resumed_runs_first_interval_starts_at_its_checkpoint(monkeypatch):
    cfg = load_config("configs/tiny.yaml")
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    meter = metrics.Meter(cfg, 4096, torch.device("cpu"), world_size=1, start=4)
    scalars = meter.scalars(5, 3.0, 1e-3, 1.0, 0.5)
    # one step (5 after 4) in 2 s, not five steps since step 0
    assert scalars["step_time_s"] == pytest.approx(2.0)
    assert scalars["data_wait_s"] == pytest.approx(0.5)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    assert scalars["tokens_per_s"] == pytest.approx(tokens / 2.0)


def test_resume_drops_every_logs_rows_past_the_checkpoint(tmp_path):
    for name in ("metrics.jsonl", "diagnostics.jsonl"):
        rows = [json.dumps({"step": s, "x": s}) for s in (2, 4, 6)]
        (tmp_path / name).write_text("".join(f"{r}\n" for r in rows))
    drop_metrics_after(tmp_path, 4)
    for name in ("metrics.jsonl", "diagnostics.jsonl"):
        steps = [json.loads(r)["step"] for r in (tmp_path / name).read_text().splitlines()]
        assert steps == [2, 4], name
