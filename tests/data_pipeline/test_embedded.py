import re

from data_pipeline.embedded import embedded_documents


def test_embedded_corpus_is_real_prose_and_stable():
    docs = embedded_documents()
    assert len(docs) > 500
    assert len({d.id for d in docs}) == len(docs)
    text = " ".join(d.text for d in docs)
    assert len(text) > 500_000
    words = re.findall(r"[A-Za-z]+", text)
    # natural language: common English function words are frequent
    common = sum(w.lower() in {"the", "a", "of", "to", "is", "and", "in"} for w in words)
    assert common / len(words) > 0.1
    assert any(d.id.split("/")[1] == "topics" for d in docs)
    assert any(d.id.split("/")[1] == "stdlib" for d in docs)
    embedded_documents.cache_clear()
    assert embedded_documents() == docs
