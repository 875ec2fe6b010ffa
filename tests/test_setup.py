"""setup.sh's offline path, end to end: a wheelhouse (from PyPI), installed with the index
disabled (and, as root, in a network namespace without any network) into a fresh venv over
a "system" torch, which then trains 5 steps. Twice:

- for this machine's Python, over this environment's own torch: a directory of links to
  torch and everything it needs, on PYTHONPATH, as a preinstalled torch sits in a base
  image's site-packages. pyarrow is offered the same way and named with --have, so the
  wheelhouse leaves it out;
- for the GPU machines' image (Python 3.12, PyPI's CUDA torch 2.11, the versions the device
  tool's KINDS.md gives), built from this Python 3.11 with --python-version/--platform and
  the image's `pip freeze` as --have; the install then also runs `bench/gpu.py --smoke`."""

from __future__ import annotations

import glob
import json
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from belief_lm.report import read_jsonl
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
    """Link the installed distributions `names` and their dependencies into `into`, the
    dependencies of the extras they are required with included (PyPI's CUDA torch needs
    cuda-toolkit[cudart, ...], whose extras bring the CUDA libraries)."""
    todo, seen = [(name, frozenset()) for name in names], set()
    while todo:
        name, extras = todo.pop()
        dist = metadata.distribution(name)
        key = (dist.metadata["Name"].lower(), extras)
        if key in seen:
            continue
        seen.add(key)
        site = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or ()} - {"..", "__pycache__"}
        for top in tops:
            if (site / top).exists() and not (into / top).exists():
                (into / top).symlink_to(site / top)
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append((req.name, frozenset(req.extras)))


def download_wheels(wheels: Path, env: dict, *options: str) -> list[str]:
    """setup.sh --download-wheels (online), with this environment's torch for DeepSpeed's
    build; the wheel names, after the checks every wheelhouse must pass."""
    run(
        ["bash", "setup.sh", "--download-wheels", str(wheels), *options],
        {**env, "VENV": sys.prefix},
        timeout=600,
    )
    names = sorted(p.name for p in wheels.glob("*.whl"))
    assert any(re.match(r"deepspeed-.*-py3-none-any\.whl", n) for n in names), names
    assert any(n.startswith("megatron_core-0.16") for n in names), names
    assert not [n for n in names if re.match(r"(torch|pyarrow|nvidia|triton)[-_]", n)], names
    listing = (wheels / "wheelhouse.txt").read_text()
    assert all(n in listing for n in names) and f"{len(names)} wheels" in listing
    return names


