"""Branches (`belief-lm train --branch`): another run's checkpoint continued exactly, in a run
directory of its own, with a schedule of its own; a branch that would change the model or
the data is refused naming the key."""

import json
import signal

import pytest

from belief_lm.cli import main
from belief_lm.config import load_config
from belief_lm.errors import BadInput
from belief_lm.exit_codes import BAD_INPUT
from belief_lm.train.loop import train
from belief_lm.train.optim import LRSchedule
from tests.jobs import MICRO, metrics

PARENT = [
    "model.seq_length=64", "train.micro_batch_size=4", "data.num_workers=1",
    "train.lr_schedule=wsd", "train.wsd_decay_steps=2", "train.decay_steps=8",
    "train.max_steps=8", "checkpoint.interval=4",
]  # fmt: skip
"""Stable from the warmup's end (step 2) to step 6, decaying over steps 7-8; saved at 4."""
COOLDOWN = ["train.max_steps=7", "train.decay_steps=7", "train.wsd_decay_steps=3"]
"""The branch's own schedule: a linear decay from the branch point (step 4's rate is the
last of the stable phase, as in Megatron's and OLMo-core's WSD)."""


def config(run_dir, cache_dir, *overrides):
    base = [*PARENT, f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}"]
    return load_config(MICRO, [*base, *overrides])


def logged(run_dir, key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in metrics(run_dir) if key in row}


@pytest.fixture
def signals_restored():
    """`main(["train", ...])` ignores stop signals once it returns: undone for pytest."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield
    for sig, handler in kept.items():
        signal.signal(sig, handler)


def test_branch_continues_its_parent(tmp_path, cache_dir, signals_restored):
    """A branch of step 4 with the parent's config logs the parent's losses at steps 5-8,
    bit for bit; a cooldown branch logs the parent's loss at step 5 (the same weights and
    data) at its own schedule's rate, then its own losses; each records its parent; a
    restart of the branch resumes its own checkpoint; model and data changes are exit 2."""
    parent = train(config(tmp_path / "parent", cache_dir))
    step4 = tmp_path / "parent" / "checkpoints" / "step_000004"
    same = train(config(tmp_path / "same", cache_dir, f"checkpoint.branch={step4}"))
    assert list(same.losses) == [5, 6, 7, 8]
    assert [same.losses[s] for s in (5, 6, 7, 8)] == [parent.losses[s] for s in (5, 6, 7, 8)]
    assert logged(tmp_path / "same", "lr") == {s: logged(tmp_path / "parent", "lr")[s]
                                               for s in (5, 6, 7, 8)}  # fmt: skip

    cooldown_cfg = config(tmp_path / "cooldown", cache_dir, *COOLDOWN, f"checkpoint.branch={step4}")
    cooldown = train(cooldown_cfg)
    assert list(cooldown.losses) == [5, 6, 7]
    assert cooldown.losses[5] == parent.losses[5]  # weights and batch of the parent's step 5
    assert cooldown.losses[6] == parent.losses[6]  # step 5: the decay's first rate is lr
    assert cooldown.losses[7] != parent.losses[7]  # step 6 trained at its own, lower rate
    schedule, base = LRSchedule(cooldown_cfg.train), cooldown_cfg.train.lr
    lr = logged(tmp_path / "cooldown", "lr")
    assert lr == pytest.approx({s: base * schedule(s - 1) for s in (5, 6, 7)}, rel=1e-12)
    parent_lr = logged(tmp_path / "parent", "lr")
    assert lr[5] == parent_lr[5] and lr[6] < parent_lr[6] == parent_lr[5]  # parent: stable
    assert lr[7] < lr[6]

    record = {
        "checkpoint": str(step4.resolve()), "run_dir": str((tmp_path / "parent").resolve()),
        "step": 4,
        "git_commit": json.loads((tmp_path / "parent" / "environment.json").read_text())[
            "git_commit"
        ],
    }  # fmt: skip
    environment = json.loads((tmp_path / "cooldown" / "environment.json").read_text())
    assert environment["branch_of"] == record
    starts = (tmp_path / "cooldown" / "starts.jsonl").read_text().splitlines()
    assert [json.loads(line).get("branch_of") for line in starts] == [record]

    # run again, the branch resumes its own step 7: nothing left to do, a plain start logged
    command = ["train", "--config", MICRO, "--branch", str(step4), *PARENT, *COOLDOWN]
    own = [f"run.output_dir={tmp_path / 'cooldown'}", f"run.cache_dir={cache_dir}"]
    assert main([*command, *own]) == 0
    starts = (tmp_path / "cooldown" / "starts.jsonl").read_text().splitlines()
    assert [json.loads(line).get("branch_of") for line in starts] == [record, None]
    assert json.loads(starts[1])["step"] == 7

    # changes of the model or the data order, and a branch into its parent's own directory
    # (the parent's config taken from the checkpoint: no --config)
    branch = ["train", "--branch", str(step4), f"run.output_dir={tmp_path / 'bad'}"]
    assert main([*branch, "model.hidden_size=32"]) == BAD_INPUT
    assert main([*branch, "data.seed=7"]) == BAD_INPUT
    assert main([*branch, "train.global_batch_size=16"]) == BAD_INPUT
    assert main(["train", "--branch", str(step4)]) == BAD_INPUT
    assert not (tmp_path / "bad" / "checkpoints").exists()
    for overrides, key in [
        (["model.hidden_size=32"], "model.hidden_size"),
        (["data.seed=7"], "data.seed"),
        ([f"run.output_dir={tmp_path / 'parent'}"], "a run directory of its own"),
        (["checkpoint.resume=never"], "checkpoint.resume=auto"),
    ]:
        bad = config(tmp_path / "bad", cache_dir, f"checkpoint.branch={step4}", *overrides)
        with pytest.raises(BadInput, match=key):
            train(bad)
