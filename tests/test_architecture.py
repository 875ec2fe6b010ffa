"""The package structure the README's "How it fits together" describes, checked: imports
run one way, and what must be torch-free (pre-flight, configs) is."""

import ast
import subprocess
import sys
from collections import defaultdict
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("belief_lm", "data_pipeline", "launcher")


def imports_of(path: Path) -> set[str]:
    """Every module name `path` imports (at any depth, TYPE_CHECKING blocks included),
    relative imports resolved."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def sources(package: str) -> list[Path]:
    # the HF template is shipped code that runs outside belief-lm, never imported by it
    return [p for p in (ROOT / package).rglob("*.py") if "hf_template" not in p.parts]


def ours(names: set[str], prefix: str) -> set[str]:
    return {n for n in names if n == prefix or n.startswith(prefix + ".")}


def test_data_pipeline_imports_nothing_of_the_trainer_or_launcher():
    for path in sources("data_pipeline"):
        found = imports_of(path)
        assert not ours(found, "belief_lm") | ours(found, "launcher"), path


def test_job_submission_needs_only_the_config():
    for path in sources("launcher"):
        assert ours(imports_of(path), "belief_lm") <= {
            "belief_lm.config",
            "belief_lm.config.Config",
        }


def test_only_the_cli_reaches_job_submission():
    for path in sources("belief_lm"):
        if path.name != "cli.py":
            assert not ours(imports_of(path), "launcher"), path


def node_of(module: str) -> str:
    """A module's node in the package graph: its subpackage of belief_lm (model, train, ...)
    or, for a top-level module, the module itself (config, preflight, ...)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def is_module(name: str) -> bool:
    path = ROOT / Path(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def test_belief_lm_parts_import_one_way():
    """No cycle between belief_lm's subpackages and top-level modules (the CLI, the
    composition root that imports everything, aside)."""
    graph = defaultdict(set)
    for path in sources("belief_lm"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module == "belief_lm.cli":
            continue
        here = node_of(module.removesuffix(".__init__"))
        for name in ours(imports_of(path), "belief_lm"):
            target = node_of(name)
            # `from belief_lm import x` names belief_lm itself too: only real parts count
            if target not in (here, "belief_lm") and is_module(target):
                graph[here].add(target)
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as err:
        pytest.fail(f"import cycle between belief_lm's parts: {' -> '.join(err.args[1])}")


@pytest.mark.parametrize(
    "module",
    [
        "belief_lm.cli",
        "belief_lm.preflight",
        "belief_lm.plan",
        "belief_lm.config",
        "belief_lm.exit_codes",
        "belief_lm.logs",
        "belief_lm.report",
        "belief_lm.parallel.env",
        "launcher.slurm",
        "launcher.local",
    ],
)
def test_torch_free(module):
    """What runs before any work (argument parsing, configs, pre-flight, job submission on
    a login node) loads without torch."""
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60)
    assert done.returncode == 0, f"importing {module} imported torch"
