"""Checkpoints of the layouts the trainer writes, saved by real training runs: one 4-rank
job (tests/checkpoint/save_layouts.py) runs `belief-lm train` on configs/test/micro.yaml
(6 steps) once per layout, recording the weights DeepSpeed held at each save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.jobs import ROOT, job_env, run_job, torchrun_command

STEPS = 6
PPL_DOCS = [  # each shorter than the 32-token context: one rolling window per document
    "The for statement is used to iterate over the elements of a sequence.",
    "A class definition defines a class object.",
    "The return statement leaves the current function call.",
]
EVALUATED = ["train.eval_interval=6", "train.eval_batches=2"]
"""Validation loss at the last step on 2 held-out micro-batches per data-parallel rank."""
RUNS = {  # name -> overrides
    # consumed by every command in fresh processes (test_consumers.py)
    "tp2-pp2-zero1": [
        "parallel.tensor=2", "parallel.pipeline=2", "parallel.zero_stage=1",
        "checkpoint.interval=3", "train.eval_tasks_interval=3", "run.tensorboard=true",
        *EVALUATED,
    ],
    "tp2-dp2-zero3": ["parallel.tensor=2", "parallel.zero_stage=3", *EVALUATED],
    # module weights (no optimizer partitions), pipeline layer files, an output layer
    "tp2-pp2-zero0-untied": [
        "parallel.tensor=2", "parallel.pipeline=2", "parallel.zero_stage=0",
        "model.tie_embeddings=false",
    ],
    # bf16: DeepSpeed's bf16 optimizer (ZeRO 0/1/2) or ZeRO-3 keep fp32 masters
    "bf16-dp4-zero1": ["train.precision=bf16", "parallel.zero_stage=1"],
    "bf16-dp4-zero2": ["train.precision=bf16", "parallel.zero_stage=2"],
    "bf16-tp2-pp2-zero1": [
        "train.precision=bf16", "parallel.tensor=2", "parallel.pipeline=2", "parallel.zero_stage=1",
    ],
    "bf16-pp2-dp2-zero0": ["train.precision=bf16", "parallel.pipeline=2", "parallel.zero_stage=0"],
    "bf16-tp2-dp2-zero3": ["train.precision=bf16", "parallel.tensor=2", "parallel.zero_stage=3"],
    # bf16 at ZeRO-0 without a pipeline: DeepSpeed updates the bf16 weights, keeps no master
    "bf16-tp2-dp2-zero0": ["train.precision=bf16", "parallel.tensor=2", "parallel.zero_stage=0"],
}  # fmt: skip
WITH_TASKS = ("tp2-pp2-zero1", "tp2-dp2-zero3")
"""Runs that evaluate the tiny_ppl task during training (train.eval_tasks)."""


def write_ppl_task(folder: Path) -> Path:
    """A local lm-eval task: bits per byte of PPL_DOCS (read from a JSON lines file)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ppl.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in PPL_DOCS))
    task = folder / "tiny_ppl.yaml"
    task.write_text(
        f"task: tiny_ppl\ndataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {folder / 'ppl.jsonl'}}}}}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list: [{metric: bits_per_byte}, {metric: word_perplexity}]\n"
    )
    return task


@pytest.fixture(scope="session")
def saved_layouts(tmp_path_factory, cache_dir) -> dict[str, Path]:
    """Run directory of each of RUNS, after one torchrun job of 4 ranks."""
    root = tmp_path_factory.mktemp("layouts")
    task = write_ppl_task(root / "tasks")
    runs = {name: [*overrides] for name, overrides in RUNS.items()}
    for name in WITH_TASKS:
        runs[name].append(f"train.eval_tasks=[{task}]")
    spec = {"cache": cache_dir, "runs": {str(root / name): o for name, o in runs.items()}}
    (root / "runs.json").write_text(json.dumps(spec))
    command = torchrun_command(4, "tests/checkpoint/save_layouts.py", str(root / "runs.json"))
    done = run_job(command, 540, cwd=ROOT, env=job_env({"HF_HUB_OFFLINE": "1"}))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return {name: root / name for name in RUNS}


def checkpoint(run_dir: Path, step: int = STEPS) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
