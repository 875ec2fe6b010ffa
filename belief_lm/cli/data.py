"""The data commands, on top of data_pipeline:

    belief-lm tokenizer train --config CONFIG --output MODEL [section.key=value ...]
    belief-lm prepare --config CONFIG --output DIR [--workers N] [--source I] [...]

Both check the data config first, so bad input fails (exit code 2) before any work.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from belief_lm import exit_codes
from belief_lm.cli.arguments import AddCommand, add_config, quiet_libraries, run_config
from belief_lm.config import Config
from belief_lm.errors import BadInput

if TYPE_CHECKING:
    from data_pipeline.tokenizer import Tokenizer

log = logging.getLogger("belief_lm.data")


def add_to(add: AddCommand) -> None:
    tokenizer = add("tokenizer", help="tokenizer commands")
    actions = tokenizer.add_subparsers(dest="action", required=True, metavar="ACTION")
    help_text = "train a sentencepiece BPE tokenizer on a sample of data.sources"
    sub = actions.add_parser("train", help=help_text, description=help_text)
    sub.add_argument("--output", "-o", required=True, help="the .model file to write")
    add_config(sub)
    sub.set_defaults(run=train_tokenizer_command)
    help_text = "pre-tokenize a source into megatron-core's indexed format (.bin/.idx)"
    sub = add("prepare", help=help_text, description=help_text)
    sub.add_argument("--output", "-o", required=True, help="directory to write")
    sub.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizing processes")
    sub.add_argument("--source", type=int, default=0, help="index into data.sources")
    add_config(sub)
    sub.set_defaults(run=prepare_command)


def train_tokenizer_command(args: argparse.Namespace) -> int:
    cfg = run_config(args)
    quiet_libraries()
    tokenizer_train(cfg, args.output)
    return exit_codes.DONE


def prepare_command(args: argparse.Namespace) -> int:
    cfg = run_config(args)
    quiet_libraries()
    prepare_source(cfg, args.output, args.workers, args.source)
    return exit_codes.DONE


def tokenizer_train(cfg: Config, output: str) -> Tokenizer:
    """Train a sentencepiece BPE model (byte fallback; ids unk 0, BOS 1, EOS 2, PAD 3) of
    data.tokenizer.vocab_size pieces on data.tokenizer.sample_documents documents."""
    from data_pipeline.build import check_data, tokenizer_sample  # heavy: after the arguments
    from data_pipeline.tokenizer import train_tokenizer

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
    from data_pipeline.build import build_tokenizer, check_data, open_source
    from data_pipeline.prepared import PreparedSource, prepare

    check_data(cfg.data)
    if not 0 <= source_index < len(cfg.data.sources):
        raise BadInput(f"--source {source_index}: data.sources has {len(cfg.data.sources)}")
    if workers < 1:
        raise BadInput(f"--workers must be at least 1, got {workers}")
    source = open_source(cfg.data.sources[source_index])
    if isinstance(source, PreparedSource):
        raise BadInput(f"data.sources.{source_index}.uri: {source.cfg.uri} is prepared already")
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
