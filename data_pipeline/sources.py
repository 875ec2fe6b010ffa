"""Document sources: the Hugging Face hub, local files, the embedded corpus, cut into units.

A source is read as a list of *units* (`reading.Unit`), each a piece of it that can be
read on its own from its start: a parquet row range inside one row group, a byte range of
an uncompressed JSON lines / text file (beginning where a line begins: a range owns the
lines that start in it, and its size is theirs, however long one is), a
whole compressed file, a range of the embedded corpus's documents. Units are what a run's
schedule deals out per epoch (`data_pipeline/schedule.py`), so every row of an epoch is
read exactly once whatever the layout; they carry their size (bytes or characters of
text), by which streams are supplied.

The hub is reached through `datasets` only to resolve a dataset's files
(`load_dataset_builder(repo, name)`: its README configs, data files and revision); the
files themselves, hub or local, are read with pyarrow (parquet) and fsspec, the same code
for both. JSON lines and text are parsed by `RowParser`, so a corrupt line is skipped and
counted, not fatal.

`check()` is the pre-flight: it reads only metadata or first rows and raises `SourceError`
naming the config key, file and column.
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from data_pipeline.documents import RowParser, parse_filter
from data_pipeline.embedded import embedded_documents
from data_pipeline.errors import BadDataInput
from data_pipeline.failures import failure_kind, retry
from data_pipeline.reading import (
    COMPRESSIONS,
    DecodedGroups,
    Unit,
    binary,
    file_size,
    format_of,
    is_local,
    line_rows,
    line_starts,
    parquet_file,
    parquet_rows,
)

if TYPE_CHECKING:
    from data_pipeline.config import SourceConfig

log = logging.getLogger(__name__)

CHECKED_LINES = 100
"""Lines of a JSON lines file the pre-flight reads for its columns."""
_TEXT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


class SourceError(BadDataInput):
    """A source that cannot be used; `key` is the SourceConfig field at fault."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class Source:
    """One configured source: its files, its units and how to read and parse their rows
    (`decoded`: where row groups read in parts are kept decoded; the sources of a run share
    one)."""

    def __init__(self, cfg: SourceConfig, decoded: DecodedGroups | None = None):
        self.cfg = cfg
        self.decoded = decoded if decoded is not None else DecodedGroups()
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
        return "jsonl" if format_of(files[0]) == "jsonl" else "parquet"

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

        revision = self.cfg.hub_revision
        try:
            builder = datasets.load_dataset_builder(
                self.location, self.config_name, revision=revision
            )
        except Exception as err:  # network, auth, unknown repo/config: all fatal here
            if "scripts are no longer supported" in str(err):  # datasets >= 4
                raise SourceError(
                    "uri", f"hub dataset {self.location!r}"
                    f"{f' at {revision!r}' if revision else ''} has only a loading script "
                    f"({err}); set hub_revision: refs/convert/parquet to read the hub's "
                    "parquet copy of it (of a dataset over 5 GB: its first 5 GB), or give "
                    "the path of its files"
                ) from None  # fmt: skip
            raise SourceError("uri", f"cannot open hub dataset {self.location!r}: {err}") from None
        files = (builder.config.data_files or {}).get(self.cfg.hub_split)
        if not files:
            raise SourceError(
                "hub_split", f"hub dataset {self.location!r} has no files for split "
                f"{self.cfg.hub_split!r}"
            )  # fmt: skip
        if any(f"/partial-{self.cfg.hub_split}/" in str(f) for f in files):
            log.warning(
                "%s: the hub's parquet copy of this dataset is partial (its first 5 GB): a "
                "run reads that part only", self.cfg.uri,
            )  # fmt: skip
        formats = {format_of(f) for f in files}
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
                if not retry(lambda path=path: self._check_file(path), path):
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
        with binary(path) as f:
            return bool(f.read(1))

    def _check_parquet(self, path: str) -> bool:
        meta = self._meta(path)
        if not meta.num_rows:  # nothing to read, whatever its columns (a writer given no rows)
            return False
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
            self._metadata[path] = retry(lambda: parquet_file(path).metadata, path)
        return self._metadata[path]

    def _check_jsonl(self, path: str) -> bool:
        """The columns of the first parseable row among the first CHECKED_LINES (a corrupt
        line is skipped when training, so it need not stop the check)."""
        with binary(path) as f:
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
            elif size := file_size(path):
                compressed = path.endswith(COMPRESSIONS)  # no seeking in a compressed stream
                whole.append(Unit(i, 0, 0, None if compressed else size, size))
        if self.file_format == "text" and self.cfg.text_unit != "line":
            # a document or a paragraph may span any byte: whole files only
            whole = [Unit(u.file, 0, 0, None, u.size) for u in whole]
        units = _cut(whole, pieces)
        if self.file_format != "parquet":
            units = self._at_line_starts(units)
        return units

    def _at_line_starts(self, units: list[Unit]) -> list[Unit]:
        """Byte ranges of line files moved to start where a line starts, each sized by the
        bytes of the lines it owns: a range inside one long line would own none, yet be
        estimated as full (its stream would run dry), and the range where that line starts
        would be estimated as far smaller than it is."""
        out: list[Unit] = []
        for file, group in itertools.groupby(units, key=lambda u: u.file):
            parts, path = list(group), self.files()[file]
            if not self._cut_at_lines(parts):
                out += parts
                continue
            starts = retry(lambda: line_starts(path, [u.start for u in parts]), path)  # noqa: B023
            ends = [*starts[1:], parts[-1].stop]
            out += [Unit(file, 0, a, b, b - a) for a, b in zip(starts, ends, strict=True) if b > a]
        return out

    def cut_at_line_starts(self, units: Sequence[Unit]) -> bool:
        """Whether some of `units` are byte ranges moved to line starts (a state saved
        before that knew other units)."""
        by_file = itertools.groupby(units, key=lambda u: u.file)
        return self.kind != "embedded" and any(self._cut_at_lines(list(g)) for _, g in by_file)

    def _cut_at_lines(self, parts: list[Unit]) -> bool:
        """Whether one file's units are byte ranges that begin at line starts: several of
        a local, uncompressed line file (remote: a seek would fetch a block, per range and
        process)."""
        return (
            self.file_format != "parquet"
            and len(parts) > 1
            and parts[0].stop is not None
            and is_local(self.files()[parts[0].file])
        )

    def fingerprint(self) -> list:
        """What a saved reading position is valid for: the files and their sizes."""
        if self.kind == "embedded":
            return [len(embedded_documents())]
        return [[os.path.basename(p), file_size(p)] for p in self.files()]

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
            yield from parquet_rows(path, self._meta(path), unit, self.columns, skip, self.decoded)
        else:
            rows = line_rows(path, unit, self.file_format, self.cfg.text_unit)
            yield from itertools.islice(rows, skip, None)


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
    kind = format_of(uri) if cfg.format == "auto" else cfg.format
    if kind is None:
        raise SourceError(
            "uri",
            f"unknown data source {uri!r} (expected 'embedded', 'hf:OWNER/NAME[:CONFIG]', "
            "'prepared:DIR', or a path/glob of .parquet, .jsonl[.gz|.zst] or .txt[.gz|.zst] "
            "files; set format for other extensions)",
        )
    return kind, uri, None
