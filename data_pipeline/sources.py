"""Document sources: the Hugging Face hub, local files, the embedded corpus, cut into units.

A source is read as a list of *units*, each a piece of it that can be read on its own from
its start: a parquet row range inside one row group, a byte range of an uncompressed JSON
lines / text file (lines are assigned to the range they start in), a whole compressed
file, a range of the embedded corpus's documents. Units are what the readers of a run
share out per epoch (`data_pipeline/stream.py`), so every row of an epoch is read exactly
once whatever the layout, and units carry their size (rows or bytes) for balancing.

The hub is reached through `datasets` only to resolve a dataset's files
(`load_dataset_builder(repo, name)`: its README configs, data files and revision); the
files themselves, hub or local, are read with pyarrow (parquet) and fsspec, the same code
for both. JSON lines and text are parsed by `RowParser`, so a corrupt line is skipped and
counted, not fatal.

`check()` is the pre-flight: it reads only metadata or first rows and raises `SourceError`
naming the config key, file and column.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import io
import itertools
import json
import logging
import lzma
import os
import socket
import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from data_pipeline.documents import RowParser, parse_filter
from data_pipeline.embedded import embedded_documents

if TYPE_CHECKING:
    from data_pipeline.config import SourceConfig

log = logging.getLogger(__name__)

EMBEDDED_UNIT = 16
"""Documents per unit of the embedded corpus."""
PARQUET_BATCH = 64
"""Rows decoded at a time from a parquet row group."""
PART_CACHE_BYTES = 256 * 2**20
"""Decoded row groups a process keeps while readers read them in parts (a corpus with fewer
row groups than the run has units: a small one). Parquet cannot seek to a row, so each part
would decode its group again from the first row."""
CHECKED_LINES = 100
"""Lines of a JSON lines file the pre-flight reads for its columns."""
RETRIES = 3
"""Attempts at reading a file's metadata or a unit's rows when the network fails, before
the source fails (each read again from the row it had reached)."""
RETRY_PAUSE = 1.0
"""Seconds before the second attempt; doubled before each later one."""
_EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".txt": "text"}
_COMPRESSIONS = (".gz", ".zst")
_TEXT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


class SourceError(ValueError):
    """A source that cannot be used; `key` is the SourceConfig field at fault."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class DataFault(RuntimeError):
    """Data that failed while a run was reading it (a corrupt row group, a vanished file,
    an unreachable hub, too many unusable rows): the message names the source and where."""


_TRANSPORT_ERRORS = (
    ("http.client", "HTTPException"),  # urllib, and what requests and urllib3 wrap
    ("urllib3.exceptions", "HTTPError"),
    ("requests", "RequestException"),
    ("aiohttp", "ClientError"),  # fsspec's HTTP file system
    ("httpx", "HTTPError"),
    ("httpx2", "HTTPError"),  # huggingface_hub's HfFileSystem (hf:// files)
    ("huggingface_hub.errors", "HfHubHTTPError"),
)
"""(module, class): the base of each network library's errors. Most are no OSError, and
the OSErrors among them (requests', the hub's) are no builtin ConnectionError."""
_NETWORK_ERRNOS = frozenset(
    {errno.ENETDOWN, errno.ENETUNREACH, errno.ENETRESET, errno.EHOSTDOWN, errno.EHOSTUNREACH}
)
_CORRUPT_ERRORS = (EOFError, pa.ArrowException, zlib.error, lzma.LZMAError, UnicodeDecodeError)
"""Raised by decoding bytes that were read: a truncated or garbled compressed stream, a
parquet page arrow cannot decode (which pyarrow raises as a plain OSError, as gzip
raises BadGzipFile: see failure_kind)."""


def failure_kind(err: BaseException) -> str | None:
    """What a failure to read a unit of data says about the source:

    - 'transport': the network or a remote store failed (a connection, a timeout, an HTTP
      error of any library fsspec, the hub or datasets use): worth retrying; after the
      retries the source fails.
    - 'source': the file is gone or forbidden, or the system failed to read it (an OSError
      carrying an errno): the source fails.
    - 'corrupt': the bytes were read but cannot be decoded (a corrupt parquet page, a
      broken compressed stream): only this unit is lost (data.on_corrupt_row_group).
    - None: not a data error (a bug: let it raise).

    The network libraries are never imported here: an error of a library not imported
    cannot have been raised. A failure anywhere in the chain of causes counts (errors
    re-raised with the file's name keep theirs; fsspec's HTTP files raise FileNotFoundError
    from a connection that failed)."""
    chain = [err]
    while len(chain) < 16 and (cause := chain[-1].__cause__ or chain[-1].__context__):
        chain.append(cause)
    if any(_is_transport(e) for e in chain):
        return "transport"
    if any(
        isinstance(e, (FileNotFoundError, PermissionError))
        or (isinstance(e, OSError) and e.errno is not None)  # EIO, ESTALE, ...: the system's
        for e in chain
    ):
        return "source"
    if isinstance(err, (OSError, *_CORRUPT_ERRORS)) or _is_instance(err, "zstandard", "ZstdError"):
        return "corrupt"  # an OSError without errno: raised by a decoder (arrow, gzip)
    return None


