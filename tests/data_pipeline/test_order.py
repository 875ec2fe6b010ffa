"""The order of the windows: a reader's consecutive windows from different documents, and
every step (an epoch's turn too) drawing on at least as many documents as it has windows,
on a corpus of long documents; the same draw at every layout is test_stream.py's."""

import json

import pytest
from corpora import (
    NEVER,
    documents_per_step,
    expected_documents,
    long_document_rows,
    repeats,
    stream_documents,
    write_openwebtext_jsonl,
    write_parquet,
)
from ranks import Ranks

from data_pipeline.config import DataConfig

READERS, SEQ = 8, 32


@pytest.fixture(scope="module", params=["parquet", "jsonl", "mixture"])
def long_documents(request, tmp_path_factory):
    """100 documents of real prose, lognormal in length around 1,000 characters (about 8
    windows of 32 tokens; a tenth over 30 windows): in 3 parquet files, in 3 JSON lines
    files, or half in each (a mixture of equal weights)."""
    root = tmp_path_factory.mktemp("long")
    rows = long_document_rows(100, 1000)
    parquet = {"uri": f"{root}/*.parquet", "id_column": "id"}
    jsonl = {"uri": f"{root}/*.jsonl", "id_column": "id"}
    if request.param == "mixture":
        write_parquet(root / "0.parquet", rows[0::2], 20)
        write_openwebtext_jsonl(root / "1.jsonl", [json.dumps(r).encode() for r in rows[1::2]])
        sources = [parquet, jsonl]
    else:
        for f in range(3):
            if request.param == "parquet":
                write_parquet(root / f"{f}.parquet", rows[f::3], 20)
            else:
                lines = [json.dumps(r).encode() for r in rows[f::3]]
                write_openwebtext_jsonl(root / f"{f}.jsonl", lines)
        sources = [parquet if request.param == "parquet" else jsonl]
    data = DataConfig(
        sources=sources, readers=READERS, num_workers=0, validation_fraction=0.05, seed=3,
    )  # fmt: skip
    return data, rows


def test_consecutive_windows_and_each_step_draw_on_many_documents(
    long_documents, embedded_tokenizer
):
    """2 ranks, one window per reader a step, parquet, JSON lines or a mixture of both,
    until epoch 0 is read whole (every document once): no reader's window shares a
    document with its previous one, and every step, the epoch's turn included, holds
    tokens of at least as many documents as it has windows; the metrics'
    `data/documents_per_step` counts them. (Reading one document after another, a reader
    continued its previous window's document in 98% of its windows; with an epoch that
    ended in a tail, its last steps drew on one document.)"""
    data, rows = long_documents
    group = Ranks(2)
    datas = group.build(data, embedded_tokenizer, SEQ, READERS, READERS)
    deals = datas[0].schedule.deals
    steps, counted, turn = [], [], None
    while any(deal.oldest_epoch() == 0 for deal in deals):
        assert len(steps) < NEVER
        steps += group.steps(datas, 1)
        counted.append(datas[0].stats()["data/documents_per_step"])
        turn = turn or (len(steps) if deals[0].epoch else None)
    assert stream_documents(steps, group.origins, epoch=0) == expected_documents(
        embedded_tokenizer, rows, 0.05
    )
    documents = documents_per_step(group.origins)
    assert counted == documents
    assert sum(repeats(group.origins)) == 0
    assert min(documents) >= READERS and turn < len(steps) - 10
    for part in datas:
        part.close()
