"""Documents and the deterministic train/validation split."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    """One unit of text with an id that is stable across runs and machines."""

    id: str
    text: str


def split_of(doc_id: str, validation_fraction: float) -> str:
    """'validation' or 'train' by a hash of the id: stable, uniform, needs no state."""
    digest = hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest()
    return "validation" if int.from_bytes(digest) / 2**64 < validation_fraction else "train"
