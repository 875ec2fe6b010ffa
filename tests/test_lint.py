"""Linters over the whole repository, as part of the test run: ruff (lint and format),
shellcheck on every shell script, hadolint on every Dockerfile."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tool(name: str) -> str | None:
    """A linter from this environment (setup.sh --dev), else from PATH."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    return [ROOT / name for name in out.stdout.split("\0") if name]


def shell_scripts() -> list[Path]:
    """Tracked files with a bash or sh shebang (setup.sh, .ci/run, *.sh, *.sbatch)."""
    scripts = []
    for path in tracked_files():
        if path.is_file():
            with path.open("rb") as f:
                if re.match(rb"#!.*\b(ba)?sh\s*$", f.readline()):
                    scripts.append(path)
    return scripts


def lint(command: list[str]) -> None:
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(tool("ruff") is None, reason="ruff is not installed (bash setup.sh --dev)")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=" ".join)
def test_ruff(command):
    lint([tool("ruff"), *command, str(ROOT)])


@pytest.mark.skipif(tool("shellcheck") is None, reason="needs shellcheck (bash setup.sh --dev)")
def test_shellcheck():
    scripts = shell_scripts()
    assert ROOT / "setup.sh" in scripts and ROOT / "slurm/pretrain.sbatch" in scripts
    lint([tool("shellcheck"), *map(str, scripts)])


@pytest.mark.skipif(tool("hadolint") is None, reason="needs hadolint (bash setup.sh --dev)")
def test_hadolint():
    dockerfiles = [p for p in tracked_files() if "Dockerfile" in p.name]
    assert ROOT / "docker/Dockerfile" in dockerfiles
    lint([tool("hadolint"), *map(str, dockerfiles)])
