"""An installed belief-lm (a wheel, not the editable checkout) finds the files it ships:
the sbatch template `launch slurm` renders and the code a Hugging Face export copies."""

import shutil
import subprocess
import sys

import pytest

from tests.jobs import ROOT, job_env


@pytest.mark.slow
def test_a_wheel_install_carries_its_data_files(tmp_path):
    source = tmp_path / "source"  # building writes build/ and *.egg-info: not in the checkout
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "*.egg-info", "build")
    )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", source]
    subprocess.run(build, check=True, timeout=300, capture_output=True)
    wheel = next((tmp_path / "dist").glob("belief_lm-*.whl"))
    site = tmp_path / "site"
    install = [*pip, "install", "--no-deps", "--target", site, wheel]
    subprocess.run(install, check=True, timeout=300, capture_output=True)
    check = (
        "import launcher, belief_lm.export.hf as hf\n"
        "from belief_lm.config import load_config\n"
        "from launcher.slurm import render\n"
        f"assert launcher.__file__.startswith({str(site)!r}), launcher.__file__\n"
        "assert all(path.is_file() for path in hf.SHIPPED_CODE.values())\n"
        "print(render(load_config(None), ['--config', 'run.yaml']))\n"
    )
    env = job_env({"PYTHONPATH": str(site)})  # the wheel's packages first, not the checkout
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "#SBATCH --nodes=1" in done.stdout and "REQUEUE_EXIT_CODE=75" in done.stdout
