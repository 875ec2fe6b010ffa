"""Fixtures: the default run's tokenizer and a FineWeb-Edu-shaped repository."""

from __future__ import annotations

from pathlib import Path

import pytest
from corpora import write_fineweb

from data_pipeline.build import build_tokenizer
from data_pipeline.config import DataConfig


@pytest.fixture(scope="session")
def embedded_tokenizer(cache_dir):
    """The default run's tokenizer (the same cache key as training, so trained once)."""
    return build_tokenizer(DataConfig(), cache_dir)


@pytest.fixture
def fineweb(tmp_path) -> tuple[Path, list[dict]]:
    """A FineWeb-Edu-schema repository: 3 files x 40 rows, row groups of 15 (9 shards)."""
    return tmp_path / "fineweb-edu", write_fineweb(tmp_path / "fineweb-edu")