def _is_transport(err: BaseException) -> bool:
    if isinstance(err, (ConnectionError, TimeoutError)):  # socket.timeout, FSTimeoutError too
        return True
    if isinstance(err, OSError) and (
        err.errno in _NETWORK_ERRNOS or isinstance(err, (socket.gaierror, socket.herror))
    ):
        return True
    return any(_is_instance(err, module, name) for module, name in _TRANSPORT_ERRORS)


def _is_instance(err: BaseException, module: str, name: str) -> bool:
    """isinstance(err, module.name), False if that module was never imported."""
    base = getattr(sys.modules.get(module), name, None)
    return isinstance(base, type) and isinstance(err, base)


@dataclass(frozen=True)
class Unit:
    """A piece of a source readable from its start: rows [start, stop) of parquet row group
    `group` of file `file`; bytes [start, stop) of a line file (stop None: to the end, as
    for a compressed file); documents [start, stop) of the embedded corpus (file -1)."""

    file: int
    group: int
    start: int
    stop: int | None
    size: int
    """Rows or bytes: what readers are balanced by."""


class Source:
    """One configured source: its files, its units and how to read and parse their rows."""

    def __init__(self, cfg: SourceConfig):
        self.cfg = cfg
        self.kind, self.location, self.config_name = _parse_uri(cfg)
        self.filters = [parse_filter(f) for f in cfg.filters]
        self._files: list[str] | None = None
        self._units: dict[int, list[Unit]] = {}
        self._metadata: dict[str, pq.FileMetaData] = {}
        self._parser: RowParser | None = None

    def __repr__(self) -> str:
        return f"Source({self.cfg.uri!r})"

    @property
    def file_format(self) -> str:
        """parquet, jsonl, text or embedded (a hub dataset's files are parquet or jsonl)."""
        if self.kind != "hub":
            return self.kind
        files = self.files()
        return "jsonl" if _format_of(files[0]) == "jsonl" else "parquet"

    @property
    def parser(self) -> RowParser:
        """Turns this source's rows into documents (a hub source's files decide the format)."""
        if self._parser is None:
            raw = {"jsonl": "json", "text": "text"}.get(self.file_format)
            id_column = "id" if self.kind == "embedded" else self.cfg.id_column
            self._parser = RowParser(self.cfg.text_column, id_column, self.filters, raw)
        return self._parser

    @property
    def columns(self) -> list[str]:
        """The columns this source needs from each row."""
        cols = [self.cfg.text_column, self.cfg.id_column, *(f.column for f in self.filters)]
        return list(dict.fromkeys(c for c in cols if c is not None))

    def files(self) -> list[str]:
        """The source's files, sorted (hub: the dataset's resolved data files); a
        SourceError if there are none."""
        if self._files is None:
            self._files = self._hub_files() if self.kind == "hub" else self._local_files()
        return self._files

    def _local_files(self) -> list[str]:
        if self.kind == "embedded":
            return []
        files = sorted(glob.glob(os.path.expanduser(self.location), recursive=True))
        if not files:
            raise SourceError("uri", f"no files match {self.location!r}")
        return files

    def _hub_files(self) -> list[str]:
        import datasets  # slow to import; only the hub needs it

        try:
            builder = datasets.load_dataset_builder(self.location, self.config_name)
        except Exception as err:  # network, auth, unknown repo/config: all fatal here
            raise SourceError("uri", f"cannot open hub dataset {self.location!r}: {err}") from None
        files = (builder.config.data_files or {}).get(self.cfg.hub_split)
        if not files:
            raise SourceError(
                "hub_split", f"hub dataset {self.location!r} has no files for split "
                f"{self.cfg.hub_split!r}"
            )  # fmt: skip
        formats = {_format_of(f) for f in files}
        if formats - {"parquet", "jsonl"} or len(formats) > 1:
            raise SourceError(
                "uri", f"hub dataset {self.location!r}: files are {sorted(formats)}, "
                "readable are parquet or JSON lines"
            )  # fmt: skip
        return sorted(str(f) for f in files)

    def check(self) -> None:
        """Pre-flight: the source opens and has the needed columns (metadata/first rows).
        A file without rows is skipped with a warning; a SourceError if every file is empty."""
        empty = []
        for path in self.files():
            try:
                if not _retry(lambda path=path: self._check_file(path), path):
                    empty.append(path)
            except Exception as err:
                if failure_kind(err) is None:
                    raise
                raise SourceError("uri", f"cannot read {path}: {err}") from None
        if empty and len(empty) == len(self.files()):
            which = empty[0] if len(empty) == 1 else f"all {len(empty)} files ({empty[0]}, ...)"
            raise SourceError("uri", f"{which}: no rows (the source is empty)")
        for path in empty:
            log.warning("%s: %s has no rows; skipped", self.cfg.uri, path)

    def _check_file(self, path: str) -> bool:
        """Whether the file has rows (raises SourceError if it lacks a needed column)."""
        if self.file_format == "parquet":
            return self._check_parquet(path)
        if self.file_format == "jsonl":
            return self._check_jsonl(path)
        with _binary(path) as f:
            return bool(f.read(1))

    def _check_parquet(self, path: str) -> bool:
        meta = self._meta(path)
        schema = meta.schema.to_arrow_schema()
        self._require_columns(path, schema.names)
        kind = schema.field(self.cfg.text_column).type
        if kind not in _TEXT_TYPES:
            raise SourceError(
                "text_column",
                f"{path}: column {self.cfg.text_column!r} has type {kind}, not a string",
            )
        return meta.num_rows > 0

    def _meta(self, path: str) -> pq.FileMetaData:
        """A parquet file's footer, read once (the pre-flight and the units both need it)."""
        if path not in self._metadata:
            self._metadata[path] = _retry(lambda: _parquet_file(path).metadata, path)
        return self._metadata[path]

    def _check_jsonl(self, path: str) -> None:
        """The columns of the first parseable row among the first CHECKED_LINES (a corrupt
        line is skipped when training, so it need not stop the check)."""
        with _binary(path) as f:
            lines = [x for x in itertools.islice(f, CHECKED_LINES) if x.strip()]
        if not lines:
            return False
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                self._require_columns(path, list(row))
                return True
        raise SourceError("uri", f"{path}: none of its first {len(lines)} rows is a JSON object")

    def _require_columns(self, where: str, present: list[str]) -> None:
        filters = {f.column for f in self.filters}
        for column in self.columns:
            if column not in present:
                key = (
                    "filters"
                    if column in filters
                    else ("text_column" if column == self.cfg.text_column else "id_column")
                )
                raise SourceError(
                    key, f"{where}: no column {column!r} (columns: {', '.join(present)})"
                )

    def units(self, pieces: int = 1) -> list[Unit]:
        """The source as units, in file order, cut so that none is larger than about
        1/`pieces` of the whole (when its rows or bytes can be split at all); files and row
        groups without rows are left out. Read once (file metadata) and kept: workers
        receive them with the source."""
        if pieces not in self._units:
            self._units[pieces] = self._read_units(pieces)
        return self._units[pieces]

    def tokens_per_size(self, window: int) -> float:
        """A first guess of tokens per unit of `Unit.size` (bytes or characters of text),
        before the run has measured it: English BPE takes about 4 bytes per token."""
        return 0.25

    def _read_units(self, pieces: int) -> list[Unit]:
        if self.kind == "embedded":  # sizes: characters, exact
            sizes = [len(doc.text) for doc in embedded_documents()]
            return _cut([Unit(-1, 0, 0, len(sizes), sum(sizes))], pieces, sizes)
        whole = []
        for i, path in enumerate(self.files()):
            if self.file_format == "parquet":
                # size: the text column's uncompressed bytes, a proxy for its tokens
                meta = self._meta(path)
                text = meta.schema.to_arrow_schema().get_field_index(self.cfg.text_column)
                for g in range(meta.num_row_groups):
                    group = meta.row_group(g)
                    if group.num_rows:
                        size = group.column(text).total_uncompressed_size if text >= 0 else 0
                        whole.append(Unit(i, g, 0, group.num_rows, max(1, size)))
            elif size := _size(path):
                compressed = path.endswith(_COMPRESSIONS)  # no seeking in a compressed stream
                whole.append(Unit(i, 0, 0, None if compressed else size, size))
        if self.file_format == "text" and self.cfg.text_unit != "line":
            # a document or a paragraph may span any byte: whole files only
            whole = [Unit(u.file, 0, 0, None, u.size) for u in whole]
        return _cut(whole, pieces)

    def fingerprint(self) -> list:
        """What a saved reading position is valid for: the files and their sizes."""
        if self.kind == "embedded":
            return [len(embedded_documents())]
        return [[os.path.basename(p), _size(p)] for p in self.files()]

    def rows(self, unit: Unit, skip: int = 0) -> Iterator[tuple[dict, str]]:
        """(row, where) for the rows of `unit` after the first `skip`; `where` names the
        file and the row (parquet: row group and row; line files: byte offset)."""
        if self.kind == "embedded":
            docs = embedded_documents()
            for i in range(unit.start + skip, unit.stop):
                yield {"id": docs[i].id, "text": docs[i].text}, f"embedded document {i}"
            return
        path = self.files()[unit.file]
        if self.file_format == "parquet":
            yield from _parquet_rows(path, self._meta(path), unit, self.columns, skip)
        else:
            rows = _line_rows(path, unit, self.file_format, self.cfg.text_unit)
            yield from itertools.islice(rows, skip, None)