def install_offline_and_train(
    wheels: Path, python: str, system: str, tmp: Path, env: dict, on_path: bool = True
):
    """A fresh venv from `python` over the torch in `system` (site-packages: on PYTHONPATH,
    or `python`'s own when `on_path` is false), installed from `wheels` alone, trains 5
    steps offline; the offline environment and the venv."""
    venv, run_dir = tmp / "venv", tmp / "run"
    offline = {**env, "PYTHONPATH": system} if on_path else env
    out = run(
        ["bash", "setup.sh", "--wheelhouse", str(wheels)],
        {**offline, "PYTHON": python, "VENV": str(venv)},
        timeout=600,
        offline=True,
    )
    assert "installed offline from" in out.stdout
    # one line: what pip and the libraries print goes to the venv's setup.log
    assert len((out.stdout + out.stderr).strip().splitlines()) == 1, out.stdout + out.stderr
    where = run(
        [str(venv / "bin/python"), "-c", "import torch, deepspeed; "
         "print(torch.__file__); print(deepspeed.__file__)"],
        offline, timeout=120,
    ).stdout.split()  # fmt: skip
    assert where[0].startswith(system) and where[1].startswith(str(venv))
    run(
        [
            # a fresh cache: a small tokenizer is trained in a moment
            str(venv / "bin/belief-lm"), "train", "--config", MICRO,
            "data.tokenizer.vocab_size=512", "train.max_steps=5",
            f"run.output_dir={run_dir}", f"run.cache_dir={tmp / 'cache'}",
        ],
        offline, timeout=600, offline=True,
    )  # fmt: skip
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    return offline, venv


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_offline_install_from_a_wheelhouse_trains(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheelhouse")
    try:
        wheels, system = tmp / "wheels", tmp / "system"
        system.mkdir()
        expose(["torch", "pyarrow"], system)
        have = tmp / "have.txt"
        have.write_text(f"pyarrow=={metadata.version('pyarrow')}\n")
        env = setup_env()
        download_wheels(wheels, env, "--have", str(have))
        base_python = getattr(sys, "_base_executable", sys.executable)
        install_offline_and_train(wheels, base_python, str(system), tmp, env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a venv and ~100 MB of wheels


IMAGE_PYTHON, IMAGE_TORCH = "3.12", "2.11.0"
"""The GPU machines' image (the device tool's KINDS.md): Python 3.12, PyPI's CUDA torch 2.11."""
IMAGE_PACKAGES = ["sentencepiece", "tensorboard", "transformers", "pyarrow"]
"""What else the image has preinstalled."""


def python_at(version: str) -> str | None:
    """An interpreter of Python `version` that runs: on PATH, or one of pyenv's."""
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(glob.glob(str(Path.home() / f".pyenv/versions/{version}.*/bin/python3")))
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    return None


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_wheelhouse_for_the_gpu_image_installs_over_its_torch(tmp_path_factory):
    """The GPU issue's case, rehearsed on the CPU: the wheelhouse built here (Python 3.11)
    for Python 3.12 on manylinux_2_28, with the image's `pip freeze` as --have, installs
    offline over the image's torch 2.11, trains 5 steps and runs bench/gpu.py --smoke."""
    python = python_at(IMAGE_PYTHON)
    if python is None:  # every machine of this workplace has pyenv's 3.12 (the env notes)
        pytest.skip(f"no Python {IMAGE_PYTHON} here to stand in for the GPU image")
    tmp = tmp_path_factory.mktemp("image")
    try:
        env = setup_env()
        image = tmp / "image"  # the image's Python: a venv holding torch, as /opt/torch/.venv
        run([python, "-m", "venv", str(image)], env, timeout=120)
        packages = [f"torch=={IMAGE_TORCH}", *IMAGE_PACKAGES]
        run([str(image / "bin/pip"), "install", "-q", *packages], env, timeout=900)
        have = tmp / "have.txt"
        have.write_text(run([str(image / "bin/pip"), "freeze"], env, timeout=120).stdout)
        site = glob.glob(str(image / "lib/python*/site-packages"))[0]

        wheels = tmp / "wheels"
        platform = ["--platform", "manylinux_2_28_x86_64"]
        options = ["--python-version", IMAGE_PYTHON, *platform, "--have", str(have)]
        names = download_wheels(wheels, {**env, "WHEEL_PYTHON": python}, *options)
        tags = {name.split("-")[-3] for name in names}  # name-version-python-abi-platform
        assert tags <= {"py3", "py2.py3", "cp36", "cp312", "py312"}, tags  # the image's only
        assert not [n for n in names if n.startswith(("sentencepiece", "transformers"))]
        listing = (wheels / "wheelhouse.txt").read_text()
        assert float(re.search(r"wheels, ([\d.]+) MiB", listing).group(1)) < 60, listing

        # the venv's own python, as on the H200: a venv made from it must still see its torch
        image_python = str(image / "bin/python")
        offline, venv = install_offline_and_train(wheels, image_python, site, tmp, env, False)
        smoke = tmp / "smoke.json"
        subset = ["--models", "gpt2-124m", "--attentions", "softmax", "belief_star"]
        command = [str(venv / "bin/python"), "bench/gpu.py", "--smoke", "--out", str(smoke)]
        run([*command, *subset, "--option", "plain"], offline, timeout=600, offline=True)
        result = json.loads(smoke.read_text())
        assert result["packages"]["torch"] == IMAGE_TORCH
        assert result["correctness"]["bf16_vs_fp32"]["pass"]
        assert [r["attention"] for r in result["runs"]] == ["softmax", "belief_star"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # 5 GB: the image's CUDA torch


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
