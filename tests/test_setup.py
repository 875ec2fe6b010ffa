"""setup.sh's offline path, end to end: a wheelhouse for this machine's Python (from PyPI),
installed with the index disabled (and, as root, in a network namespace without any network)
into a fresh venv over a "system" torch, which then trains 5 steps.

The system torch is this environment's own: a directory of links to torch and everything it
needs, on PYTHONPATH, as a preinstalled torch sits in a base image's site-packages. pyarrow
is offered the same way and named with --have, so the wheelhouse leaves it out."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.jobs import MICRO, ROOT, job_env


def setup_env(**extra: str) -> dict[str, str]:
    """The environment setup.sh runs in: tests.jobs.job_env (none of the rendezvous variables
    of the test process, DeepSpeed on the CPU) without pip's settings or an active venv,
    which would point the install elsewhere."""
    env = {k: v for k, v in job_env().items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    return {**env, **extra}


def run(command: list[str], env: dict, timeout: float, offline: bool = False):
    """Run `command` (in a network namespace with only loopback, when `offline` and
    possible); fail with its output."""
    if offline and shutil.which("unshare"):
        probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=30)
        if probe.returncode == 0:  # root: no route anywhere, loopback up for gloo
            namespace = ["unshare", "--net", "sh", "-c", 'ip link set lo up; exec "$@"', "sh"]
            command = [*namespace, *command]
    out = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def expose(names: list[str], into: Path) -> None:
    """Link the installed distributions `names` and their dependencies into `into`."""
    todo, seen = list(names), set()
    while todo:
        dist = metadata.distribution(todo.pop())
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        site = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or ()} - {"..", "__pycache__"}
        for top in tops:
            if (site / top).exists() and not (into / top).exists():
                (into / top).symlink_to(site / top)
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_offline_install_from_a_wheelhouse_trains(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheelhouse")
    try:
        wheels, system, venv, run_dir = (tmp / n for n in ("wheels", "system", "venv", "run"))
        system.mkdir()
        expose(["torch", "pyarrow"], system)
        have = tmp / "have.txt"
        have.write_text(f"pyarrow=={metadata.version('pyarrow')}\n")
        env = setup_env()

        # online: the wheelhouse, built with this environment's torch for DeepSpeed's build
        run(
            ["bash", "setup.sh", "--download-wheels", str(wheels), "--have", str(have)],
            {**env, "VENV": sys.prefix},
            timeout=600,
        )
        names = sorted(p.name for p in wheels.glob("*.whl"))
        assert any(re.match(r"deepspeed-.*-py3-none-any\.whl", n) for n in names), names
        assert any(n.startswith("megatron_core-0.16") for n in names), names
        assert not [n for n in names if re.match(r"(torch|pyarrow|nvidia|triton)[-_]", n)], names
        listing = (wheels / "wheelhouse.txt").read_text()
        assert all(n in listing for n in names) and f"{len(names)} wheels" in listing

        # offline: a fresh venv over the system torch, then 5 training steps
        offline = {**env, "PYTHONPATH": str(system)}
        base_python = getattr(sys, "_base_executable", sys.executable)
        out = run(
            ["bash", "setup.sh", "--wheelhouse", str(wheels)],
            {**offline, "PYTHON": base_python, "VENV": str(venv)},
            timeout=600,
            offline=True,
        )
        assert "installed offline from" in out.stdout
        where = run(
            [str(venv / "bin/python"), "-c", "import torch, deepspeed; "
             "print(torch.__file__); print(deepspeed.__file__)"],
            offline, timeout=120,
        ).stdout.split()  # fmt: skip
        assert where[0].startswith(str(system)) and where[1].startswith(str(venv))
        run(
            [
                # a fresh cache: a small tokenizer is trained in a moment
                str(venv / "bin/belief-lm"), "train", "--config", MICRO,
                "data.tokenizer.vocab_size=512", "train.max_steps=5",
                f"run.output_dir={run_dir}", f"run.cache_dir={tmp / 'cache'}",
            ],
            offline, timeout=600, offline=True,
        )  # fmt: skip
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a venv and ~100 MB of wheels


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--python-version", "3.12"], "go with --download-wheels DIR"),
        (["--download-wheels", "w", "--dev"], "--download-wheels only writes a wheelhouse"),
        (["--wheelhouse", "w", "--dev"], "--dev needs the package index"),
        (["--wheelhouse"], "--wheelhouse needs a value"),
        (["--wheelhouse", "/nonexistent/wheels"], "--wheelhouse /nonexistent/wheels: no such"),
        (["--offline"], "unknown option '--offline'"),
    ],
)
def test_bad_options_fail_before_any_work(arguments, message, tmp_path):
    out = subprocess.run(
        ["bash", "setup.sh", *arguments],
        cwd=ROOT,
        env=setup_env(VENV=str(tmp_path / "venv")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (tmp_path / "venv").exists()