def open_source(cfg: SourceConfig):
    """The Source (or PreparedSource, for 'prepared:DIR') of a source config; no I/O."""
    if cfg.uri.startswith("prepared:"):
        from data_pipeline.prepared import PreparedSource  # prepared.py builds on this module

        return PreparedSource(cfg)
    return Source(cfg)


def _cut(units: list[Unit], pieces: int, row_sizes: Sequence[int] | None = None) -> list[Unit]:
    """Split units larger than total/pieces into near-equal parts where they can be split
    (parquet rows, embedded documents, uncompressed byte ranges): by `row_sizes` where the
    size of every row is known (the embedded corpus), else into equal row ranges."""
    limit = max(1, -(-sum(u.size for u in units) // max(1, pieces)))
    out = []
    for unit in units:
        if unit.stop is None or unit.size <= limit:
            out.append(unit)
        elif row_sizes is not None:
            out += _cut_by_row_sizes(unit, row_sizes, limit)
        else:
            parts = -(-unit.size // limit)
            length = unit.stop - unit.start
            bounds = [unit.start + length * k // parts for k in range(parts + 1)]
            out += [
                Unit(unit.file, unit.group, a, b, max(1, unit.size * (b - a) // length))
                for a, b in itertools.pairwise(bounds)
                if b > a
            ]
    return out


def _cut_by_row_sizes(unit: Unit, row_sizes: Sequence[int], limit: int) -> list[Unit]:
    """Rows [unit.start, unit.stop) in consecutive parts of about `limit` in size."""
    out, first, size = [], unit.start, 0
    for row in range(unit.start, unit.stop):
        size += row_sizes[row]
        if size >= limit:
            out.append(Unit(unit.file, unit.group, first, row + 1, max(1, size)))
            first, size = row + 1, 0
    if first < unit.stop:
        out.append(Unit(unit.file, unit.group, first, unit.stop, max(1, size)))
    return out


def _parquet_rows(
    path: str, metadata: pq.FileMetaData, unit: Unit, columns: list[str], skip: int
) -> Iterator:
    """Rows [unit.start + skip, unit.stop) of one row group, decoded PARQUET_BATCH at a time
    (rows before the range are decoded and dropped: parquet cannot seek to a row); a part
    of a row group from the group decoded once (PART_CACHE_BYTES). The file's footer is
    `metadata`, read once per source: it is not parsed again for every unit."""
    first, position = unit.start + skip, 0
    group = metadata.row_group(unit.group)
    if unit.stop - unit.start < group.num_rows and group.total_byte_size <= PART_CACHE_BYTES:
        table = _decoded_group(path, metadata, unit.group, tuple(columns))
        for start in range(first, unit.stop, PARQUET_BATCH):
            rows = table.slice(start, min(PARQUET_BATCH, unit.stop - start)).to_pylist()
            for index, row in enumerate(rows, start):
                yield row, f"{path} row group {unit.group} row {index}"
        return
    batches = _parquet_file(path, metadata).iter_batches(
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


_PARTS: OrderedDict[tuple, pa.Table] = OrderedDict()
"""Row groups read in parts, decoded: (path, group, columns) -> table, least recent first."""
_PARTS_BYTES = [0]
"""Bytes the tables in _PARTS hold (kept with it: summing them per access is O(cache))."""


def _decoded_group(path: str, metadata: pq.FileMetaData, group: int, columns: tuple) -> pa.Table:
    key = (path, group, columns)
    if key not in _PARTS:
        table = _parquet_file(path, metadata).read_row_group(group, columns=list(columns))
        _PARTS[key] = table
        _PARTS_BYTES[0] += table.nbytes
        while len(_PARTS) > 1 and _PARTS_BYTES[0] > PART_CACHE_BYTES:
            _PARTS_BYTES[0] -= _PARTS.popitem(last=False)[1].nbytes
    _PARTS.move_to_end(key)
    return _PARTS[key]


def _parquet_file(path: str, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
    return pq.ParquetFile(fsspec.open(path, "rb").open(), metadata=metadata)


def _retry(action, path: str):
    """`action()`, attempted again (up to RETRIES in all) while the network fails; any
    other error at once."""
    for attempt in range(1, RETRIES + 1):
        try:
            return action()
        except Exception as err:
            if attempt == RETRIES or failure_kind(err) != "transport":
                raise
            retry_pause(attempt, path, err)
    raise AssertionError("unreachable")


def retry_pause(attempt: int, where: str, err: BaseException) -> None:
    """Wait before attempt `attempt` + 1 at reading `where`, which failed with `err`."""
    pause = RETRY_PAUSE * 2 ** (attempt - 1)
    log.warning("%s: %s; attempt %d of %d in %.0f s", where, err, attempt + 1, RETRIES, pause)
    time.sleep(pause)


def _line_rows(path: str, unit: Unit, fmt: str, text_unit: str) -> Iterator:
    """Rows of a JSON lines or text file's byte range: the lines that start in it (a
    document or paragraph of a text file: the whole file is one unit)."""
    if fmt == "text" and text_unit == "document":
        with _binary(path) as f:
            yield {"raw": f.read()}, path
        return
    if fmt == "text" and text_unit == "paragraph":
        yield from _paragraphs(path)
        return
    for offset, line in _lines_in_range(path, unit):
        if line.strip():
            raw = line.rstrip(b"\r\n") if fmt == "text" else line
            yield {"raw": raw}, f"{path} byte {offset}"


def _lines_in_range(path: str, unit: Unit) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the lines starting in [unit.start, unit.stop); a line that starts
    before the range belongs to the previous one. Read errors name the file."""
    offset = unit.start
    try:
        with _binary(path) as f:
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


def _paragraphs(path: str) -> Iterator[tuple[dict, str]]:
    lines, start = [], 0
    whole = itertools.chain(_lines_in_range(path, Unit(0, 0, 0, None, 0)), [(0, b"")])
    for offset, line in whole:  # a blank line (or the end) ends one
        if line.strip():
            start = start if lines else offset
            lines.append(line)
        elif lines:
            yield {"raw": b"".join(lines).rstrip(b"\r\n")}, f"{path} byte {start}"
            lines = []


def _size(path: str) -> int:
    return int(_retry(lambda: fsspec.core.url_to_fs(path)[0].size(path), path))


def _format_of(path: str) -> str | None:
    stem = str(path)
    for ext in _COMPRESSIONS:
        stem = stem.removesuffix(ext)
    return _EXTENSIONS.get(os.path.splitext(stem)[1])


def _parse_uri(cfg: SourceConfig) -> tuple[str, str, str | None]:
    """(kind, location, hub config name) of a source."""
    uri = cfg.uri
    if uri == "embedded":
        return "embedded", uri, None
    if uri.startswith("hf:"):
        repo, _, name = uri[3:].partition(":")
        if not repo:
            raise SourceError("uri", f"{uri!r}: expected hf:OWNER/NAME[:CONFIG]")
        return "hub", repo, cfg.name or name or None
    if uri.startswith("prepared:"):
        return "prepared", uri.removeprefix("prepared:"), None
    kind = _format_of(uri) if cfg.format == "auto" else cfg.format
    if kind is None:
        raise SourceError(
            "uri",
            f"unknown data source {uri!r} (expected 'embedded', 'hf:OWNER/NAME[:CONFIG]', "
            "'prepared:DIR', or a path/glob of .parquet, .jsonl[.gz|.zst] or .txt[.gz|.zst] "
            "files; set format for other extensions)",
        )
    return kind, uri, None


@contextlib.contextmanager
def _binary(path: str) -> Iterator[io.BufferedReader]:
    """`path` opened for buffered binary reading, .gz / .zst decompressed by extension
    (zstandard's reader cannot iterate lines by itself)."""
    with fsspec.open(path, "rb", compression="infer") as f:
        yield io.BufferedReader(f)


def batched(items: Iterator, size: int) -> Iterator[Sequence]:
    """Lists of `size` items (the last may be shorter)."""
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk
