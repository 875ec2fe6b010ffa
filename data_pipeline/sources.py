"""Document sources by URI."""

from __future__ import annotations

from collections.abc import Sequence

from data_pipeline.documents import Document
from data_pipeline.embedded import embedded_documents

KNOWN_SOURCES = ("embedded",)


def open_source(uri: str) -> Sequence[Document]:
    """The documents of source `uri`, or a ValueError naming the URI."""
    if uri == "embedded":
        return embedded_documents()
    raise ValueError(f"unknown data source {uri!r} (known: {', '.join(KNOWN_SOURCES)})")
