"""docker/Dockerfile and docker/compose.yaml on a real Docker engine
(tests/infra/docker_engine.sh), on a base image built here since no registry is reachable."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from .conftest import HERE, IMAGE, ROOT, TINY_RUN, job_env, logged_steps, run

# the first test's set-up may wait minutes for the images (conftest.DockerEngine)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
USER_ID = 1001  # docker/Dockerfile's default


@pytest.fixture(scope="module")
def docker_env(docker_host):
    return job_env(DOCKER_HOST=docker_host, DOCKER_BUILDKIT="0")


@pytest.fixture(scope="module")
def image(docker_env):
    """The project's image on the CI base, built with the engine (conftest.DockerEngine)."""
    return IMAGE


def writable_dir(path: Path) -> Path:
    """A directory the image's user can write through a bind mount."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, USER_ID, USER_ID)
    return path


def test_image_runs_as_an_unprivileged_user(image, docker_env):
    out = run(["docker", "run", "--rm", "--entrypoint=id", image, "-u"], 60, env=docker_env)
    assert out.stdout.strip() == str(USER_ID)


def test_pretraining_in_a_container(image, docker_env, tmp_path):
    """The README's tiny pretraining, shortened, in a container with no network at all."""
    runs = writable_dir(tmp_path / "runs")
    out = run(
        [
            "docker",
            "run",
            "--rm",
            "--network=none",
            f"--volume={runs}:/opt/belief-lm/runs",
            image,
            "train",
            *TINY_RUN,
            "run.output_dir=runs/ci",
        ],
        timeout=600,
        env=docker_env,
    )
    assert "done: 4 steps" in out.stderr
    assert logged_steps(runs / "ci") == [2, 4]
    assert (runs / "ci/config.yaml").is_file() and (runs / "ci/tokenizer.model").is_file()


def test_two_containers_train_as_two_ranks(image, docker_env, tmp_path):
    """docker/compose.yaml: rank0 and rank1 on a private network train one job together;
    tensorboard serves the run they wrote."""
    runs = writable_dir(tmp_path / "runs")
    compose = [
        "docker-compose",
        "--project-name=blm-ci",
        f"--file={ROOT}/docker/compose.yaml",
        f"--file={HERE}/compose.ci.yaml",
    ]
    env = {
        **docker_env,
        "BELIEF_LM_IMAGE": image,
        "RUNS": str(runs),
        "RUN_NAME": "ci",
        "TRAIN_ARGS": " ".join([*TINY_RUN[2:], "run.tensorboard=true"]),
    }
    try:
        run([*compose, "up", "--detach"], timeout=120, env=env)
        ranks = [
            run([*compose, "ps", "-q", r], 60, env=env).stdout.strip() for r in ("rank0", "rank1")
        ]
        codes = run(["docker", "wait", *ranks], timeout=600, env=env)
        logs = {
            rank: run([*compose, "logs", "--no-color", rank], 60, env=env).stdout
            for rank in ("rank0", "rank1")
        }
        assert codes.stdout.split() == ["0", "0"], logs
        # both ranks ran to the end (neither could without the other); rank 0 logged
        assert logged_steps(runs / "ci") == [2, 4]
        assert re.search(r"done: 4 steps, loss [\d.]+ -> [\d.]+; run directory", logs["rank0"])
        assert tensorboard_lists(compose, env, "ci/tensorboard")
    finally:
        run([*compose, "down", "--volumes"], timeout=120, env=env)


def tensorboard_lists(compose: list[str], env: dict[str, str], run_name: str) -> bool:
    """Whether tensorboard (in its container) lists the run within a minute."""
    query = (
        "import urllib.request; "
        "print(urllib.request.urlopen('http://localhost:6006/data/runs').read().decode())"
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = run([*compose, "exec", "-T", "tensorboard", "python", "-c", query], 60, env=env)
        if run_name in out.stdout:
            return True
        time.sleep(2)
    return False
