"""Documents, their train/validation split, and turning a source's rows into documents.

A row is whatever a source yields (a parquet row, a JSON line, a text unit). `RowParser`
turns it into a `Document` or names why it cannot be used: rows that are corrupt, not UTF-8
or empty are *skipped* (counted, logged, fatal only above a threshold); rows that fail a
configured filter are *filtered* (a choice, not an error).
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from data_pipeline.errors import BadDataInput

SKIP_REASONS = ("corrupt", "not_utf8", "empty")
"""Why a row is unusable; each is counted separately."""


@dataclass(frozen=True)
class Document:
    """One unit of text with an id that is stable across runs and machines."""

    id: str
    text: str


def split_of(doc_id: str, validation_fraction: float) -> str:
    """'validation' or 'train' by a hash of the id: stable, uniform, needs no state."""
    digest = hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest()
    return "validation" if int.from_bytes(digest) / 2**64 < validation_fraction else "train"


def text_id(text: str) -> str:
    """An id for documents whose source has none: a hash of the content."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}


@dataclass(frozen=True)
class Filter:
    """`column op value`, e.g. int_score >= 3; a row without the column fails it."""

    column: str
    op: str
    value: Any

    def __call__(self, row: dict) -> bool:
        cell = row.get(self.column)
        try:
            return cell is not None and _OPERATORS[self.op](cell, self.value)
        except TypeError:  # e.g. a string compared with a number: the row does not match
            return False


def parse_filter(text: str) -> Filter:
    """'COLUMN OP VALUE' (the value is read as YAML: 3, 0.5, true, en) or a ValueError."""
    for op in sorted(_OPERATORS, key=len, reverse=True):  # '>=' before '>'
        column, sep, value = (part.strip() for part in text.partition(op))
        if sep and column and value and not set(column) & set("=!<>"):
            return Filter(column, op, yaml.safe_load(value))
    raise BadDataInput(
        f"filter {text!r} is not 'COLUMN OP VALUE' with OP one of {' '.join(_OPERATORS)}"
    )


class RowParser:
    """Turns rows into documents, or into the reason they are not used.

    `raw` says how rows arrive: None (columns already, as from parquet), 'json' (a JSON
    line as bytes under 'raw') or 'text' (UTF-8 bytes under 'raw').
    """

    def __init__(
        self,
        text_column: str,
        id_column: str | None,
        filters: Sequence[Filter] = (),
        raw: str | None = None,
    ):
        self.text_column, self.id_column = text_column, id_column
        self.filters, self.raw = tuple(filters), raw

    def __call__(self, row: dict) -> Document | str:
        """The document, or one of SKIP_REASONS, or 'filtered'."""
        if self.raw is not None:
            try:
                row = self._decode(row["raw"])
            except UnicodeDecodeError:
                return "not_utf8"
            except ValueError:  # json.JSONDecodeError is a ValueError
                return "corrupt"
            if not isinstance(row, dict):
                return "corrupt"
        text = row.get(self.text_column)
        if isinstance(text, bytes):  # binary text columns are decoded strictly
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                return "not_utf8"
        if not isinstance(text, str):
            return "corrupt"
        if not text.strip():
            return "empty"
        if self.filters and not all(f(row) for f in self.filters):
            return "filtered"
        if self.id_column is None:
            return Document(text_id(text), text)
        doc_id = row.get(self.id_column)
        return "corrupt" if doc_id is None else Document(str(doc_id), text)

    def _decode(self, raw: bytes) -> Any:
        if self.raw == "json":
            return json.loads(raw)  # bytes: strict UTF-8 (UnicodeDecodeError), then JSON
        return {self.text_column: raw.decode("utf-8")}
