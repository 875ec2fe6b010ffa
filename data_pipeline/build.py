"""From the data config to what a trainer consumes: pre-flight checks, the tokenizer, one
data-parallel rank's training and validation batches. This is the pipeline's whole
interface: the trainer imports these functions and nothing deeper."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from data_pipeline.config import DataConfig
from data_pipeline.loader import TrainData
from data_pipeline.prepared import PreparedSource
from data_pipeline.sources import SourceError, open_source
from data_pipeline.stream import DocumentStream, MixedWindows, StreamSettings
from data_pipeline.tokenizer import Tokenizer, cached_tokenizer


def check_data(data: DataConfig) -> None:
    """Fail before any work if a source cannot be used: it must resolve, its files must be
    readable and hold the needed columns (only metadata and first rows are read).

    Raises ValueError naming the key (data.sources.N.uri / text_column / ...), file and column.
    """
    for i, cfg in enumerate(data.sources):
        try:
            open_source(cfg).check()
        except SourceError as err:
            raise ValueError(f"data.sources.{i}.{err}") from None


def build_tokenizer(data: DataConfig, cache_dir: str) -> Tokenizer:
    """The configured tokenizer, that of prepared sources, or one trained on a sample of the
    sources and cached (the sample is read only on a cache miss: in a job, let one rank
    build it first and the others then find it in the cache)."""
    path = data.tokenizer.path
    prepared = [s for s in map(open_source, data.sources) if isinstance(s, PreparedSource)]
    if path is None and prepared:
        path = prepared[0].dir / "tokenizer.model"
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise ValueError(f"data.tokenizer.path: no such file: {path}")
        return Tokenizer(path)
    sampled = {"sources", "validation_fraction", "seed"}  # what decides the sample
    key = [
        json.dumps(data.model_dump(mode="json", include=sampled)),
        f"sample={data.tokenizer.sample_documents}",
    ]
    texts = tokenizer_sample(data, progress=False)  # a generator: read only if not cached
    return cached_tokenizer(key, texts, data.tokenizer.vocab_size, cache_dir)


def tokenizer_sample(data: DataConfig, progress: bool = True) -> Iterator[str]:
    """The first data.tokenizer.sample_documents training documents, shared out over the
    sources by weight, each source read in its epoch-0 order (a progress bar if asked)."""
    total = data.tokenizer.sample_documents
    weights = [s.weight for s in data.sources]
    settings = StreamSettings(
        window=2,
        split="train",
        validation_fraction=data.validation_fraction,
        seed=data.seed,
        max_skipped_fraction=data.max_skipped_fraction,
        epochs=1,
    )
    with tqdm(total=total, desc="tokenizer sample", unit="doc", disable=not progress) as bar:
        for cfg, weight in zip(data.sources, weights, strict=True):
            source = open_source(cfg)
            if isinstance(source, PreparedSource):
                raise ValueError(f"{cfg.uri}: prepared data has no text to train a tokenizer on")
            batches = DocumentStream(source, 0, 1, settings)
            docs = itertools.chain.from_iterable(batches)
            for doc in itertools.islice(docs, round(total * weight / sum(weights))):
                bar.update()
                yield doc.text


def build_train_data(
    data: DataConfig,
    tokenizer: Tokenizer,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
) -> TrainData:
    """This data-parallel rank's endless, resumable training micro-batches (see TrainData)."""
    settings = _settings(data, seq_len, split="train", epochs=None)
    dataset = _windows(data, tokenizer, settings, dp_rank, dp_size)
    layout = {
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "num_workers": data.num_workers,
        "seq_len": seq_len,
        "seed": data.seed,
        "validation_fraction": data.validation_fraction,
        "sources": [s.uri for s in data.sources],
        "source_sizes": [s.size() for s in dataset.sources],  # files added or removed
    }
    return TrainData(dataset, micro_batch_size, data.num_workers, device, layout)


def build_validation_data(
    data: DataConfig,
    tokenizer: Tokenizer,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
    max_batches: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to max_batches (tokens, labels) micro-batches of held-out documents for this rank:
    the same every call, never seen in training. Empty when validation_fraction is 0."""
    if data.validation_fraction == 0:
        return []
    settings = _settings(data, seq_len, split="validation", epochs=1)
    windows = iter(_windows(data, tokenizer, settings, dp_rank, dp_size))
    batches = []
    for _ in range(max_batches):
        chunk = list(itertools.islice(windows, micro_batch_size))
        if len(chunk) < micro_batch_size:
            break
        stacked = torch.stack(chunk).to(device)
        batches.append((stacked[:, :-1], stacked[:, 1:]))
    return batches


def _settings(data: DataConfig, seq_len: int, split: str, epochs: int | None) -> StreamSettings:
    return StreamSettings(
        window=seq_len + 1,
        split=split,
        validation_fraction=data.validation_fraction,
        seed=data.seed,
        max_skipped_fraction=data.max_skipped_fraction,
        epochs=epochs,
    )


def _windows(
    data: DataConfig, tokenizer: Tokenizer, settings: StreamSettings, rank: int, world: int
) -> MixedWindows:
    sources = [open_source(cfg) for cfg in data.sources]
    for source in sources:
        if isinstance(source, PreparedSource):
            source.check_tokenizer(tokenizer)
    weights = [cfg.weight for cfg in data.sources]
    return MixedWindows(sources, weights, tokenizer, settings, rank, world)
