"""Seeing a run while it trains and understanding it afterwards, on the tests' micro run in
this process: W&B offline (and a resume continuing its run), loss spikes (skipped, logged
with their update applied, and a stop), a profiled stretch of steps, the console (a
progress bar on a terminal, plain lines otherwise) and `belief-lm report`. The runs are
shared by the tests below (CI time)."""

import fcntl
import importlib.util
import json
import logging
import math
import os
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
import torch

from belief_lm import cli
from belief_lm.config import SpikeConfig, load_config
from belief_lm.exit_codes import BAD_INPUT, DONE, LOSS_SPIKES
from belief_lm.train.loop import Trainer, train
from belief_lm.train.spikes import SpikeDetector
from tests.jobs import MICRO

SPIKE = 30.0
"""How much an injected spike multiplies a step's loss."""
TOKENS_PER_STEP = 8 * 32  # micro.yaml: global batch 8 x 32 tokens


class SpikedSteps:
    """Multiplies the loss of the given training steps by SPIKE, through the model's own
    loss function (what the detector and the optimizer see is the real path's loss, as
    with a corrupt batch)."""

    def __init__(self, monkeypatch, steps: set[int]):
        import belief_lm.model.gpt as gpt

        self.steps, self.scale = steps, 1.0
        real_loss, real_step = gpt.lm_loss, Trainer.train_step

        def lm_loss(logits, labels, z_loss=0.0):
            terms = real_loss(logits, labels, z_loss)
            return terms._replace(loss=terms.loss * self.scale)

        def train_step(trainer):
            self.scale = SPIKE if trainer.step + 1 in self.steps else 1.0
            try:
                return real_step(trainer)
            finally:
                self.scale = 1.0

        monkeypatch.setattr(gpt, "lm_loss", lm_loss)
        monkeypatch.setattr(Trainer, "train_step", train_step)


