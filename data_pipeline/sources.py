"""Document sources: the Hugging Face hub, local files, the embedded corpus.

Every source is a `datasets.IterableDataset` in streaming mode, so sharding, positions and
resume are the library's: the hub (`load_dataset(repo, name, streaming=True)`) and local
parquet (`load_dataset("parquet", data_files=...)`) share the parquet reader and everything
after it. JSON lines and text files are read by our own generators (wrapped as datasets)
because the library's JSON reader fails a whole file on one corrupt line, while we skip and
count bad rows; both yield raw bytes that `RowParser` decodes.

`check()` is the pre-flight: it reads only metadata or first rows and raises `SourceError`
naming the config key, file and column.
"""

from __future__ import annotations

import contextlib
import glob
import io
import itertools
import json
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import datasets
import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from datasets.distributed import split_dataset_by_node

from data_pipeline.documents import RowParser, parse_filter
from data_pipeline.embedded import embedded_documents
from data_pipeline.stream import SourceWindows, StreamSettings
from data_pipeline.tokenizer import Tokenizer

if TYPE_CHECKING:
    from data_pipeline.config import SourceConfig

log = logging.getLogger(__name__)

EMBEDDED_SHARDS = 64
"""The embedded corpus is cut into this many strided shards so workers can share it."""
_EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".txt": "text"}
_COMPRESSIONS = (".gz", ".zst")
_TEXT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


class SourceError(ValueError):
    """A source that cannot be used; `key` is the SourceConfig field at fault."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class Source:
    """One configured source: how to open it as a dataset and parse its rows."""

    def __init__(self, cfg: SourceConfig):
        self.cfg = cfg
        self.kind, self.location, self.config_name = _parse_uri(cfg)
        raw = {"jsonl": "json", "text": "text"}.get(self.kind)
        id_column = "id" if self.kind == "embedded" else cfg.id_column
        self.parser = RowParser(
            cfg.text_column, id_column, [parse_filter(f) for f in cfg.filters], raw
        )
        self._dataset: datasets.IterableDataset | None = None

    def __repr__(self) -> str:
        return f"Source({self.cfg.uri!r})"

    @property
    def columns(self) -> list[str]:
        """The columns this source needs from each row."""
        cols = [self.cfg.text_column, self.cfg.id_column, *(f.column for f in self.parser.filters)]
        return list(dict.fromkeys(c for c in cols if c is not None))

    def files(self) -> list[str]:
        """The local files of a file source, sorted; a SourceError if none match."""
        files = sorted(glob.glob(os.path.expanduser(self.location), recursive=True))
        if not files:
            raise SourceError("uri", f"no files match {self.location!r}")
        return files

    def check(self) -> None:
        """Pre-flight: the source opens and has the needed columns (metadata/first rows)."""
        if self.kind == "hub":
            self.dataset()  # resolves the files and checks the columns of the dataset's schema
            return
        for path in self.files() if self.kind != "embedded" else []:
            try:
                if self.kind == "parquet":
                    self._check_parquet(path)
                elif self.kind == "jsonl":
                    self._check_jsonl(path)
                else:
                    with _binary(path) as f:
                        f.read(1)
            except (OSError, EOFError, pa.ArrowException) as err:
                raise SourceError("uri", f"cannot read {path}: {err}") from None

    def _check_parquet(self, path: str) -> None:
        schema = pq.read_schema(path)
        self._require_columns(path, schema.names)
        kind = schema.field(self.cfg.text_column).type
        if kind not in _TEXT_TYPES:
            raise SourceError(
                "text_column",
                f"{path}: column {self.cfg.text_column!r} has type {kind}, not a string",
            )

    def _check_jsonl(self, path: str) -> None:
        with _binary(path) as f:
            line = next((x for x in f if x.strip()), b"")
        try:
            row = json.loads(line) if line else {}
        except ValueError as err:
            raise SourceError("uri", f"{path}: first line is not JSON: {err}") from None
        if not isinstance(row, dict):
            raise SourceError("uri", f"{path}: first line is not a JSON object")
        self._require_columns(path, list(row))

    def _require_columns(self, where: str, present: list[str]) -> None:
        filters = {f.column for f in self.parser.filters}
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

    def dataset(self) -> datasets.IterableDataset:
        """The whole source as a streaming dataset, split into as many shards as it allows
        (parquet: one per row group). Built once; opening a hub dataset needs the network."""
        if self._dataset is None:
            ds = self._open()
            if self.kind in ("hub", "parquet"):
                if ds.features is not None:
                    self._require_columns(self.cfg.uri, list(ds.features))
                ds = ds.select_columns(self.columns)
            self._dataset = ds.reshard()
        return self._dataset

    def _open(self) -> datasets.IterableDataset:
        if self.kind == "hub":
            try:
                return datasets.load_dataset(
                    self.location, self.config_name, split=self.cfg.hub_split, streaming=True
                )
            except Exception as err:  # network, auth, unknown repo/config: all fatal here
                raise SourceError(
                    "uri", f"cannot open hub dataset {self.location!r}: {err}"
                ) from None
        if self.kind == "parquet":
            return datasets.load_dataset(
                "parquet", data_files=self.files(), split="train", streaming=True
            )
        if self.kind == "embedded":
            n = len(embedded_documents())
            shards = [list(range(i, n, EMBEDDED_SHARDS)) for i in range(EMBEDDED_SHARDS)]
            return datasets.IterableDataset.from_generator(
                _embedded_rows, gen_kwargs={"shards": shards}
            )
        if self.kind == "jsonl":
            return datasets.IterableDataset.from_generator(
                _jsonl_rows, gen_kwargs={"files": self.files()}
            )
        return datasets.IterableDataset.from_generator(
            _text_rows, gen_kwargs={"files": self.files(), "unit": self.cfg.text_unit}
        )

    def open(self, settings: StreamSettings) -> None:
        """Resolve the files and shards once, in the main process, before workers fork."""
        self.dataset()

    def size(self) -> int:
        """Its shard count: a saved stream position is valid only for the same shards."""
        return self.dataset().num_shards

    def windows(
        self, tokenizer: Tokenizer, stream: int, num_streams: int, settings: StreamSettings
    ) -> SourceWindows:
        """This source's windows for one stream."""
        return SourceWindows(self, tokenizer, stream, num_streams, settings)

    def for_stream(
        self, stream: int, num_streams: int, seed: int, epoch: int
    ) -> datasets.IterableDataset:
        """The part of epoch `epoch` that stream `stream` of `num_streams` reads.

        Shards are put in a seeded order per epoch, then dealt out to the streams (every
        stream gets at least one); with fewer shards than streams every stream reads all
        rows and keeps every num_streams-th. Either way each row goes to exactly one stream.
        """
        ds = self.dataset()
        n = ds.num_shards
        if n > 1:
            order = np.random.default_rng([seed, epoch]).permutation(n)
            ds = datasets.concatenate_datasets([ds.shard(n, int(i)) for i in order])
        strategy = "shards" if n >= num_streams else "examples"
        if strategy == "examples" and num_streams > 1 and stream == 0 and epoch == 0:
            log.warning(
                "%s has %d shard(s) for %d streams (ranks x workers): every stream reads all "
                "of it; more files (or row groups) would avoid that",
                self.cfg.uri,
                n,
                num_streams,
            )
        return split_dataset_by_node(ds, rank=stream, world_size=num_streams, strategy=strategy)


