"""Reading rows out of files: parquet row groups (whole or in parts), lines and paragraphs
of JSON lines and text files, compressed or not, local or remote (fsspec), and the `Unit`,
a piece of a source that can be read on its own from its start."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from data_pipeline.failures import retry

PARQUET_BATCH = 64
"""Rows decoded at a time from a parquet row group."""
PART_CACHE_BYTES = 256 * 2**20
"""Decoded row groups a process keeps while readers read them in parts (a corpus with fewer
row groups than the run has units: a small one). Parquet cannot seek to a row, so each part
would decode its group again from the first row."""
EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".txt": "text"}
COMPRESSIONS = (".gz", ".zst")


@dataclass(frozen=True)
class Unit:
    """A piece of a source readable from its start: rows [start, stop) of parquet row group
    `group` of file `file`; bytes [start, stop) of a line file (stop None: to the end, as
    for a compressed file); documents [start, stop) of the embedded corpus (file -1);
    samples [start, stop) of prepared data (file -2)."""

    file: int
    group: int
    start: int
    stop: int | None
    size: int
    """Bytes or characters of text (samples of prepared data): what streams are supplied by."""


def parquet_rows(
    path: str,
    metadata: pq.FileMetaData,
    unit: Unit,
    columns: list[str],
    skip: int,
    decoded: DecodedGroups,
) -> Iterator:
    """Rows [unit.start + skip, unit.stop) of one row group, decoded PARQUET_BATCH at a time
    (rows before the range are decoded and dropped: parquet cannot seek to a row); a part
    of a row group from the group decoded once and kept in `decoded`. The file's footer is
    `metadata`, read once per source: it is not parsed again for every unit."""
    first, position = unit.start + skip, 0
    group = metadata.row_group(unit.group)
    if unit.stop - unit.start < group.num_rows and group.total_byte_size <= decoded.limit:
        table = decoded.group(path, metadata, unit.group, tuple(columns))
        for start in range(first, unit.stop, PARQUET_BATCH):
            rows = table.slice(start, min(PARQUET_BATCH, unit.stop - start)).to_pylist()
            for index, row in enumerate(rows, start):
                yield row, f"{path} row group {unit.group} row {index}"
        return
    batches = parquet_file(path, metadata).iter_batches(
        batch_size=PARQUET_BATCH, row_groups=[unit.group], columns=columns
    )
    for batch in batches:
        end = position + batch.num_rows
        if end > first:
            for offset, row in enumerate(batch.slice(max(0, first - position)).to_pylist()):
                index = max(first, position) + offset
                if index >= unit.stop:
                    return
                yield row, f"{path} row group {unit.group} row {index}"
        position = end
        if position >= unit.stop:
            return


class DecodedGroups:
    """Parquet row groups read in parts, kept decoded up to `limit` bytes (the least
    recently read dropped first). The sources of a run share one (each loader worker its
    copy)."""

    def __init__(self, limit: int = PART_CACHE_BYTES):
        self.limit = limit
        self.tables: OrderedDict[tuple, pa.Table] = OrderedDict()
        """(path, group, columns) -> table, least recent first."""
        self.bytes = 0
        """Bytes the tables hold (kept with them: summing them per access is O(tables))."""

    def __getstate__(self) -> dict:  # a copy for another process starts empty
        return {"limit": self.limit}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["limit"])

    def group(self, path: str, metadata: pq.FileMetaData, group: int, columns: tuple) -> pa.Table:
        """Row group `group` of `path` (its `columns`), decoded once."""
        key = (path, group, columns)
        if key not in self.tables:
            table = parquet_file(path, metadata).read_row_group(group, columns=list(columns))
            self.tables[key] = table
            self.bytes += table.nbytes
            while len(self.tables) > 1 and self.bytes > self.limit:
                self.bytes -= self.tables.popitem(last=False)[1].nbytes
        self.tables.move_to_end(key)
        return self.tables[key]


def parquet_file(path: str, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
    return pq.ParquetFile(fsspec.open(path, "rb").open(), metadata=metadata)


def line_rows(path: str, unit: Unit, fmt: str, text_unit: str) -> Iterator:
    """Rows of a JSON lines or text file's byte range: the lines that start in it (a
    document or paragraph of a text file: the whole file is one unit)."""
    if fmt == "text" and text_unit == "document":
        with binary(path) as f:
            yield {"raw": f.read()}, path
        return
    if fmt == "text" and text_unit == "paragraph":
        yield from paragraphs(path)
        return
    for offset, line in lines_in_range(path, unit):
        if line.strip():
            raw = line.rstrip(b"\r\n") if fmt == "text" else line
            yield {"raw": raw}, f"{path} byte {offset}"


def lines_in_range(path: str, unit: Unit) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the lines starting in [unit.start, unit.stop); a line that starts
    before the range belongs to the previous one. Read errors name the file."""
    offset = unit.start
    try:
        with binary(path) as f:
            if offset > 0:
                f.seek(offset - 1)
                offset += len(f.readline()) - 1  # to the start of the next line
            while unit.stop is None or offset < unit.stop:
                line = f.readline()
                if not line:
                    return
                yield offset, line
                offset += len(line)
    except (OSError, EOFError) as err:
        raise OSError(f"unreadable after byte {offset}: {err}") from err  # kind: the cause


def line_starts(path: str, offsets: Sequence[int]) -> list[int]:
    """For each offset (ascending), the first line start at or after it (the file's size if
    none): where a byte range of the file begins to own lines (see `lines_in_range`)."""
    starts: list[int] = []
    with binary(path) as f:
        for offset in offsets:
            if starts and starts[-1] >= offset:  # a long line reaches past this offset
                starts.append(starts[-1])
                continue
            if offset > 0:
                f.seek(offset - 1)
                offset += len(f.readline()) - 1
            starts.append(offset)
    return starts


def paragraphs(path: str) -> Iterator[tuple[dict, str]]:
    lines, start = [], 0
    whole = itertools.chain(lines_in_range(path, Unit(0, 0, 0, None, 0)), [(0, b"")])
    for offset, line in whole:  # a blank line (or the end) ends one
        if line.strip():
            start = start if lines else offset
            lines.append(line)
        elif lines:
            yield {"raw": b"".join(lines).rstrip(b"\r\n")}, f"{path} byte {start}"
            lines = []


def file_size(path: str) -> int:
    return int(retry(lambda: fsspec.core.url_to_fs(path)[0].size(path), path))


def is_local(path: str) -> bool:
    return "file" in fsspec.core.url_to_fs(path)[0].protocol


def format_of(path: str) -> str | None:
    stem = str(path)
    for ext in COMPRESSIONS:
        stem = stem.removesuffix(ext)
    return EXTENSIONS.get(os.path.splitext(stem)[1])


@contextlib.contextmanager
def binary(path: str) -> Iterator[io.BufferedReader]:
    """`path` opened for buffered binary reading, .gz / .zst decompressed by extension
    (zstandard's reader cannot iterate lines by itself)."""
    with fsspec.open(path, "rb", compression="infer") as f:
        yield io.BufferedReader(f)


def batched(items: Iterator, size: int) -> Iterator[Sequence]:
    """Lists of `size` items (the last may be shorter)."""
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk
