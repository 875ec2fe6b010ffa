"""The data commands behind the CLI (which only parses arguments and prints):

    belief-lm tokenizer train --config CONFIG --output MODEL [section.key=value ...]
    belief-lm prepare --config CONFIG --output DIR [--workers N] [--source I] [...]

Both check the data config first, so bad input fails (exit code 2) before any work.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from belief_lm.config import Config
from data_pipeline.build import build_tokenizer, check_data, open_source, tokenizer_sample
from data_pipeline.prepared import PreparedSource, prepare
from data_pipeline.tokenizer import Tokenizer, train_tokenizer

log = logging.getLogger("belief_lm.data")


def tokenizer_train(cfg: Config, output: str) -> Tokenizer:
    """Train a sentencepiece BPE model (byte fallback; ids unk 0, BOS 1, EOS 2, PAD 3) of
    data.tokenizer.vocab_size pieces on data.tokenizer.sample_documents documents."""
    check_data(cfg.data)
    start = time.perf_counter()
    texts = list(tokenizer_sample(cfg.data, progress=True))
    log.info(
        "training sentencepiece BPE (%d pieces) on %d documents",
        cfg.data.tokenizer.vocab_size,
        len(texts),
    )
    tokenizer = train_tokenizer(texts, cfg.data.tokenizer.vocab_size, output)
    log.info(
        "wrote %s (%d pieces) in %.0f s; use it with data.tokenizer.path=%s (the model pads its "
        "vocabulary to a multiple of model.make_vocab_size_divisible_by x parallel.tensor)",
        output,
        tokenizer.vocab_size,
        time.perf_counter() - start,
        output,
    )
    return tokenizer


def prepare_source(cfg: Config, output: str, workers: int, source_index: int = 0) -> dict:
    """Pre-tokenize data.sources[source_index] into `output` (megatron .bin/.idx per split);
    the tokenizer is the one training would use (data.tokenizer)."""
    check_data(cfg.data)
    if not 0 <= source_index < len(cfg.data.sources):
        raise ValueError(f"--source {source_index}: data.sources has {len(cfg.data.sources)}")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    source = open_source(cfg.data.sources[source_index])
    if isinstance(source, PreparedSource):
        raise ValueError(f"data.sources.{source_index}.uri: {source.cfg.uri} is prepared already")
    tokenizer = build_tokenizer(cfg.data, cfg.run.cache_dir)
    meta = prepare(
        source,
        tokenizer,
        output,
        validation_fraction=cfg.data.validation_fraction,
        workers=workers,
        max_skipped_fraction=cfg.data.max_skipped_fraction,
    )
    log.info(
        "wrote %s: train %d documents / %d tokens, validation %d / %d; train with "
        "data.sources=[prepared:%s]",
        Path(output),
        meta.get("train_documents", 0),
        meta.get("train_tokens", 0),
        meta.get("validation_documents", 0),
        meta.get("validation_tokens", 0),
        output,
    )
    return meta
