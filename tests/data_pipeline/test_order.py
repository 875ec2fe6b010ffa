"""The order of the windows: a reader's consecutive windows from different documents, and
every step (its tail's too) drawing on about as many documents as it has windows, on a
corpus of long documents; the same draw at every layout is test_stream.py's."""

import pytest
from corpora import (
    documents_per_step,
    expected_documents,
    long_document_rows,
    repeats,
    stream_documents,
    write_parquet,
)
from ranks import Ranks

from data_pipeline.config import DataConfig

READERS, SEQ = 8, 32


@pytest.fixture(scope="module")
def long_documents(tmp_path_factory):
    """100 documents of real prose, lognormal in length around 1,000 characters (about 8
    windows of 32 tokens; a tenth over 30 windows), in 3 parquet files."""
    root = tmp_path_factory.mktemp("long")
    rows = long_document_rows(100, 1000)
    for f in range(3):
        write_parquet(root / f"{f}.parquet", rows[f::3], 20)
    data = DataConfig(
        sources=[{"uri": f"{root}/*.parquet", "id_column": "id"}], readers=READERS,
        num_workers=0, validation_fraction=0.05, seed=3,
    )  # fmt: skip
    return data, rows


def test_consecutive_windows_and_each_step_draw_on_many_documents(
    long_documents, embedded_tokenizer
):
    """2 ranks, one window per reader a step, one epoch (every document once): until the
    epoch's units are all dealt out no reader's window shares a document with its previous
    one, and over the epoch at most 1 in 5 does (in the tail streams run out of documents
    to interleave); every step holds tokens of as many documents as it has windows on
    average over the tail (at least 9/10 of that), and at least half as many in all steps
    but the last twentieth (when only the longest documents are left); the metrics'
    `data/documents_per_step` counts them. (Reading one document after another, a reader
    continued its previous window's document in 98% of its windows.)"""
    data, rows = long_documents
    group = Ranks(2)
    datas = group.build(data, embedded_tokenizer, SEQ, READERS, READERS)
    steps, dealt, counted = [], [], []
    while not steps or datas[0].stats()["data/0/epoch"] == 0:
        steps += group.steps(datas, 1)
        counted.append(datas[0].stats()["data/documents_per_step"])
        deal = datas[0].schedule.deals[0]
        dealt.append(deal.epoch > 0 or deal.handed == len(deal.order))
    assert stream_documents(steps, group.origins) == expected_documents(
        embedded_tokenizer, rows, 0.05
    )
    tail = dealt.index(True) + 1
    documents = documents_per_step(group.origins)
    assert counted[:-1] == documents[:-1]  # (the last: the stats() of the epoch's test)
    repeated = repeats(group.origins)
    assert sum(repeated[: tail - 1]) == 0 and tail > 10
    assert sum(repeated) <= len(repeated) * READERS / 5, sum(repeated)
    assert min(documents[: len(steps) * 19 // 20]) >= READERS / 2
    in_tail = documents[tail:]
    assert sum(in_tail) >= 0.9 * READERS * len(in_tail) and len(in_tail) > 50
    for part in datas:
        part.close()
