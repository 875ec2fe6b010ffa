"""The package structure docs/architecture.md describes, checked: imports
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


def module_of(name: str) -> str:
    """The module an imported name is (`a.b`) or lives in (`a.b.NAME` -> `a.b`)."""
    while "." in name and not is_module(name):
        name = name.rsplit(".", 1)[0]
    return name


def test_job_submission_needs_only_the_config_and_exit_codes():
    """Job submission runs on a login node from the config alone: of belief_lm it imports
    the config and the exit codes (which it acts on), nothing else."""
    for path in sources("launcher"):
        reached = {module_of(name) for name in ours(imports_of(path), "belief_lm")}
        assert reached <= {"belief_lm", "belief_lm.config", "belief_lm.exit_codes"}, path


def in_commands(path: Path) -> bool:
    return path.is_relative_to(ROOT / "belief_lm" / "cli")


def test_only_the_commands_reach_job_submission():
    for path in sources("belief_lm"):
        if not in_commands(path):
            assert not ours(imports_of(path), "launcher"), path


def test_nothing_in_the_packages_imports_the_commands():
    """The commands (belief_lm/cli) sit beside the library: they import it, never the
    other way."""
    for package in PACKAGES:
        for path in sources(package):
            if not in_commands(path):
                assert not ours(imports_of(path), "belief_lm.cli"), path


def node_of(module: str) -> str:
    """A module's node in the package graph: its subpackage of belief_lm (model, train, ...)
    or, for a top-level module, the module itself (config, preflight, ...)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def is_module(name: str) -> bool:
    path = ROOT / Path(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def test_belief_lm_parts_import_one_way():
    """No cycle between belief_lm's subpackages and top-level modules (the commands, the
    composition root that imports everything, aside)."""
    graph = defaultdict(set)
    for path in sources("belief_lm"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if in_commands(path):
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


GRID_PACKAGE = ROOT / "belief_lm" / "parallel"
"""Where the process grid lives: the one place that makes and looks up process groups."""
GROUP_REACHES = {"parallel_state", "new_group", "Peers"}
"""megatron's group registry (parallel_state), torch's way of making a group, and ours of
naming one (belief_lm.parallel.peers.Peers)."""


def group_reaches(path: Path) -> list[str]:
    """Where `path` reaches process groups other than through a ProcessGrid it is handed:
    megatron's parallel_state (imported or named), torch's new_group, our group names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [getattr(node, "module", None) or "", *(a.name for a in node.names)]
            found |= {(node.lineno, n) for name in names for n in GROUP_REACHES if n in name}
        elif isinstance(node, ast.Attribute) and node.attr in GROUP_REACHES:
            found.add((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in GROUP_REACHES:
            found.add((node.lineno, node.id))
    return [f"line {line}: {name}" for line, name in sorted(found)]


def test_only_the_process_grid_reaches_process_groups():
    """Process groups have one owner, belief_lm.parallel.grid.ProcessGrid, handed to whoever
    needs a group: no code outside belief_lm/parallel/ (benchmarks included) looks groups
    up in megatron's parallel_state, makes one, or names one."""
    paths = [p for package in (*PACKAGES, "bench") for p in sources(package)]
    found = {
        str(path.relative_to(ROOT)): reaches
        for path in paths
        if not path.is_relative_to(GRID_PACKAGE) and (reaches := group_reaches(path))
    }
    assert not found, found


def test_the_group_check_sees_each_form(tmp_path):
    code = tmp_path / "x.py"
    code.write_text(
        "from megatron.core import parallel_state as ps\n"
        "import megatron.core.parallel_state\n"
        "import megatron.core as core\n"
        "core.parallel_state.get_data_parallel_rank(), dist.new_group(backend='gloo')\n"
        "from belief_lm.parallel.peers import Peers\n"
        "from torch.distributed import new_group\n"
    )
    assert group_reaches(code) == [
        "line 1: parallel_state",
        "line 2: parallel_state",
        "line 4: new_group",
        "line 4: parallel_state",
        "line 5: Peers",
        "line 6: new_group",
    ]


LIBRARIES = ("torch", "deepspeed", "megatron")
"""The libraries whose private parts only belief_lm/compat.py reaches, each reach checked
against the installed versions by tests/test_compat.py."""


def library_private_reaches(path: Path) -> list[str]:
    """Where `path` reaches a private name of torch, DeepSpeed or megatron-core through a
    name it imported: `from torch.x import _y`, `torch.cuda.memory._record_memory_history`,
    `ps._TENSOR_MODEL_PARALLEL_GROUP` (attributes of objects those return:
    private_attribute_reaches)."""
    tree = ast.parse(path.read_text())
    bound = imported(tree, LIBRARIES, lambda module: module.split(".")[0] in LIBRARIES)
    found = {(line, name) for name, line in bound.values()}  # the imports themselves,
    found |= {  # and `import torch._dynamo` (which binds torch)
        (node.lineno, alias.name) for node in ast.walk(tree) if isinstance(node, ast.Import)
        for alias in node.names if alias.name.split(".")[0] in LIBRARIES
    }  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            head, _, rest = (dotted(node) or "").partition(".")
            if head in bound:
                found.add((node.lineno, f"{bound[head][0]}.{rest}"))
    private = {(line, name) for line, name in found if any(map(is_private, name.split(".")))}
    return [f"line {line}: {name}" for line, name in sorted(private)]


COMPAT = ROOT / "belief_lm" / "compat.py"
"""The one module that reaches the libraries' private parts."""


def outside_compat(check) -> dict[str, list[str]]:
    """What `check` finds in each source file but compat.py (benchmarks included)."""
    paths = [p for package in (*PACKAGES, "bench") for p in sources(package) if p != COMPAT]
    return {str(path.relative_to(ROOT)): found for path in paths if (found := check(path))}


def test_only_compat_reaches_the_libraries_private_parts():
    """torch's, DeepSpeed's and megatron-core's private names are reached in
    belief_lm/compat.py alone, where tests/test_compat.py checks each against the installed
    versions (benchmarks included)."""
    found = outside_compat(library_private_reaches)
    assert not found, found
    assert library_private_reaches(COMPAT), "compat.py reaches nothing private: the check is blind"


def test_the_library_private_check_sees_each_form(tmp_path):
    code = tmp_path / "x.py"
    code.write_text(
        "import torch\n"
        "from megatron.core import parallel_state as ps\n"
        "from torch.distributed.distributed_c10d import _world\n"
        "import deepspeed.runtime._private as p, torch._dynamo\n"
        "torch.cuda.memory._dump_snapshot('x'), ps._GROUP, torch.cuda.memory.__name__\n"
        "engine._take_model_step\n"
    )
    assert library_private_reaches(code) == [
        "line 3: torch.distributed.distributed_c10d._world",
        "line 4: deepspeed.runtime._private",
        "line 4: torch._dynamo",
        "line 5: megatron.core.parallel_state._GROUP",
        "line 5: torch.cuda.memory._dump_snapshot",
    ]


PYTHON_UNDERSCORE_API = {"_replace", "_fields", "_asdict", "_make", "_field_defaults", "_exit"}
"""Names with a leading underscore that Python documents as public: namedtuple's methods and
fields (the underscore keeps them apart from the tuple's own fields) and os._exit."""


def private_attribute_reaches(path: Path) -> list[str]:
    """Where `path` reaches a private attribute of an object other than its own (`self`,
    `cls`): `scheduler._last_lr`, `self.engine._step`, `getattr(x, "_y")`. What
    library_private_reaches cannot see (the objects a library's calls return), and our own
    modules' private parts reached from another module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner, name = node.value, node.attr
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            if (dotted(node.func) or "") not in (*ATTRIBUTE_CALLS, "hasattr"):
                continue
            owner, name = node.args[0], getattr(node.args[1], "value", None)
        else:
            continue
        own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
        if is_private(name) and name not in PYTHON_UNDERSCORE_API and not own:
            found.add((node.lineno, f"{ast.unparse(owner)}.{name}"))
    return [f"line {line}: {name}" for line, name in sorted(found)]


def test_only_compat_reaches_private_attributes_of_other_objects():
    """No code but compat.py reads or sets a private attribute of an object it was handed or
    a call returned (a scheduler's, DeepSpeed's engine's, another module's): such a reach
    breaks silently when the library changes, so it goes through compat.py, whose tests
    check it against the installed versions (benchmarks included)."""
    found = outside_compat(private_attribute_reaches)
    assert not found, found


def test_the_private_attribute_check_sees_each_form(tmp_path):
    code = tmp_path / "x.py"
    code.write_text(
        "scheduler._last_lr = [1.0]\n"
        "self.engine._take_model_step(), self._own, cls._also_own\n"
        "getattr(optimizer, '_state'), hasattr(value, '_fields'), setattr(x, '_y', 1)\n"
        "point._replace(x=1), os._exit(0), module.__name__, family._steps(True)\n"
    )
    assert private_attribute_reaches(code) == [
        "line 1: scheduler._last_lr",
        "line 2: self.engine._take_model_step",
        "line 3: optimizer._state",
        "line 3: x._y",
        "line 4: family._steps",
    ]


def is_private(name: object) -> bool:
    # __file__ and the like are public; a name that is no string (setattr(m, x)) is unknown
    return isinstance(name, str) and name.startswith("_") and not name.endswith("__")


def is_ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES and is_module(module)


def dotted(node: ast.expr) -> str | None:
    """`a.b.c` of a chain of names, None for anything else (a call, a subscript)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def imported(tree: ast.Module, tops: tuple[str, ...], accept) -> dict[str, tuple[str, int]]:
    """The names a file binds by importing from packages `tops` (at any depth, under any
    alias; `from m import x` where accept(m)) -> (its full dotted name, the import's line)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in tops:  # `import a.b` binds a; `import a.b as c` binds c to a.b
                    full = alias.name if alias.asname else top
                    bound[alias.asname or top] = (full, node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and accept(node.module or ""):
            for a in node.names:
                bound[a.asname or a.name] = (f"{node.module}.{a.name}", node.lineno)
    return bound


def ours_bound(tree: ast.Module) -> dict[str, str]:
    """The names a file binds to something of our packages -> its full dotted name."""
    return {name: full for name, (full, _) in imported(tree, PACKAGES, is_ours).items()}


ATTRIBUTE_CALLS = ("setattr", "getattr", "delattr")
"""Functions that reach an attribute by its name: the builtins, and monkeypatch's setattr
and delattr (whatever the fixture is called)."""


def private_uses(path: Path) -> list[str]:
    """The private names of our packages' modules that `path` uses: `from ours import _x`,
    `module._x`, `setattr(module, "_x", ...)` and `monkeypatch.setattr("ours.module._x", ...)`."""
    tree = ast.parse(path.read_text())
    bound = ours_bound(tree)

    def module_of(expression: ast.expr) -> str | None:
        head, _, rest = (dotted(expression) or "").partition(".")
        module = ".".join(filter(None, [bound.get(head), rest]))
        return module if head in bound and is_ours(module) else None

    found = []  # (line, module, name): a name reached in one of our modules
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom) and not node.level and is_ours(node.module or ""):
            found += [(line, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Attribute):
            found.append((line, module_of(node.value), node.attr))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            if (dotted(node.func) or "").rsplit(".", 1)[-1] in ATTRIBUTE_CALLS:
                name = node.args[1]
                found.append((line, module_of(node.args[0]), getattr(name, "value", None)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            module, _, name = node.value.rpartition(".")  # monkeypatch.setattr("a.b._c", x)
            found.append((line, module if is_ours(module) else None, name))
    uses = {
        (line, f"{module}.{name}") for line, module, name in found if module and is_private(name)
    }
    return [f"line {line}: {name}" for line, name in sorted(uses)]


def test_tests_use_only_public_names():
    """A test that reaches a private name pins an implementation detail (and a helper that
    the test needs is an API the package lacks): tests go through what is public."""
    found = {
        str(path.relative_to(ROOT)): uses
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if (uses := private_uses(path))
    }
    assert not found, found


def test_the_private_name_check_sees_each_form(tmp_path):
    test = tmp_path / "test_x.py"
    test.write_text(
        "import belief_lm.train.loop\n"
        "import data_pipeline.sources as src\n"
        "from belief_lm import cli\n"
        "from belief_lm.train.loop import _private, train\n"
        "belief_lm.train.loop._a, src._b, cli._c, cli.main, cli.__file__, train._d\n"
        "monkeypatch.setattr(src, '_e', 1); monkeypatch.setattr('launcher.slurm._f', 1)\n"
    )
    assert private_uses(test) == [
        "line 4: belief_lm.train.loop._private",
        "line 5: belief_lm.cli._c",
        "line 5: belief_lm.train.loop._a",
        "line 5: data_pipeline.sources._b",
        "line 6: data_pipeline.sources._e",
        "line 6: launcher.slurm._f",
    ]


@pytest.mark.parametrize(
    "module",
    [
        "belief_lm.cli",
        "belief_lm.preflight",
        "belief_lm.plan",
        "belief_lm.description",
        "belief_lm.train.flops",
        "belief_lm.config",
        "belief_lm.exit_codes",
        "belief_lm.errors",
        "belief_lm.checkpoint.verify",
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
