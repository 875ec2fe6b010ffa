"""Real infrastructure for the tests in this folder: a 2-node SLURM cluster and a Docker
engine, started on this machine (as root) and torn down afterwards.

Without root or the packages (tests/infra/install.sh) these tests skip, so a developer's
laptop passes; under CI (CI set, as .ci/run does) a missing prerequisite fails instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import jobs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require(*tools: str) -> None:
    """Skip (fail under CI) unless running as root with every tool on PATH."""
    problems = [] if os.geteuid() == 0 else ["needs root"]
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        problems.append(f"missing {', '.join(missing)} (bash setup.sh --dev --infra)")
    if problems:
        reason = "infrastructure test: " + "; ".join(problems)
        if IN_CI:
            pytest.fail(reason + " -- CI must run it")
        pytest.skip(reason)


def run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run a command, failing the test with its output if it fails."""
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    if out.returncode:
        pytest.fail(f"{' '.join(command)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


@pytest.fixture(scope="session")
def slurm_cluster():
    """SLURM_CONF of a running 2-node cluster (node1, node2), stopped after the session."""
    require("slurmctld", "slurmd", "munged", "sbatch", "iptables")
    # not under pytest's private (0700) temporary directory: munged runs as user munge
    state = Path(tempfile.mkdtemp(prefix="belief-lm-slurm-"))
    state.chmod(0o755)
    script = str(HERE / "slurm_cluster.sh")
    try:
        run(["bash", script, "up", str(state)], timeout=120)
        yield state / "slurm.conf"
    finally:
        subprocess.run(["bash", script, "down", str(state)], timeout=120, check=False)
        shutil.rmtree(state, ignore_errors=True)


# A few steps of a 1-layer tiny model with 2 data-parallel ranks of 4 sequences each.
TINY_RUN = [
    "--config",
    "configs/tiny.yaml",
    "model.num_layers=1",
    "train.max_steps=4",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "run.log_interval=2",
    "run.tensorboard=false",
]


def job_env(**extra: str) -> dict[str, str]:
    """tests.jobs.job_env for a SLURM job or a container: without the rendezvous variables
    a test process may carry (the single-process fixtures export RANK, MASTER_ADDR, ...)."""
    return jobs.job_env(extra)


def logged_steps(run_dir: Path) -> list[int]:
    """Steps in a run directory's metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


DOCKER_TOOLS = ("dockerd", "docker", "docker-compose", "debootstrap")
IMAGE = "belief-lm:ci"
"""The project's image (docker/Dockerfile) on the CI base image."""
DOCKER_ENGINE = str(HERE / "docker_engine.sh")


class DockerEngine:
    """A private dockerd holding the base image belief-lm-ci/base (debootstrap + torch) and
    the project's image, made in a background thread from the first test of this folder
    (on the xdist worker that runs the folder): its minutes (debootstrap, pip in the image
    builds; mostly waiting on the network and the disk) pass while the SLURM tests, which
    run first, and the other worker's tests run."""

    def __init__(self) -> None:
        self.state: Path | None = None
        self.made: Future | None = None

    def start(self) -> None:
        if self.made is None:
            self.state = Path(tempfile.mkdtemp(prefix="belief-lm-docker-"))
            self.made = ThreadPoolExecutor(1, thread_name_prefix="docker").submit(self._make)

    def _make(self) -> None:
        env = job_env(PYTHON=sys.executable)  # its pip finds torch as setup.sh's did
        run(["bash", DOCKER_ENGINE, "up", str(self.state)], timeout=120, env=env)
        run(["bash", DOCKER_ENGINE, "base", str(self.state)], timeout=900, env=env)
        build = ["docker", "build", "--quiet", "--network=host"]  # pip reaches PyPI as here
        build += ["--build-arg=BASE_IMAGE=belief-lm-ci/base", f"--tag={IMAGE}"]
        run([*build, "--file=docker/Dockerfile", "."], timeout=900, cwd=ROOT,
            env={**env, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "0"})  # fmt: skip

    @property
    def host(self) -> str:
        return f"unix://{self.state}/docker.sock"

    def ready(self) -> str:
        """DOCKER_HOST, once the engine and the images are there (raising what failed)."""
        self.start()
        self.made.result(timeout=1800)
        return self.host

    def stop(self) -> None:
        """Stop the engine and delete its state (after a build still going has ended)."""
        if self.made is not None:
            with contextlib.suppress(BaseException):
                self.made.result(timeout=1800)
            down = ["bash", DOCKER_ENGINE, "down", str(self.state)]
            subprocess.run(down, timeout=120, check=False)
            self.made = None


DOCKER = DockerEngine()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Docker tests last (after the SLURM tests and, without xdist, the rest), so the
    images are made meanwhile."""
    items.sort(key=lambda item: item.path.name == "test_docker.py")  # stable: only moves those


@pytest.fixture(scope="session", autouse=True)
def docker_images_made_meanwhile(request: pytest.FixtureRequest) -> None:
    """Start making the Docker engine and images if Docker tests are to run and can (at the
    first test of this folder: only the worker that runs this folder makes them)."""
    wanted = any(item.path.name == "test_docker.py" for item in request.session.items)
    if wanted and os.geteuid() == 0 and all(shutil.which(tool) for tool in DOCKER_TOOLS):
        DOCKER.start()


def pytest_sessionfinish() -> None:
    DOCKER.stop()  # also when the Docker tests never ran


@pytest.fixture(scope="session")
def docker_host():
    """DOCKER_HOST of the private dockerd (DockerEngine), stopped after the session."""
    require(*DOCKER_TOOLS)
    try:
        yield DOCKER.ready()
    finally:
        DOCKER.stop()