def open_source(cfg: SourceConfig):
    """The Source (or PreparedSource, for 'prepared:DIR') of a source config; no I/O."""
    if cfg.uri.startswith("prepared:"):
        from data_pipeline.prepared import PreparedSource  # prepared.py builds on this module

        return PreparedSource(cfg)
    return Source(cfg)


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
    kind = cfg.format
    if kind == "auto":
        stem = uri
        for ext in _COMPRESSIONS:
            stem = stem.removesuffix(ext)
        kind = _EXTENSIONS.get(os.path.splitext(stem)[1])
    if kind is None:
        raise SourceError(
            "uri",
            f"unknown data source {uri!r} (expected 'embedded', 'hf:OWNER/NAME[:CONFIG]', "
            "'prepared:DIR', or a path/glob of .parquet, .jsonl[.gz|.zst] or .txt[.gz|.zst] "
            "files; set format for other extensions)",
        )
    return kind, uri, None


def _embedded_rows(shards: list[list[int]]) -> Iterator[dict]:
    docs = embedded_documents()
    for shard in shards:
        for i in shard:
            yield {"id": docs[i].id, "text": docs[i].text}


def _jsonl_rows(files: list[str]) -> Iterator[dict]:
    for path in files:
        for n, line in _numbered_lines(path):
            if line.strip():
                yield {"raw": line, "where": f"{path}:{n}"}


def _text_rows(files: list[str], unit: str) -> Iterator[dict]:
    for path in files:
        if unit == "document":
            yield {"raw": b"".join(line for _, line in _numbered_lines(path)), "where": path}
        elif unit == "line":
            for n, line in _numbered_lines(path):
                if line.strip():
                    yield {"raw": line.rstrip(b"\r\n"), "where": f"{path}:{n}"}
        else:
            yield from _paragraphs(path)


def _paragraphs(path: str) -> Iterator[dict]:
    lines, start = [], 0
    for n, line in itertools.chain(_numbered_lines(path), [(0, b"")]):  # a blank line ends one
        if line.strip():
            start = start or n
            lines.append(line)
        elif lines:
            yield {"raw": b"".join(lines).rstrip(b"\r\n"), "where": f"{path}:{start}"}
            lines, start = [], 0


def _numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a file, decompressing .gz / .zst; read errors name the file."""
    n = 0
    try:
        with _binary(path) as f:
            for n, line in enumerate(f, 1):
                yield n, line
    except (OSError, EOFError) as err:
        raise OSError(f"{path}: unreadable after line {n}: {err}") from err


@contextlib.contextmanager
def _binary(path: str) -> Iterator[io.BufferedReader]:
    """`path` opened for buffered binary reading, .gz / .zst decompressed by extension
    (zstandard's reader cannot iterate lines by itself)."""
    with fsspec.open(path, "rb", compression="infer") as f:
        yield io.BufferedReader(f)