class Records(logging.Handler):
    """The log records of `belief_lm` while attached."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def config(run_dir: Path, cache_dir: str, *overrides: str):
    run = [f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}"]
    return load_config(MICRO, [*run, *overrides])


def rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / f"step_{step:06d}" / "mp_rank_00_model_states.pt"
    return torch.load(path, weights_only=False)["module"]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


HAVE_WANDB = importlib.util.find_spec("wandb") is not None
"""W&B is the `wandb` extra (in dev: CI has it); without it the rest is still tested."""
OBSERVED = [
    "train.max_steps=8", "train.spike.window=8",
    "train.spike.min_history=3", "checkpoint.interval=1", "checkpoint.keep=20",
    "train.eval_interval=4", "train.eval_batches=2", "run.diagnostics_interval=4",
    "run.profile.start_step=2", "run.profile.steps=1",
    *(["run.wandb.mode=offline", "run.wandb.project=belief-lm-tests",
       "run.wandb.tags=[micro,ci]"] if HAVE_WANDB else []),
]  # fmt: skip


@pytest.fixture(scope="module")
def observed(tmp_path_factory, cache_dir):
    """Run 1: 8 steps, W&B offline, step 2 profiled, a spike at step 6 (skipped), a
    checkpoint every step; run 2 resumes it to 10 steps with a spike at step 9 (judged
    against the loss history the checkpoint kept) at the default train.spike.action=log."""
    run_dir = tmp_path_factory.mktemp("observed") / "run"
    records, logger = Records(), logging.getLogger("belief_lm")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("WANDB_MODE", "offline")  # and no network anyway
            SpikedSteps(patch, {6})
            first = train(config(run_dir, cache_dir, *OBSERVED, "train.spike.action=skip"))
            SpikedSteps(patch, {9})
            resumed = train(config(run_dir, cache_dir, *OBSERVED, "train.max_steps=10"))
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return {"dir": run_dir, "first": first, "resumed": resumed, "log": records.lines}


def test_a_spike_is_logged_and_its_update_skipped_or_applied(observed):
    run_dir, log = observed["dir"], observed["log"]
    assert observed["first"].spikes == [6] and observed["resumed"].spikes == [9]
    spikes = {r["step"]: r for r in rows(run_dir) if "spike_loss" in r}
    assert list(spikes) == [6, 9]
    losses = {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}
    for step, row in spikes.items():
        assert row["spike_loss"] == losses[step]
        assert row["spike_loss"] > 10 * row["spike_median"] and row["spike_score"] > 6
    # action=skip: the spiked step left the weights as they were; the step after it trained
    assert spikes[6]["spike_skipped"] == 1.0
    assert same_weights(weights(run_dir, 6), weights(run_dir, 5))
    assert not same_weights(weights(run_dir, 7), weights(run_dir, 6))
    assert any(re.fullmatch(r"step 6: loss spike .*; update skipped", x) for x in log)
    # action=log (the default): only logged; the spiked step's update was applied
    assert spikes[9]["spike_skipped"] == 0.0
    assert not same_weights(weights(run_dir, 9), weights(run_dir, 8))
    assert any(re.fullmatch(r"step 9: loss spike .* of the last \d+ steps", x) for x in log)
    # without a terminal, the progress is a log line per log interval, with the ETA
    assert any(re.match(r"step 8/8 \| loss [\d.]+ \| lr .* \| ETA ", x) for x in log)


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is the wandb extra (bash setup.sh --dev)")
def test_wandb_offline_run_holds_the_scalars_and_a_resume_continues_it(observed):
    run_dir = observed["dir"]
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [p.name.rsplit("-", 1)[1] for p in offline] == [run_id, run_id]  # the same W&B run
    logged = {}
    for path, action in zip(offline, ["skip", "log"], strict=True):  # run 1, the resume
        records = wandb_records(path)
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        assert run["run_id"] == run_id and run["project"] == "belief-lm-tests"
        assert run["tags"] == ["micro", "ci"] and run["display_name"] == "run"
        updates = [r["config"]["update"] for r in records if r["type"] == "config"]
        config = {k: v for u in [run["config"]["update"], *updates] for k, v in u.items()}
        assert config["model"]["name"] == "micro" and config["train"]["spike"]["action"] == action
        assert len(config["environment"]["git_commit"]) == 40
        for record in (r["history"]["item"] for r in records if r["type"] == "history"):
            step = int(record["_step"])
            logged[step] = {k: v for k, v in record.items() if not k.startswith("_")}
    metrics = {r["step"]: r for r in rows(run_dir) if "loss" in r}
    assert sorted(logged) == list(range(1, 11))
    for step, row in metrics.items():  # the same scalars as metrics.jsonl and tensorboard
        assert logged[step]["train/loss"] == pytest.approx(row["loss"], rel=1e-12)
        assert logged[step]["train/lr"] == pytest.approx(row["lr"], rel=1e-12)
    (validation,) = [r for r in rows(run_dir) if r["step"] == 4 and "val_loss" in r]
    assert logged[4]["val/val_loss"] == pytest.approx(validation["val_loss"], rel=1e-12)
    assert logged[6]["spike/spike_skipped"] == 1 and logged[9]["spike/spike_skipped"] == 0


def wandb_records(run_path: Path) -> list[dict]:
    """The records of an offline W&B run, read by wandb's own reader (JSON lines)."""
    wandb = Path(sys.executable).parent / "wandb"
    done = subprocess.run(
        [wandb, "leet", "inspect", "--json", run_path], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_profiled_steps_leave_a_trace_of_our_ops(observed):
    (trace,) = (observed["dir"] / "profile").glob("*.json")
    assert trace.name == "rank0_step2.pt.trace.json"
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert "belief_lm.train_step#2" in names
    assert not {"belief_lm.train_step#1", "belief_lm.train_step#3"} & names
    assert "Optimizer.step#GuardedAdamW.step" in names  # our optimizer
    assert "aten::scaled_dot_product_attention" in names or "aten::bmm" in names


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, cache_dir):
    """Run 3, the `train` command in this process (its exit code): train.spike.action=stop,
    spikes at steps 4 and 5 (max_in_row 2), its progress written to a terminal (a pty)."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 160 wide
    terminal, shown = os.fdopen(follower, "w"), []
    reader = threading.Thread(target=read_all, args=(leader, shown))
    reader.start()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stderr", terminal)
        SpikedSteps(patch, {4, 5})
        code = cli.main(
            ["train", "--config", MICRO, f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}",
             "train.max_steps=8", "train.spike.action=stop", "train.spike.max_in_row=2",
             "train.spike.min_history=3"]
        )  # fmt: skip
    terminal.write(END_OF_RUN.decode())
    terminal.close()
    reader.join(timeout=10)
    return {"dir": run_dir, "code": code, "terminal": b"".join(shown).decode()}


END_OF_RUN = b"[end of the run]"
"""Written to the terminal after the run: where its reader stops."""


def read_all(fd: int, into: list) -> None:
    """The terminal's output up to END_OF_RUN. Not up to the terminal's close: a library may
    hold a copy of its descriptor (DeepSpeed's compiler probe leaves a dup of stderr open
    when it first runs here), and a reader waiting for that close keeps pytest from exiting."""
    tail = b""  # the end of what was read: the mark may come in parts
    while END_OF_RUN not in tail:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        into.append(chunk)
        tail = tail[-len(END_OF_RUN) :] + chunk
    os.close(fd)


def test_spikes_in_a_row_save_and_stop_with_their_exit_code(stopped):
    run_dir = stopped["dir"]
    assert stopped["code"] == LOSS_SPIKES
    spikes = [r for r in rows(run_dir) if "spike_loss" in r]
    assert [(r["step"], r["spike_skipped"]) for r in spikes] == [(4, 0.0), (5, 0.0)]
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved == ["step_000005"]
    assert max(r["step"] for r in rows(run_dir)) == 5


def test_on_a_terminal_the_progress_is_a_bar(stopped):
    shown = stopped["terminal"]
    assert "\r" in shown  # redrawn in place
    bar = re.findall(r"(\d+)/8 \[[\d:]+<[\d:?]+, loss=([\d.]+), tokens/s=[\d,]+, MFU=-\]", shown)
    step, loss = bar[-1]
    logged = next(r["loss"] for r in rows(stopped["dir"]) if r["step"] == 5 and "loss" in r)
    assert (step, loss) == ("5", f"{logged:.4g}")
    assert "step 5/8 | loss" not in shown  # not the plain lines


def test_report_of_a_run_and_of_two_overlaid(observed, stopped, tmp_path, capsys):
    image = pytest.importorskip("matplotlib.image", reason="the report extra (setup.sh --dev)")

    run_dir = observed["dir"]
    assert cli.main(["report", str(run_dir)]) == DONE
    text = capsys.readouterr().out
    pixels = image.imread(run_dir / "report.png")
    assert pixels.shape[0] > 500 and pixels.shape[1] > 500 and pixels.std() > 0.05
    train_rows = [r for r in rows(run_dir) if "loss" in r]
    best = min((r for r in rows(run_dir) if "val_loss" in r), key=lambda r: r["val_loss"])
    assert f"steps 10, tokens {10 * TOKENS_PER_STEP:,}" in text
    assert f"best validation loss {best['val_loss']:.4f} (step {best['step']})" in text
    mean = 10 * TOKENS_PER_STEP / sum(r["step_time_s"] for r in train_rows)  # log_interval 1
    assert f"throughput {mean:,.0f} tokens/s" in text
    assert "loss spikes 2 (steps 6, 9); 2 start(s), resumed after step 8" in text

    out = tmp_path / "ab.png"
    assert cli.main(["report", str(run_dir), str(stopped["dir"]), "--out", str(out)]) == DONE
    text = capsys.readouterr().out
    assert image.imread(out).std() > 0.05
    assert f"steps 5, tokens {5 * TOKENS_PER_STEP:,}" in text
    assert "loss spikes 2 (steps 4, 5); 1 start(s)" in text


def test_missing_extras_are_named_before_any_work(observed, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    code = cli.main(["config", "--config", MICRO, "run.wandb.mode=offline"])
    assert code == BAD_INPUT
    assert "pip install 'belief-lm[wandb]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["report", str(observed["dir"])]) == BAD_INPUT
    assert "pip install 'belief-lm[report]'" in capsys.readouterr().err


def test_the_detector_flags_spikes_and_not_a_noisy_descent():
    detector = SpikeDetector(SpikeConfig(window=50, min_history=10, threshold=6))
    noise = torch.Generator().manual_seed(0)
    losses = [8 - 3 * (1 - math.exp(-s / 80)) for s in range(1, 301)]
    losses = [x + 0.05 * float(torch.randn((), generator=noise)) for x in losses]
    losses[200] += 1.0  # 20 noise deviations
    flagged = [s for s, loss in enumerate(losses) if detector.check(s, loss)]
    assert flagged == [200]
    assert detector.check(301, float("nan")) is None and detector.in_a_row == 0
    restored = SpikeDetector(detector.cfg, detector.state_dict())
    assert restored.check(302, 50.0) and detector.check(302, 50.0)


SLOW_S = 0.15
"""Sleep in each of rank 1's forward passes (two per step: global batch 8 = 2 ranks x 2
micro-batches of 2 x accumulation 2)."""


def test_two_ranks_slow_one_named_spike_skipped_by_both_console_quiet(tmp_path, cache_dir):
    """One 2-rank job (gloo, torchrun) of the real command: rank 1 is slow, step 4's loss
    spikes on rank 0 only, and the console shows our lines (plain: not a terminal) and a
    real warning, but none of the libraries' known chatter."""
    from belief_lm.logs import NOISE, is_noise
    from tests.jobs import ROOT, job_env, run_job, torchrun_command
    from tests.train.observe_ranks import REAL_WARNING

    run_dir = tmp_path / "run"
    command = torchrun_command(
        2, "tests/train/observe_ranks.py", str(SLOW_S), "4", "train", "--config", MICRO,
        f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}", "train.max_steps=5",
        "train.spike.action=skip", "train.spike.min_history=3", "checkpoint.interval=1",
        "checkpoint.keep=10", "run.log_interval=2",
    )  # fmt: skip
    done = run_job(command, timeout=300, cwd=ROOT, env=job_env())
    assert done.returncode == 0, done.stderr[-5000:]
    output = done.stdout + done.stderr
    noise = [line for line in output.splitlines() if is_noise(line)]
    assert not noise, noise
    for words in ("Apex", "untested optimizer", "Setting accelerator", "built successfully"):
        assert words in " ".join(NOISE.values()).replace("\\", "") and words not in output
    assert REAL_WARNING in done.stderr
    progress = re.findall(r"step (\d)/5 \| loss [\d.]+ \| lr .* \| ETA [\d:]+", done.stderr)
    assert progress == ["2", "4", "5"]  # rank 0 alone, at each log and the last step

    train_rows = [r for r in rows(run_dir) if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 5]
    for row in train_rows:  # rank 1's sleep shows as its forward time; rank 0 is named not
        assert row["ranks/slowest"] == 1.0
        spread = row["ranks/forward_s_max"] - row["ranks/forward_s_min"]
        assert spread > 0.8 * 2 * SLOW_S, row
        assert row["ranks/forward_s_min"] <= row["ranks/forward_s_median"]
    (spike,) = [r for r in rows(run_dir) if "spike_loss" in r]
    assert spike["step"] == 4 and spike["spike_skipped"] == 1.0
    # both ranks skipped it: ZeRO-1 gathers each rank's half of the weights into the saved
    # module, so an update on either rank would show
    assert same_weights(weights(run_dir, 4), weights(run_dir, 3))
    assert not same_weights(weights(run_dir, 5), weights(run_dir, 4))
