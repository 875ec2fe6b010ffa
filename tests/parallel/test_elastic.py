"""Elastic resume with the real command: a run of streamed parquet mixed with prepared
data, checkpointed at TP=2 x DP=2 with 2 loader workers per rank, continues at other
data-parallel sizes, tensor-parallel sizes and worker counts with the losses of the
uninterrupted run (its global batches are the same windows)."""

import json

import pytest

from tests.data_pipeline.corpora import write_fineweb
from tests.jobs import MICRO, run_cli

STEPS, SAVED = 6, 3


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """A FineWeb-Edu-layout repository (streamed through the hub code path) and a prepared
    copy of another one, with the tokenizer both use."""
    root = tmp_path_factory.mktemp("elastic")
    write_fineweb(root / "stream", files=3, rows_per_file=30, row_group_size=7, chars=500)
    write_fineweb(root / "offline", files=2, rows_per_file=30, row_group_size=10, chars=400)
    tokenizer = root / "tok.model"
    stream = f"{{uri: 'hf:{root / 'stream'}:sample-10BT', id_column: id}}"
    done = run_cli(
        "tokenizer", "train", "--output", str(tokenizer), f"data.sources=[{stream}]",
        "data.tokenizer.vocab_size=600", "data.tokenizer.sample_documents=60",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    offline = f"{{uri: 'hf:{root / 'offline'}:sample-10BT', id_column: id}}"
    done = run_cli(
        "prepare", "--output", str(root / "prepared"), "--workers", "2",
        f"data.sources=[{offline}]", f"data.tokenizer.path={tokenizer}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    sources = f"data.sources=[{stream}, {{uri: 'prepared:{root / 'prepared'}', weight: 0.5}}]"
    return [sources, f"data.tokenizer.path={tokenizer}", "data.validation_fraction=0.05"]


def train(run_dir, data, nproc, *overrides):
    done = run_cli(
        "train", "--config", MICRO, *data, f"run.output_dir={run_dir}", f"train.max_steps={STEPS}",
        "train.global_batch_size=8", "train.micro_batch_size=2", "parallel.zero_stage=1",
        *overrides, nproc=nproc, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-5000:]
    return losses(run_dir)


@pytest.mark.slow
def test_a_checkpoint_continues_on_other_layouts_with_the_same_losses(mixture, tmp_path):
    data = mixture
    saved = tmp_path / "tp2dp2"
    whole = train(
        saved, data, 4, "parallel.tensor=2", "data.num_workers=2", f"checkpoint.interval={SAVED}"
    )
    assert sorted(whole) == list(range(1, STEPS + 1))
    step = saved / "checkpoints" / f"step_{SAVED:06d}"
    for name, nproc, layout in [
        ("tp1dp4", 4, ["parallel.tensor=1", "data.num_workers=1"]),
        ("tp2dp1", 2, ["parallel.tensor=2", "data.num_workers=0"]),
        ("tp1dp1", 1, ["parallel.tensor=1", "data.num_workers=2"]),
    ]:
        resumed = train(tmp_path / name, data, nproc, *layout, f"checkpoint.resume={step}")
        assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1)), name
        for s in resumed:
            assert resumed[s] == pytest.approx(whole[s], rel=1e-5), (name, s)


@pytest.mark.slow
def test_a_zero2_checkpoint_continues_at_another_data_parallel_size(mixture, tmp_path):
    """ZeRO-2's partitioned optimizer state goes through the universal checkpoint as
    ZeRO-1's does: saved at DP=2, continued at DP=1 with the uninterrupted losses."""
    saved = tmp_path / "dp2"
    whole = train(saved, mixture, 2, "parallel.zero_stage=2", f"checkpoint.interval={SAVED}")
    step = saved / "checkpoints" / f"step_{SAVED:06d}"
    resumed = train(tmp_path / "dp1", mixture, 1, "parallel.zero_stage=2",
                    f"checkpoint.resume={step}")  # fmt: skip
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    for s in resumed:
        assert resumed[s] == pytest.approx(whole[s], rel=1e-5), s
