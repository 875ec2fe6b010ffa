"""The embedded default corpus: documentation that ships with every Python installation.

Real English prose available offline on any fresh machine: the language-reference topics
behind `help()` (pydoc_data) and the docstrings of the standard library's modules, classes
and functions (read with `ast`, nothing is imported). The text depends on the Python
version, which is part of every document id.
"""

from __future__ import annotations

import ast
import functools
import sys
import sysconfig
from pathlib import Path

from data_pipeline.documents import Document

MIN_DOCSTRING_CHARS = 200
"""Shorter docstrings are mostly one-line summaries: too little prose to be a document."""
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@functools.lru_cache(maxsize=1)
def embedded_documents() -> tuple[Document, ...]:
    """All documents of the embedded corpus, in a fixed order."""
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    docs = [Document(f"{version}/topics/{name}", text) for name, text in _pydoc_topics()]
    docs += [Document(f"{version}/stdlib/{ref}", text) for ref, text in _stdlib_docstrings()]
    if not docs:
        raise RuntimeError("the embedded corpus is empty: this Python ships no documentation")
    return tuple(docs)


def _pydoc_topics() -> list[tuple[str, str]]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it
        return []
    return sorted(topics.items())


def _stdlib_docstrings() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIPPED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        for node in ast.walk(tree):
            if not isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            ):
                continue
            text = ast.get_docstring(node)
            if text and len(text) >= MIN_DOCSTRING_CHARS:
                name = getattr(node, "name", "")
                found.append((f"{module}:{name}:{getattr(node, 'lineno', 0)}", text))
    return found
