"""From the data config to what a trainer consumes: pre-flight checks, the tokenizer, one
data-parallel rank's training and validation batches. This is the pipeline's whole
interface: the trainer imports these functions and nothing deeper."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from data_pipeline.config import DataConfig, SourceConfig
from data_pipeline.errors import BadDataInput
from data_pipeline.failures import DataFault
from data_pipeline.loader import SINGLE, Collective, ReaderSlots, TrainData
from data_pipeline.prepared import PreparedSource
from data_pipeline.reading import DecodedGroups
from data_pipeline.schedule import UNITS_PER_READER
from data_pipeline.sources import Source, SourceError
from data_pipeline.stream import (
    STUCK_ROWS,
    DocumentReader,
    Position,
    StreamSettings,
    epoch_order,
    skip_problem,
    slot_source,
    stream_for,
)
from data_pipeline.tokenizer import Tokenizer, cached_copy, cached_tokenizer


def open_source(cfg: SourceConfig, decoded: DecodedGroups | None = None) -> Source | PreparedSource:
    """The Source (or PreparedSource, for 'prepared:DIR') of a source config; no I/O.
    `decoded`: where a run's sources keep parquet row groups read in parts."""
    if cfg.uri.startswith("prepared:"):
        return PreparedSource(cfg)
    return Source(cfg, decoded)


def check_data(data: DataConfig) -> None:
    """Fail before any work if a source cannot be used: it must resolve, its files must be
    readable and hold the needed columns, and it must hold a usable document of the split
    a run reads (training, or validation for an evaluation-only source): metadata and the
    first rows are read, up to stream.STUCK_ROWS rows while none is usable.

    Raises ValueError naming the key (data.sources.N.uri / text_column / ...), file and column.
    """
    for i, cfg in enumerate(data.sources):
        try:
            source = open_source(cfg)
            source.check()
        except SourceError as err:
            raise BadDataInput(f"data.sources.{i}.{err}") from None
        if isinstance(source, Source):
            problem = _no_document(source, data)
            if problem:
                raise BadDataInput(f"data.sources.{i}.uri: {problem}")


def _no_document(source: Source, data: DataConfig) -> str | None:
    """Why `source` has no usable document of the run's split, or None: its rows in file
    order until the first one (skips are counted here, not logged)."""
    split = "train" if data.validation_fraction < 1 else "validation"
    settings = _settings(data, 2, split, readers=1)
    reader = DocumentReader(source, settings)
    logger = logging.getLogger("data_pipeline.stream")
    level = logger.level
    logger.setLevel(logging.ERROR)  # one line for the whole source, below
    try:
        for _ in itertools.islice(reader.documents(source.units()), 1):
            return None
    except DataFault as err:
        return str(err).removeprefix(f"{source.cfg.uri}: ")
    finally:
        logger.setLevel(level)
    read = reader.counts["rows"]
    scope = "any of its" if read < STUCK_ROWS else "the first"
    return (
        f"{source.cfg.uri}: no usable {split} document in {scope} {read} rows "
        f"({_describe(reader.counts)})"
    )


def build_tokenizer(
    data: DataConfig, cache_dir: str, trained_with: Path | None = None
) -> Tokenizer:
    """The configured tokenizer, that of prepared sources, or one trained on a sample of the
    sources and cached (the sample is read only on a cache miss: in a job, let one rank
    build it first and the others then find it in the cache). A resumed run passes the
    model its checkpoint holds (`trained_with`; ignored if that has none): used when none
    is configured, whatever the cache holds (another node's, another sentencepiece's), from
    a copy in the cache (the run's rotation may delete that checkpoint); a configured one
    must be that same model."""
    if trained_with is not None and not trained_with.is_file():
        trained_with = None
    path = data.tokenizer.path
    prepared = [s for s in map(open_source, data.sources) if isinstance(s, PreparedSource)]
    if path is None and prepared:
        path = prepared[0].dir / "tokenizer.model"
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise BadDataInput(f"data.tokenizer.path: no such file: {path}")
        tokenizer = Tokenizer(path)
        if trained_with is not None and tokenizer.sha256 != Tokenizer(trained_with).sha256:
            raise BadDataInput(
                f"data.tokenizer.path: {path} is not the tokenizer the checkpoint was trained "
                f"with ({trained_with}): the same ids would stand for other pieces"
            )
        return tokenizer
    if trained_with is not None:
        return cached_copy(trained_with, cache_dir)
    sampled = data.model_dump(mode="json", include={"sources", "validation_fraction", "seed"})
    for source in sampled["sources"]:  # unset: keyed as before the option, caches still match
        if source["hub_revision"] is None:
            del source["hub_revision"]
    key = [json.dumps(sampled), f"sample={data.tokenizer.sample_documents}"]
    texts = tokenizer_sample(data, progress=False)  # a generator: read only if not cached
    return cached_tokenizer(key, texts, data.tokenizer.vocab_size, cache_dir)


