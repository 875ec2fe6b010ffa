"""`belief-lm launch slurm`: render the sbatch template (`launcher/pretrain.sbatch`, package
data; `slurm/pretrain.sbatch` in a checkout) from a run's `launch:` section and submit it.

Rendering replaces the template's #SBATCH lines, its settings block (between
`# >>> settings` and `# <<< settings`) and its exit codes (between `# >>> exit codes` and
`# <<< exit codes`, written from belief_lm.exit_codes: the template's own copy, for
`sbatch slurm/pretrain.sbatch ...` by hand, is held equal to them by a test); everything
else runs as written, so a rendered script and the template behave the same.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from belief_lm import exit_codes

if TYPE_CHECKING:
    from belief_lm.config import Config

TEMPLATE = Path(__file__).with_name("pretrain.sbatch")
"""Shipped inside the package, so an installed belief-lm (not only a checkout) finds it."""
_SETTINGS = re.compile(r"^# >>> settings\n.*?^# <<< settings\n", re.M | re.S)
_EXIT_CODES = re.compile(r"^# >>> exit codes\n.*?^# <<< exit codes\n", re.M | re.S)


class SubmitError(RuntimeError):
    """sbatch could not be run, or refused the job (the message says why)."""


def exit_code_settings() -> str:
    """The template's exit-code block: the codes the job script acts on, from
    belief_lm.exit_codes."""
    not_restarted = " ".join(map(str, exit_codes.NOT_RESTARTED))
    return (
        "# >>> exit codes\n"
        f"REQUEUE_EXIT_CODE={exit_codes.PREEMPTED} # PREEMPTED: saved on a stop request; "
        "run again and it resumes\n"
        f"PEER_LOST_EXIT_CODE={exit_codes.PEER_LOST} # PEER_LOST: another task was lost "
        "(silent or dead)\n"
        f"NOT_RESTARTED=({not_restarted}) # NOT_RESTARTED: ends that a restart in place would "
        "not change\n"
        "# <<< exit codes\n"
    )


def log_dir(cfg: Config) -> Path:
    """Where the job's log and rendered script go."""
    return Path(cfg.launch.log_dir or Path(cfg.run.output_dir) / "slurm")


def sbatch_options(cfg: Config) -> list[str]:
    """The #SBATCH options for this run, from its `launch:` section."""
    launch = cfg.launch
    options = [
        f"--job-name={job_name(cfg)}",
        f"--nodes={launch.nodes}"
        if launch.min_nodes in (None, launch.nodes)
        else f"--nodes={launch.min_nodes}-{launch.nodes}",
        f"--ntasks-per-node={launch.tasks}",
    ]
    optional = {
        "gpus-per-node": launch.gpus_per_node or None,
        "cpus-per-task": launch.cpus_per_task,
        "partition": launch.partition,
        "account": launch.account,
    }
    options += [f"--{key}={value}" for key, value in optional.items() if value is not None]
    options.append(f"--time={launch.time_minutes}")
    if launch.signal_seconds:
        # B: only the batch shell gets it; the template forwards it to the tasks and then
        # decides about requeueing once they have stopped.
        options.append(f"--signal=B:USR1@{launch.signal_seconds}")
    options += [
        "--requeue",
        "--open-mode=append",  # a requeued job appends to the same log
        f"--output={log_dir(cfg)}/%x-%j.out",
        *launch.sbatch_options,
    ]
    return options


def render(cfg: Config, train_args: list[str], command: str | None = None) -> str:
    """The sbatch script for `belief-lm train <train_args>` with this config's settings.

    `command` is what runs `belief-lm` on the nodes: by default this interpreter's
    environment's console script (the same shared path on every node), or plain `belief-lm`
    inside a container image.
    """
    launch = cfg.launch
    if command is None:
        command = "belief-lm" if launch.container_image else _console_script()
    settings = [
        "# >>> settings (rendered by belief-lm launch slurm)",
        f"BELIEF_LM={shlex.quote(command)}",
        f"TRAIN_ARGS=({shlex.join(train_args)})",
        f"CONTAINER_IMAGE={shlex.quote(launch.container_image or '')}",
        f"CONTAINER_MOUNTS={shlex.quote(','.join(launch.container_mounts))}",
        f"MAX_RESTARTS={launch.max_restarts}",
        f"FAILURE_RESTARTS={launch.failure_restarts}",
        *(f"export {key}={shlex.quote(value)}" for key, value in launch.env.items()),
        "# <<< settings",
    ]
    lines = TEMPLATE.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    body = [line for line in lines if not line.startswith("#SBATCH")]
    body[first:first] = [f"#SBATCH {option}" for option in sbatch_options(cfg)]
    script = "\n".join(body) + "\n"
    for name, block, text in (
        ("settings", _SETTINGS, "\n".join(settings) + "\n"),
        ("exit codes", _EXIT_CODES, exit_code_settings()),
    ):
        script, count = block.subn(lambda _, text=text: text, script)
        if count != 1:
            raise RuntimeError(f"{TEMPLATE} has no {name} block to fill in")
    return script


def submit(cfg: Config, script: str) -> tuple[int, Path]:
    """Submit the script with sbatch; returns the job id and the job's log file, beside
    which the submitted script is kept (<job name>-<job id>.sbatch). SubmitError if sbatch
    cannot be run or refuses the job."""
    logs = log_dir(cfg)
    try:
        logs.mkdir(parents=True, exist_ok=True)  # SLURM does not create the log directory
        out = subprocess.run(
            ["sbatch", "--parsable"], input=script, capture_output=True, text=True, timeout=60
        )
        if out.returncode:
            raise SubmitError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
        job_id = int(out.stdout.strip().split(";")[0])  # "JOBID" or "JOBID;CLUSTER"
        name = f"{job_name(cfg)}-{job_id}"
        (logs / f"{name}.sbatch").write_text(script)
    except OSError as err:  # no sbatch here, or the log directory cannot be written
        raise SubmitError(str(err)) from err
    return job_id, logs / f"{name}.out"


def job_name(cfg: Config) -> str:
    """The SLURM job name: launch.job_name, or belief-lm-<model name>."""
    return cfg.launch.job_name or f"belief-lm-{cfg.model.name}"


def _console_script() -> str:
    script = Path(sys.executable).with_name("belief-lm")
    return str(script.absolute()) if script.exists() else "belief-lm"
