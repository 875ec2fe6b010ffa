import pytest

from data_pipeline.embedded import embedded_documents
from data_pipeline.tokenizer import cached_tokenizer


@pytest.fixture(scope="session")
def embedded_tokenizer(cache_dir):
    texts = (d.text for d in embedded_documents())
    return cached_tokenizer(["embedded"], texts, 4096, cache_dir)
