"""Downstream evaluation during training: lm-evaluation-harness tasks (train.eval_tasks)
on the checkpoints the run saves, every train.eval_tasks_interval steps and at the end.

Right after such a save, rank 0 evaluates the checkpoint in a process of its own (`python
-m belief_lm.train.downstream`, belief_lm.inference.lm_eval_adapter.evaluate_tasks): the
consolidated fp32 weights at TP=1, so every layout works alike (TP, PP, ZeRO-3), and the
training process's process groups and engine are left as they are. That process needs
room for one more fp32 copy of the model on rank 0's device. The other ranks wait on a
gloo group for up to parallel.rank_zero_wait_s (ProcessGrid.rank_zero_first), not in a
collective bounded by parallel.timeout_s, while rank 0's heartbeat shows it alive. The
scores go to metrics.jsonl (keys `task/metric`, beside the validation loss) and
tensorboard (`downstream/task/metric`); lm-eval's whole results (standard errors
included) to run_dir/downstream/step_NNNNNN.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from belief_lm.config import TrainConfig
from belief_lm.parallel.grid import ProcessGrid

log = logging.getLogger("belief_lm.train")

JOB_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""torchrun's description of this job's processes: the evaluation process is not one."""


def due(train: TrainConfig, step: int) -> bool:
    """Whether train.eval_tasks run at `step` (given that a checkpoint was saved there)."""
    every = train.eval_tasks_interval
    return bool(train.eval_tasks) and (step == train.max_steps or bool(every and step % every == 0))


def check_tasks(tasks: list[str], grid: ProcessGrid) -> None:
    """Resolve `tasks` with lm-eval on rank 0 (collective over `grid`): ValueError on every
    rank for an unknown task or an unreadable task file, before the run starts."""

    def resolve() -> None:
        from belief_lm.inference.lm_eval_adapter import resolve_tasks

        resolve_tasks(tasks)

    grid.on_rank_zero(resolve)


def evaluate(
    train: TrainConfig, checkpoint: Path, device: str, run_dir: Path, grid: ProcessGrid
) -> dict[str, float] | None:
    """Run train.eval_tasks on `checkpoint` (collective over `grid`); its scores on rank 0,
    else None."""

    def run() -> dict[str, float]:
        output = run_dir / "downstream" / f"{checkpoint.name}.json"
        output.parent.mkdir(exist_ok=True)
        command = [
            sys.executable, "-m", "belief_lm.train.downstream", str(checkpoint), str(output),
            *train.eval_tasks, "--device", device, "--batch-size", str(train.micro_batch_size),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
        done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace")[-3000:]
            raise RuntimeError(f"train.eval_tasks on {checkpoint} failed:\n{tail}")
        return scalars(json.loads(output.read_text())["results"])

    log.info("running train.eval_tasks on %s", checkpoint)
    return grid.on_rank_zero(run)


def scalars(results: dict[str, dict]) -> dict[str, float]:
    """`task/metric` -> value for lm-eval's metrics (keyed `metric,filter`; a filter other
    than `none` is appended: `task/metric/filter`). Standard errors, and entries that are
    not metrics (alias, sample_len), are left to the JSON file."""
    flat = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, comma, filtered = key.partition(",")
            if comma and isinstance(value, int | float) and not metric.endswith("_stderr"):
                flat["/".join([task, metric] + [filtered] * (filtered != "none"))] = float(value)
    return flat


def main(argv: list[str] | None = None) -> None:
    """The evaluation process: lm-eval's results of the tasks on a checkpoint, as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("output", help="JSON file to write")
    parser.add_argument("tasks", nargs="+", help="lm-eval task names or task YAML files")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    from belief_lm.inference.lm_eval_adapter import evaluate_tasks

    results = evaluate_tasks(args.checkpoint, args.tasks, args.device, args.batch_size)
    record = {"checkpoint": args.checkpoint, "tasks": args.tasks, "results": results}
    Path(args.output).write_text(json.dumps(record, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
