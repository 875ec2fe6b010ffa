"""A checkpoint's manifest: every file's size and CRC-32, recorded when the checkpoint was
written and checked before it is trusted. Torch-free (pre-flight and `belief-lm checkpoint
verify` use it).

`manifest.json` lists every file of a checkpoint, all ranks' files and run.json included,
with its size and CRC-32 computed as the file was written (`ChecksummingFile`, used by
writer.py) and records its own checksum; store.py writes it before the checkpoint is
published. Two levels of checking:
- sizes: every listed file is there with its size (one stat per file, instant at any
  scale): a missing file, a cut-short copy, a missing or corrupt manifest;
- checksums: every file read through once, streamed in chunks, several files at a time on
  threads (zlib releases the GIL): also a changed byte. CRC-32 runs at ~2.4 GB/s per core
  here (blake2b ~1.0, sha1 ~1.2): reading the files costs more than checking them.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from belief_lm.errors import BadInput

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK = 16 << 20
"""Bytes read at a time when a file is checksummed."""
WORKERS = 4
"""Files checksummed at a time (threads) by default."""


@dataclass(frozen=True)
class FileRecord:
    """A file as it was written: its size in bytes and its CRC-32."""

    size: int
    crc32: int

    def as_json(self) -> dict:
        return {"size": self.size, "crc32": f"{self.crc32:08x}"}


class Checksum:
    """The size and CRC-32 of bytes as they go by."""

    def __init__(self):
        self.size = 0
        self.crc32 = 0

    def update(self, data) -> None:
        view = memoryview(data)
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += view.nbytes

    def record(self) -> FileRecord:
        return FileRecord(self.size, self.crc32)


class ChecksummingFile:
    """A binary file opened for writing that checksums what goes through `write` (what
    torch.save writes to a file object): the record costs no second read."""

    def __init__(self, file: BinaryIO):
        self.file = file
        self.checksum = Checksum()

    def write(self, data) -> int:
        self.checksum.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def record(self) -> FileRecord:
        return self.checksum.record()


def write_file(path: Path, data: bytes) -> FileRecord:
    """Write `data` to `path` (synced to disk) and return its record."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    return bytes_record(data)


def bytes_record(data: bytes) -> FileRecord:
    checksum = Checksum()
    checksum.update(data)
    return checksum.record()


def file_record(path: Path) -> FileRecord:
    """The record of file `path` as it is now (read once, in chunks)."""
    checksum = Checksum()
    with open(path, "rb", buffering=0) as file:
        while chunk := file.read(CHUNK):
            checksum.update(chunk)
    return checksum.record()


def write_manifest(directory: Path, records: dict[str, FileRecord]) -> None:
    """Write `directory`/manifest.json for `records` (paths relative to `directory`),
    atomically and synced: a manifest is there whole or not at all."""
    files = {name: records[name].as_json() for name in sorted(records)}
    body = {"format": FORMAT, "files": files, "files_crc32": f"{_crc_of(files):08x}"}
    tmp = directory / f".{MANIFEST}.tmp"
    write_file(tmp, json.dumps(body, indent=1).encode())
    os.replace(tmp, directory / MANIFEST)


def seal(directory: Path) -> None:
    """Write the manifest of `directory`'s files as they are now (every file below it, the
    manifest aside): for a checkpoint made by other means than belief-lm's save, which
    trusts the files as they are."""
    names = [p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST]
    write_manifest(directory, {p.relative_to(directory).as_posix(): file_record(p) for p in names})


class ManifestError(BadInput):
    """manifest.json is missing or unreadable (the message says which)."""


def read_manifest(directory: Path) -> dict[str, FileRecord]:
    """The records of `directory`/manifest.json; ManifestError if it is missing or corrupt
    (its own checksum catches a changed size or checksum in it)."""
    path = directory / MANIFEST
    try:
        body = json.loads(path.read_bytes())
        files = body["files"]
        if body["format"] != FORMAT or f"{_crc_of(files):08x}" != body["files_crc32"]:
            raise ValueError("its own checksum does not match")
        records = {name: FileRecord(f["size"], int(f["crc32"], 16)) for name, f in files.items()}
        for name, record in records.items():
            _check_entry(name, record)
        return records
    except FileNotFoundError:
        raise ManifestError(
            f"{MANIFEST} is missing (the save did not finish, or an earlier belief-lm "
            "without checksums wrote it)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ManifestError(f"{MANIFEST} is corrupt ({err})") from None


def _check_entry(name: str, record: FileRecord) -> None:
    """BadInput unless `name` is a path inside the checkpoint and `record` a size."""
    parts = PurePosixPath(name).parts
    if not parts or parts[0] == "/" or ".." in parts or "\\" in name:
        raise BadInput(f"it lists {name!r}, not a file inside the checkpoint")
    if type(record.size) is not int or record.size < 0:
        raise BadInput(f"it gives {name} the size {record.size!r}")


def _crc_of(files: dict) -> int:
    return zlib.crc32(json.dumps(files, sort_keys=True).encode())


def size_problem(directory: Path, name: str, record: FileRecord) -> str | None:
    """What is wrong with the presence or size of file `name`, or None."""
    try:
        size = (directory / name).stat().st_size
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as err:
        return f"{name} cannot be read ({err.strerror})"
    if size != record.size:
        how = "cut short" if size < record.size else "grown"
        return f"{name} has {size:,} bytes where {record.size:,} were written ({how})"
    return None


def checksum_problem(directory: Path, name: str, record: FileRecord) -> str | None:
    """What is wrong with file `name` (its size, then its CRC-32), or None."""
    problem = size_problem(directory, name, record)
    if problem is not None:
        return problem
    try:
        now = file_record(directory / name)
    except OSError as err:
        return f"{name} cannot be read ({err.strerror})"
    if now != record:
        return (
            f"{name} has changed since it was written (CRC-32 {now.crc32:08x}, written "
            f"{record.crc32:08x})"
        )
    return None


def check(
    directory: Path,
    records: dict[str, FileRecord],
    names: Iterable[str] | None = None,
    checksums: bool = True,
    workers: int = WORKERS,
) -> list[str]:
    """Problems of the files `names` (default: all of `records`) of `directory`, in name
    order; empty if they are as written. `checksums`: read them through (on `workers`
    threads), else compare sizes only."""
    names = sorted(records if names is None else names)
    judge = checksum_problem if checksums else size_problem
    if not checksums or workers <= 1 or len(names) <= 1:
        found = [judge(directory, name, records[name]) for name in names]
    else:
        with ThreadPoolExecutor(min(workers, len(names))) as pool:
            found = list(pool.map(lambda name: judge(directory, name, records[name]), names))
    return [problem for problem in found if problem is not None]


def verify(directory: Path, checksums: bool = True, workers: int = WORKERS) -> list[str]:
    """Problems of checkpoint `directory` against its manifest; empty if it is intact."""
    try:
        records = read_manifest(directory)
    except ManifestError as err:
        return [str(err)]
    return check(directory, records, checksums=checksums, workers=workers)


def shares(records: dict[str, FileRecord], parts: int) -> list[list[str]]:
    """The files split into `parts` shares of about equal bytes (largest first, each to the
    lightest share): what each rank of a job checksums when they verify together. The same
    on every rank for the same records."""
    loads = [0] * parts
    split: list[list[str]] = [[] for _ in range(parts)]
    for name in sorted(records, key=lambda n: (-records[n].size, n)):
        lightest = loads.index(min(loads))
        split[lightest].append(name)
        loads[lightest] += records[name].size
    return split
