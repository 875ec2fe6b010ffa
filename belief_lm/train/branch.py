"""Branches: a run that starts from another run's checkpoint (`belief-lm train --branch`).

A branch continues its parent exactly as a resume would (weights, optimizer state, RNG
states, data position, step, spike history), in a run directory of its own, and may change
what changes neither the model, the tokenizer nor the data order: the learning-rate
schedule (a WSD cooldown from a stable-phase checkpoint), the optimizer's settings, the
run's length, logging and checkpointing, the layout as a resume may. `checkpoint.branch`
names the parent checkpoint; pre-flight (`belief_lm.preflight.resume_from`) refuses a
branch whose model, data or global batch differ from the parent's, naming each key. Once
the branch saved a checkpoint of its own, a restart resumes that one.

A resume keeps the schedule it was saved with (LambdaLR's state holds the schedule's
numbers and the base rate), so `take_settings` puts this config's schedule and optimizer
settings in place of the parent's after the load: the branch's first step runs at its
own schedule's rate for that step.
"""

from __future__ import annotations

import json
from pathlib import Path

from belief_lm import compat
from belief_lm.config import TrainConfig
from belief_lm.train.optim import LRSchedule


def parent_record(checkpoint: Path) -> dict:
    """Where a branch comes from: {"checkpoint", "run_dir", "step", "git_commit"} (the
    commit the parent run's environment.json names; None where the checkpoint was moved
    out of its run directory)."""
    from belief_lm.checkpoint.files import read_info

    checkpoint = Path(checkpoint).expanduser().resolve()
    run_dir = checkpoint.parent.parent  # <run>/checkpoints/step_N
    environment = run_dir / "environment.json"
    commit = None
    if environment.is_file():
        try:
            commit = json.loads(environment.read_text()).get("git_commit")
        except (ValueError, AttributeError):  # a damaged record: the commit is unknown
            commit = None
    return {
        "checkpoint": str(checkpoint),
        "run_dir": str(run_dir),
        "step": read_info(checkpoint).step,
        "git_commit": commit,
    }


def take_settings(engine, train: TrainConfig) -> None:
    """After the parent's checkpoint is loaded into DeepSpeed's `engine`: this config's
    learning-rate schedule (train.lr, lr_schedule, warmup, decay, min_lr) at the loaded
    step, and its AdamW settings (betas, eps, weight decay), in place of those the
    checkpoint restored."""
    scheduler, optimizer = engine.lr_scheduler, engine.optimizer
    schedule = LRSchedule(train)
    for restored in scheduler.lr_lambdas:  # LambdaLR's state restored the parent's numbers
        restored.__dict__.update(schedule.__dict__)
    multiplier = schedule(scheduler.last_epoch)
    scheduler.base_lrs = [train.lr] * len(optimizer.param_groups)
    for index, group in enumerate(optimizer.param_groups):
        group["initial_lr"] = train.lr
        group["lr"] = train.lr * multiplier  # the rate of the coming step (engine.get_lr)
        group["betas"], group["eps"] = (train.beta1, train.beta2), train.eps
        # optim.param_groups: the matrices first, then the biases and gains (never decayed)
        group["weight_decay"] = train.weight_decay if index == 0 else 0.0
    compat.set_last_lr(scheduler, [group["lr"] for group in optimizer.param_groups])
