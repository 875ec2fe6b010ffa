"""sentencepiece tokenizers: train one on a sample of documents, load one, encode text.

Trained models use BPE with byte fallback (no unknown characters), identity normalisation
and no dummy prefix, so decode(encode(text)) == text; ids 0-3 are unk, bos, eos, pad.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from data_pipeline.errors import BadDataInput

MAX_PIECE_INPUT_BYTES = 4096
"""sentencepiece silently drops training sentences longer than its max_sentence_length;
we cut documents into paragraphs/lines below this size instead."""


class Tokenizer:
    """A loaded sentencepiece model."""

    def __init__(self, model_file: str | Path):
        self.path = Path(model_file)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as err:
            raise BadDataInput(f"cannot load sentencepiece model {self.path}: {err}") from None

    def __getstate__(self) -> dict:
        return {"path": self.path}  # DataLoader workers started by spawn reload the file

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    @property
    def sha256(self) -> str:
        """Fingerprint of the model file (prepared data records which tokenizer made it)."""
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def pad_id(self) -> int:
        return self.sp.pad_id()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(
        self, texts: Sequence[str], add_eos: bool = False, num_threads: int = -1
    ) -> list[list[int]]:
        """Encode many texts in sentencepiece's C++ thread pool (-1: one thread per core;
        DataLoader workers use 1, their parallelism is the workers)."""
        return self.sp.encode(list(texts), add_eos=add_eos, num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))


def training_pieces(texts: Iterable[str]) -> Iterator[str]:
    """Cut documents into paragraphs (then lines, then bytes) that sentencepiece accepts."""
    for text in texts:
        for paragraph in text.split("\n\n"):
            if len(paragraph.encode("utf-8")) <= MAX_PIECE_INPUT_BYTES:
                if paragraph.strip():
                    yield paragraph
                continue
            for line in paragraph.split("\n"):
                while line:
                    head = line.encode("utf-8")[:MAX_PIECE_INPUT_BYTES].decode("utf-8", "ignore")
                    yield head
                    line = line[len(head) :]


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, output: str | Path, max_pieces: int = 2_000_000
) -> Tokenizer:
    """Train a BPE sentencepiece model on `texts` and write it to `output` atomically.

    A failure while reading `texts` is raised as itself (sentencepiece would turn it into
    a bare RuntimeError); one of sentencepiece's own (e.g. too little text for the
    vocabulary) becomes a ValueError naming it."""
    failures: list[Exception] = []

    def pieces() -> Iterator[str]:
        try:
            yield from training_pieces(texts)
        except Exception as err:  # re-raised below, outside sentencepiece's C++ loop
            failures.append(err)

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=pieces(),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
            input_sentence_size=max_pieces,
            shuffle_input_sentence=True,
            max_sentence_length=MAX_PIECE_INPUT_BYTES * 2,
            num_threads=min(16, os.cpu_count() or 1),
            minloglevel=2,
        )
    except RuntimeError as err:
        if failures:
            raise failures[0] from None
        most = re.search(
            r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", str(err)
        )
        if most:
            raise BadDataInput(
                f"data.tokenizer.vocab_size: {vocab_size} pieces cannot be learned from this "
                f"text (at most {most[1]}): set a smaller vocab_size, or train on more text"
            ) from None
        raise BadDataInput(f"training the tokenizer failed: {err}") from None
    if failures:
        raise failures[0]
    return _write_model(model.getvalue(), Path(output))


def _write_model(model: bytes, output: Path) -> Tokenizer:
    """The model written to `output` at once (a reader never sees half a file)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=output.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(model)
    os.replace(tmp.name, output)
    return Tokenizer(output)


def cached_tokenizer(
    key_parts: Sequence[str], texts: Iterable[str], vocab_size: int, cache_dir: str | Path
) -> Tokenizer:
    """The tokenizer trained on `texts`, trained once and then reused from the cache.

    `key_parts` must identify the texts (e.g. source URIs and versions).
    """
    key = hashlib.sha256("\n".join([*key_parts, f"vocab={vocab_size}", spm.__version__]).encode())
    path = Path(cache_dir).expanduser() / "tokenizers" / f"{key.hexdigest()[:16]}.model"
    if path.exists():
        return Tokenizer(path)
    return train_tokenizer(texts, vocab_size, path)


def cached_copy(model: Path, cache_dir: str | Path) -> Tokenizer:
    """Tokenizer model `model` as kept in the cache under its content's hash: a path that
    stays for a model whose own file may go (a checkpoint's, deleted by the run's rotation
    while the run saves the model into every new checkpoint and workers load it by path)."""
    data = model.read_bytes()
    name = f"sha256-{hashlib.sha256(data).hexdigest()[:16]}.model"
    path = Path(cache_dir).expanduser() / "tokenizers" / name
    return Tokenizer(path) if path.exists() else _write_model(data, path)


def copy_model(tokenizer: Tokenizer, destination: str | Path) -> Path:
    """Copy the model file next to a run/checkpoint so it is self-contained."""
    destination = Path(destination)
    shutil.copyfile(tokenizer.path, destination)
    return destination


_process_tokenizer: Tokenizer | None = None


def load_in_process(path: str) -> None:
    """Pool initializer: load the tokenizer once per worker process."""
    global _process_tokenizer
    _process_tokenizer = Tokenizer(path)


def encode_in_process(texts: list[str]) -> tuple[np.ndarray, list[int]]:
    """In a pool worker: the texts' ids (EOS after each) concatenated, and each one's
    length (one array pickles far faster than lists of ints)."""
    ids = _process_tokenizer.encode_batch(texts, add_eos=True, num_threads=1)
    return np.concatenate([np.asarray(x, dtype=np.int32) for x in ids]), [len(x) for x in ids]
