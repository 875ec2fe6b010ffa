"""What happens to checkpoints in the wild, done to real ones: a file lost, a copy cut
short, a byte changed, the manifest lost, `latest` overwritten with garbage, a pickled
payload put into a file. And the comparison of two checkpoints tensor for tensor."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from belief_lm.checkpoint.manifest import MANIFEST


class Payload:
    """Unpickled, it runs exec(): writes 'ran' to `marker` (what a hostile file does)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def poison(file: Path, marker: Path) -> None:
    """Add a Payload writing `marker` to the dict torch file `file` (a file of the test's
    own, so loading it with pickle is fine here)."""
    state = torch.load(file, weights_only=False)
    state["payload"] = Payload(marker)
    torch.save(state, file)


def largest_file(checkpoint: Path) -> Path:
    """The checkpoint's largest data file (the model or optimizer states)."""
    files = [p for p in checkpoint.rglob("*.pt") if p.is_file()]
    return max(files, key=lambda p: (p.stat().st_size, p.name))


def lose_a_file(checkpoint: Path) -> str:
    file = largest_file(checkpoint)
    file.unlink()
    return f"{file.relative_to(checkpoint)} is missing"


def cut_short(checkpoint: Path) -> str:
    file = largest_file(checkpoint)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    return f"{file.relative_to(checkpoint)} has {len(data) // 2:,} bytes where {len(data):,} were"


def flip_a_byte(checkpoint: Path) -> str:
    """One byte in the middle of the largest file (tensor data: torch.load would read it
    without complaint) changed."""
    file = largest_file(checkpoint)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    return f"{file.relative_to(checkpoint)} has changed since it was written"


def lose_the_manifest(checkpoint: Path) -> str:
    (checkpoint / MANIFEST).unlink()
    return f"{MANIFEST} is missing"


DAMAGES: dict[str, Callable[[Path], str]] = {
    "manifest-missing": lose_the_manifest,
    "file-missing": lose_a_file,
    "truncated": cut_short,
    "byte-flipped": flip_a_byte,
}
"""Each damage: it done to a checkpoint, returning what the message about it must say."""


def garble_latest(root: Path) -> None:
    (root / "latest").write_bytes(b"\xff\xfe\x00garbage\x80")


def damage_all(root: Path) -> dict[str, str]:
    """Checkpoints 10, 8, 6 and 4 under `root`, newest first, damaged one way each (in
    DAMAGES' order), and `latest` garbled: only step 2 is intact. Returns what the warning
    about each must say, by checkpoint name."""
    said = {}
    for step, damage in zip((10, 8, 6, 4), DAMAGES.values(), strict=True):
        name = f"step_{step:06d}"
        said[name] = damage(root / name)
    garble_latest(root)
    return said


def copy_run(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to, symlinks=True)
    return to


def assert_same(a, b, where: str = "") -> None:
    """`a` and `b` (loaded checkpoint files) hold the same values: tensors equal in dtype,
    shape and every element; containers alike; other objects equal (by their attributes
    if they define no equality)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert type(a) is type(b) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{index}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        assert type(a) is type(b), where
        assert_same(vars(a), vars(b), where)
    else:
        assert a == b, where


def assert_same_checkpoint(a: Path, b: Path, same_process: bool = False) -> None:
    """Checkpoints `a` and `b` hold the same files with the same contents: every torch file
    tensor for tensor, run.json byte for byte (config.yaml names its own run directory).
    Unless they were saved by `same_process`, the ranks' RNG states are left out: Python's
    and NumPy's global generators are never seeded (nothing in training draws from them),
    so two processes differ there however they save."""
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*.pt"))
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*.pt"))
    assert names, a
    for name in names:
        loaded = [torch.load(c / name, map_location="cpu", weights_only=False) for c in (a, b)]
        if name.startswith("run_state/") and not same_process:
            for state in loaded:
                state.pop("rng")
        assert_same(*loaded, where=name)
    assert (a / "run.json").read_bytes() == (b / "run.json").read_bytes()
