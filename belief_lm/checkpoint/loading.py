"""Reading checkpoint files without running code: every torch file of a checkpoint is read
here, weights-only, against an explicit allow-list.

A torch file is a pickle, and unpickling can call any function the file names: a checkpoint
from someone else (a shared file system, a download) could run code as whoever loads it.
`torch.load(..., weights_only=True)` rebuilds only tensors, plain Python values (dicts,
lists, tuples, numbers, strings, bytes, None), OrderedDict, torch.Size, dtypes and the
classes an allow-list adds; a file asking for anything else is refused before any of it is
used. What a belief-lm checkpoint may hold beyond torch's own list is `ALLOWED`: DeepSpeed's
three (compat.deepspeed_checkpoint_types), and only those (`only_allowed`: not what other
libraries added to torch's list). What belief-lm itself writes (RNG states, the data
position, the loss history) is plain values and tensors only.

Every reader goes through `load`: consolidate.py (evaluate, generate, export, lm-eval),
trainer_state.py (a resume's RNG and data states), writer.py (DeepSpeed's engine loads
through its checkpoint engine) and, by compat.deepspeed_loads_through, DeepSpeed's own
loads (universal checkpoints, ds_to_universal, zero_to_fp32). `refusals` finds what a
checkpoint's files ask for without loading them, so a command refuses a checkpoint before
it reads any of it (and every rank of a job alike).

`trust=True` (`--trust-checkpoint`, `checkpoint.trust=true`; never the default) loads a
file the allow-list refuses with plain pickle, after a warning naming it: for a checkpoint
you made yourself with an earlier belief-lm (whose RNG and data states held NumPy arrays).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from belief_lm import compat
from belief_lm.checkpoint.files import CheckpointError

log = logging.getLogger("belief_lm.checkpoint")

ALLOWED: list[type] = compat.deepspeed_checkpoint_types()
"""What a checkpoint file may hold beyond torch's weights-only types (tensors, plain
values, OrderedDict, torch.Size, dtypes)."""

TRUST_HINT = (
    "loading it could run code; if you made this checkpoint yourself (with an earlier "
    "belief-lm), --trust-checkpoint (train: checkpoint.trust=true) loads it with pickle"
)
"""How a refusal ends: why, and the opt-in."""

_torch_load = torch.serialization.load
"""torch.load under its own name: compat.deepspeed_loads_through replaces `torch.load`
while DeepSpeed reads, with `load` here."""


class RefusedFile(CheckpointError):
    """A checkpoint file holding more than a checkpoint may (named, with what it asked for):
    it was not loaded."""


def load(path: str | Path, map_location=None, *, mmap: bool = False, trust: bool = False):
    """The object torch file `path` holds, rebuilt weights-only with `ALLOWED` (tensors
    where `map_location` says). RefusedFile naming the file and what it asked to import if
    it holds anything else (with `trust`: a warning, then loaded with pickle);
    CheckpointError if it is not a readable torch file."""
    try:
        with only_allowed():
            return _torch_load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as err:
        refusal = f"{path} {_asked_for(path, err)}"
    except FileNotFoundError:
        raise
    except (RuntimeError, EOFError, OSError) as err:  # not a torch file, or cut short
        raise CheckpointError(f"{path} is not a readable torch file ({_first_line(err)})") from None
    if not trust:
        raise RefusedFile(f"{refusal}: not loaded ({TRUST_HINT})")
    log.warning("%s: loading it with pickle (trusted: it can run code)", refusal)
    return _torch_load(path, map_location=map_location, mmap=mmap, weights_only=False)


_allowing = threading.RLock()


@contextlib.contextmanager
def only_allowed() -> Iterator[None]:
    """Within the block, weights-only loads take torch's own types and `ALLOWED`, nothing
    else. torch keeps one list of added types for the whole process, and libraries add to
    it: megatron-core, when imported, adds 16 (NumPy arrays, argparse.Namespace, PosixPath,
    BytesIO, its config classes...), none of which a checkpoint of ours holds. Their list
    is put back after the block; loads in other threads wait."""
    with _allowing:
        others = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(ALLOWED)
        try:
            yield
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(others)


def refusals(directory: Path, names: list[str] | None = None) -> list[str]:
    """What the torch files `names` (paths relative to checkpoint `directory`; default:
    every `*.pt` below it) ask for beyond `ALLOWED`, one line per file that does; empty if
    none does. Reads only each file's pickle (no tensor data), runs none of it."""
    if names is None:
        names = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*.pt"))
    found = []
    for name in names:
        if name.endswith(".pt"):
            problem = refusal(directory / name)
            if problem is not None:
                found.append(f"{name} {problem}")
    return found


def refusal(path: Path) -> str | None:
    """What torch file `path` asks for beyond `ALLOWED` ('asks to import X'), or None."""
    try:
        with only_allowed():
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except FileNotFoundError:
        return None  # the manifest check reports a missing file
    except (pickle.UnpicklingError, ValueError, RuntimeError, EOFError, OSError) as err:
        return f"is not a torch file in torch.save's format ({_first_line(err)})"
    if not unsafe:
        return None
    return f"asks to import {', '.join(sorted(unsafe))}, which a checkpoint may not hold"


def refuse(path: Path, found: list[str], trust: bool) -> None:
    """Refuse checkpoint `path` whose files `found` (`refusals`) ask for more than a
    checkpoint may hold: RefusedFile naming them, or with `trust` a warning (they will be
    loaded with pickle). Nothing if `found` is empty."""
    if not found:
        return
    what = "; ".join(found)
    if not trust:
        raise RefusedFile(f"checkpoint {path}: {what} ({TRUST_HINT})")
    log.warning("checkpoint %s: %s; trusted: loading with pickle, which can run code", path, what)


def _asked_for(path: str | Path, err: pickle.UnpicklingError) -> str:
    """What the weights-only unpickler refused in `path`: the globals it names, else the
    unpickler's own reason."""
    problem = refusal(Path(path))
    return problem or f"holds what weights-only loading refuses ({_first_line(err)})"


def _first_line(err: BaseException) -> str:
    """The first sentence of `err`'s message (torch's go on for paragraphs)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0].split(". ")[0].rstrip(".") if lines else type(err).__name__