def tokenizer_sample(data: DataConfig, progress: bool = True) -> Iterator[str]:
    """The first data.tokenizer.sample_documents training documents, shared out over the
    sources by weight, each source read in its epoch-0 order (a progress bar if asked).
    Raises ValueError if a source has no usable document or too many unusable rows."""
    total = data.tokenizer.sample_documents
    weights = [s.weight for s in data.sources]
    with tqdm(total=total, desc="tokenizer sample", unit="doc", disable=not progress) as bar:
        for i, (cfg, weight) in enumerate(zip(data.sources, weights, strict=True)):
            source = open_source(cfg)
            if isinstance(source, PreparedSource):
                raise BadDataInput(f"{cfg.uri}: prepared data has no text to train a tokenizer on")
            settings = _settings(data, 1, "train", readers=1)
            units = source.units()
            reader = DocumentReader(source, settings)
            ordered = [units[u] for u in epoch_order(len(units), data.seed, 0)]
            wanted, taken = round(total * weight / sum(weights)), 0
            try:
                for doc, *_ in itertools.islice(reader.documents(ordered), wanted):
                    taken += 1
                    bar.update()
                    yield doc.text
            except DataFault as err:
                raise BadDataInput(f"data.sources.{i}: {err}") from None
            problem = skip_problem(  # the whole source, if the sample took all of it
                cfg.uri, reader.counts, data.max_skipped_fraction, data.skip_check_min_rows,
                whole=taken < wanted,
            )  # fmt: skip
            if wanted and not taken:
                problem = problem or (
                    f"{cfg.uri}: no usable training document in {reader.counts['rows']} rows "
                    f"({_describe(reader.counts)})"
                )
            if problem:
                raise BadDataInput(f"data.sources.{i}: {problem}")


def build_train_data(
    data: DataConfig,
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
    collective: Collective = SINGLE,
) -> TrainData:
    """This data-parallel rank's training steps (see TrainData): data.readers logical
    readers (default: one per sequence of the global batch), this rank's share of them."""
    readers = data.readers_for(global_batch_size)
    settings = _settings(data, seq_len + 1, "train", readers=readers)
    settings = dataclasses.replace(settings, lanes=data.open_documents)
    if data.num_workers == 0:  # tokenizing in this process: sentencepiece's thread pool
        settings = dataclasses.replace(settings, threads=-1)
    sources = _open(data, tokenizer, settings)
    units = [_units(source, readers * UNITS_PER_READER, "train") for source in sources]
    slots = ReaderSlots(readers, global_batch_size, dp_rank, dp_size)
    basis = {  # what the positions in a saved state are positions of
        "readers": readers,
        "global_batch_size": global_batch_size,
        "seq_len": seq_len,
        "seed": data.seed,
        "open_documents": data.open_documents,
        "validation_fraction": data.validation_fraction,
        "sources": [s.uri for s in data.sources],
        "weights": [s.weight for s in data.sources],
        "data": [source.fingerprint() for source in sources],  # files added or changed
        "units": [len(u) for u in units],
        "cuts": [_digest(u) for u in units],  # where the units begin and end
    }
    return TrainData(
        sources, units, [s.weight for s in data.sources], tokenizer, settings, slots,
        micro_batch_size, data.num_workers, device, basis,
        max_skipped_fraction=data.max_skipped_fraction,
        skip_check_min_rows=data.skip_check_min_rows, collective=collective,
    )  # fmt: skip


def build_validation_data(
    data: DataConfig,
    tokenizer: Tokenizer,
    seq_len: int,
    micro_batch_size: int,
    device: torch.device,
    max_batches: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to max_batches (tokens, labels) micro-batches of held-out documents: the same
    every call and at every layout (one reader over each source's held-out documents),
    never seen in training. Empty when validation_fraction is 0."""
    if data.validation_fraction == 0:
        return []
    settings = _settings(data, seq_len + 1, "validation", readers=1)
    sources = _open(data, tokenizer, settings)
    weights = [s.weight for s in data.sources]
    streams = []
    for source in sources:  # each source's held-out documents, in file order, once
        units = _units(source, 1, "validation")
        unit_at = functools.partial(_index_below, len(units))
        streams.append(stream_for(source, units, tokenizer, settings, Position(), unit_at))
    windows, active, slot = [], set(range(len(sources))), 0
    while active and len(windows) < max_batches * micro_batch_size:
        s = slot_source(slot, weights)
        slot += 1
        if s not in active:
            continue
        window = streams[s].next_window()
        if window is None or len(window) < settings.window:
            active.discard(s)
        if window is not None and len(window) == settings.window:
            windows.append(torch.from_numpy(window.astype("int64")))
    batches = []
    for start in range(0, len(windows) - micro_batch_size + 1, micro_batch_size):
        stacked = torch.stack(windows[start : start + micro_batch_size]).to(device)
        batches.append((stacked[:, :-1], stacked[:, 1:]))
    return batches


def _settings(data: DataConfig, window: int, split: str, readers: int) -> StreamSettings:
    return StreamSettings(
        window=window,
        split=split,
        validation_fraction=data.validation_fraction,
        seed=data.seed,
        readers=readers,
        on_corrupt_row_group=data.on_corrupt_row_group,
    )


def _open(data: DataConfig, tokenizer: Tokenizer, settings: StreamSettings) -> list:
    """The sources, prepared ones with megatron's indices built (before any worker); they
    share one cache of decoded row groups."""
    decoded = DecodedGroups()
    sources = [open_source(cfg, decoded) for cfg in data.sources]
    for source in sources:
        if isinstance(source, PreparedSource):
            source.check_tokenizer(tokenizer)
            source.open(settings)
    return sources


def _units(source, pieces: int, split: str) -> list:
    """A source's units (a prepared source's: of the split's samples)."""
    if isinstance(source, PreparedSource):
        return source.units(pieces, split)
    return source.units(pieces)


def _digest(units: list) -> int:
    """A checksum of the units' bounds: positions are counted in units."""
    return zlib.crc32(repr([(u.file, u.group, u.start, u.stop) for u in units]).encode())


def _index_below(length: int, k: int) -> int | None:
    """Unit k of a list of `length` units in order (a stream that reads them all, once)."""
    return k if k < length else None


def _describe(counts) -> str:
    """What became of rows that are no document: 'not_utf8 1, empty 3'."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if v and k != "rows") or (
        "nothing read"
    )
