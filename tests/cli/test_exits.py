"""belief_lm.cli.exits: the one table from an exception's type to the command's exit code and
what it says, and that our checks raise the types it lists."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from belief_lm import exit_codes
from belief_lm.checkpoint.files import CheckpointError
from belief_lm.cli.exits import ending, run
from belief_lm.config import load_config
from belief_lm.errors import (
    BadInput,
    DataStop,
    NonFiniteLossError,
    Preempted,
    SpikeStop,
)
from data_pipeline.errors import BadDataInput
from data_pipeline.sources import SourceError
from launcher.slurm import SubmitError

ROOT = Path(__file__).resolve().parents[2]


def raising(err: BaseException):
    def command(args):
        raise err

    return command


@pytest.mark.parametrize(
    ("err", "code", "says"),
    [
        (BadInput("--workers must be at least 1"), exit_codes.BAD_INPUT,
         "belief-lm: --workers must be at least 1\n"),
        (CheckpointError("checkpoint x is damaged"), exit_codes.BAD_INPUT,
         "belief-lm: checkpoint x is damaged\n"),
        (SourceError("uri", "no file"), exit_codes.BAD_INPUT, "belief-lm: uri: no file\n"),
        (BadDataInput("data.readers"), exit_codes.BAD_INPUT, "belief-lm: data.readers\n"),
        (NonFiniteLossError("5 steps"), exit_codes.FAILED, "belief-lm: 5 steps\n"),
        (SubmitError("sbatch failed (1): no"), exit_codes.FAILED,
         "belief-lm: sbatch failed (1): no\n"),
        (SpikeStop("3 spikes"), exit_codes.LOSS_SPIKES, "belief-lm: 3 spikes\n"),
        (DataStop("a.parquet row 7"), exit_codes.DATA_FAULT,
         "belief-lm: data fault: a.parquet row 7\n"),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else None,
)  # fmt: skip
def test_each_exception_ends_the_command_with_its_code_and_one_line(capsys, err, code, says):
    assert run(raising(err), None) == code
    assert capsys.readouterr().err == says


def test_a_stop_request_is_a_warning(caplog):
    assert run(raising(Preempted(7)), None) == exit_codes.PREEMPTED
    assert "stopped on request after step 7; checkpoint saved; exiting with 75" in caplog.text


@pytest.mark.parametrize("line", ["belief-lm: the all-reduce waited 60 s for rank 1", None])
def test_a_lost_peer_exits_at_once_with_its_line(line):
    """os._exit: a process group's destructor could wait forever on the silent rank."""
    code = (
        "from belief_lm.cli.exits import run\n"
        "from belief_lm.errors import PeerLost\n"
        "def command(args):\n"
        f"    raise PeerLost('lost', {line!r})\n"
        "run(command, None)\n"
        "print('not reached')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == exit_codes.PEER_LOST
    assert done.stderr == (f"{line}\n" if line else "") and done.stdout == ""


def test_a_library_value_error_is_a_failure_not_bad_input(capsys):
    """Exit code 2 says belief-lm's own checks refused the input before any work; a
    ValueError raised inside a library (here torch's) is a failure: raised on, for a
    traceback and exit code 1."""
    import torch

    def library_check(args):
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=-1)  # torch's own check

    with pytest.raises(ValueError, match="Invalid learning rate"):
        run(library_check, None)
    assert ending(ValueError("x")) is None and ending(KeyError("x")) is None
    assert run(lambda args: load_config(None, ["model.atention=x"]), None) == 2
    assert "model.atention: unknown key" in capsys.readouterr().err


VALIDATORS = {"model_validator", "field_validator"}


def called(node: ast.expr) -> str | None:
    """The name a decorator or call uses: `f`, `f(...)`, `m.f(...)` -> 'f'."""
    node = node.func if isinstance(node, ast.Call) else node
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)


def plain_value_errors(path: Path) -> list[str]:
    """`raise ValueError(...)` in `path` outside pydantic's validators (where pydantic turns
    it into the config's error naming the key): 'function:line' for each."""
    tree = ast.parse(path.read_text())
    validators = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any(called(decorator) in VALIDATORS for decorator in node.decorator_list)
    }
    validators |= {  # AfterValidator(function) in an Annotated type
        arg.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and called(node) == "AfterValidator"
        for arg in node.args
        if isinstance(arg, ast.Name)
    }
    innermost = {}  # line -> the function a raise is in
    for function in ast.walk(tree):  # breadth first: a nested function after its outer one
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.Raise) and node.exc and called(node.exc) == "ValueError":
                    innermost[node.lineno] = function.name
    return [f"{name}:{line}" for line, name in sorted(innermost.items()) if name not in validators]


NOT_INPUT_CHECKS = {
    "belief_lm/model/attention_layer.py": ["forward"],  # megatron calling it otherwise: a bug
    "belief_lm/model/gpt.py": ["forward"],  # a cache under sequence parallelism: our bug
    "belief_lm/checkpoint/consolidate.py": ["build_model"],  # a caller's mistake
    "belief_lm/checkpoint/manifest.py": ["read_manifest"],  # becomes its ManifestError
    "belief_lm/checkpoint/store.py": ["__init__"],  # a Checkpointer without the grid's group
    "belief_lm/checkpoint/writer.py": ["saving"],  # a background save of a writer made without
    "belief_lm/parallel/grid.py": ["__init__"],  # a grid whose dims are not the job's: a bug
    "belief_lm/checkpoint/universal.py": ["universal_info"],  # a new split: a bug
    "belief_lm/export/hf.py": ["hf_state_dict"],  # our own model's names: a mismatch is a bug
    "belief_lm/inference/lm_eval_adapter.py": ["score"],  # lm-eval's request, mid-evaluation
}
"""Where a plain ValueError is not a check of the user's input (a failure, exit code 1)."""


def test_our_checks_raise_bad_input():
    """Every plain ValueError our packages raise is a validator's or listed above as no input
    check: a check of the command line, config, data or a checkpoint raises BadInput (or a
    subclass; data_pipeline's BadDataInput), which exits with 2, not with a traceback."""
    found = {}
    for package in ("belief_lm", "data_pipeline", "launcher"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "hf_template" in path.parts:  # shipped with exports, runs without belief-lm
                continue
            name = path.relative_to(ROOT).as_posix()
            allowed = NOT_INPUT_CHECKS.get(name, [])
            raises = [f for f in plain_value_errors(path) if f.split(":")[0] not in allowed]
            if raises:
                found[name] = raises
    assert not found, f"raise BadInput (or list why not in NOT_INPUT_CHECKS): {found}"


def test_the_check_of_plain_value_errors_sees_them(tmp_path):
    source = tmp_path / "x.py"
    source.write_text(
        "from pydantic import AfterValidator, model_validator\n"
        "Word = Annotated[str, AfterValidator(_one_word)]\n"
        "def _one_word(value):\n    raise ValueError('two words')\n"
        "class C:\n"
        "    @model_validator(mode='after')\n"
        "    def _consistent(self):\n        raise ValueError('inconsistent')\n"
        "def check(x):\n    if x:\n        raise ValueError('bad')\n    raise BadInput('ok')\n"
    )
    assert plain_value_errors(source) == ["check:11"]
