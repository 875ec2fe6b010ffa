"""Export a checkpoint for use outside belief-lm: a Hugging Face transformers folder
(`hf.py`) or one torch file (`torch_file.py`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from belief_lm.errors import BadInput

FORMATS = ("hf", "torch")


def export(checkpoint: str | Path, fmt: str, output: str | Path, trust: bool = False) -> Path:
    """Export checkpoint directory `checkpoint` in format `fmt` ('hf': a folder, 'torch': a
    file) to `output`, which must not exist yet. Written under a temporary name and renamed
    at the end, so `output` is never left half-written. Returns `output`. `trust`: see
    consolidate."""
    if fmt not in FORMATS:
        raise BadInput(f"unknown export format {fmt!r} (known: {', '.join(FORMATS)})")
    output = Path(output).expanduser()
    if output.exists():
        raise BadInput(f"{output} already exists: export to a new path")
    if not output.parent.is_dir():
        raise BadInput(f"{output.parent} is not a directory")
    from belief_lm.checkpoint.consolidate import consolidate  # megatron: after the checks

    consolidated = consolidate(checkpoint, trust=trust)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if fmt == "hf":
            from belief_lm.export.hf import export_hf

            export_hf(consolidated, tmp)
            _umask_permissions(tmp)
            os.replace(tmp, output)
        else:
            from belief_lm.export.torch_file import export_torch

            export_torch(consolidated, tmp / "model.pt")
            os.replace(tmp / "model.pt", output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def _umask_permissions(folder: Path) -> None:
    """Give the files the permissions any new file gets (safetensors makes its file
    readable by the owner only, which would surprise whoever the export is shared with)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)
