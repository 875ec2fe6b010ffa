"""Data that fails while a run reads it: corrupt row groups (skipped or stopping), files
that vanish, sources with too many unusable rows (judged fairly), and start-up errors."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from corpora import FINEWEB_SCHEMA, fineweb_rows, take, write_openwebtext_jsonl

from data_pipeline.build import build_train_data, tokenizer_sample
from data_pipeline.config import DataConfig
from data_pipeline.sources import DataFault
from data_pipeline.stream import skip_problem

CPU = torch.device("cpu")


def corrupt_row_group(path, group: int) -> None:
    """Overwrite the data pages of one row group's text column (the footer stays intact,
    so the file opens and lists its row groups as before)."""
    column = pq.ParquetFile(path).metadata.row_group(group).column(0)
    first = column.dictionary_page_offset or column.data_page_offset
    end = first + column.total_compressed_size  # the chunk, dictionary page included
    with open(path, "r+b") as f:
        f.seek(column.data_page_offset + 4)
        f.write(b"\xba\xad\xf0\x0d" * ((end - column.data_page_offset - 8) // 4))


@pytest.fixture
def three_groups(tmp_path):
    path = tmp_path / "data.parquet"
    rows = fineweb_rows(30, chars=300)
    pq.write_table(pa.Table.from_pylist(rows, schema=FINEWEB_SCHEMA), path, row_group_size=10)
    corrupt_row_group(path, 1)
    return path


def one_epoch(data, tokenizer):
    batches = build_train_data(data, tokenizer, 32, 4, 4, 0, 1, CPU)
    while batches.stats().get("data/0/epoch", 0) == 0:
        take(batches, 1)
    return batches.stats()


def test_a_corrupt_row_group_is_skipped_and_counted(three_groups, embedded_tokenizer, caplog):
    data = DataConfig(sources=[str(three_groups)], num_workers=0, validation_fraction=0)
    with caplog.at_level(logging.WARNING, logger="data_pipeline.stream"):
        stats = one_epoch(data.model_copy(update={"max_skipped_fraction": 0.5}), embedded_tokenizer)
    assert stats["data/0/corrupt_row_group"] == 10 and stats["data/0/documents"] == 20
    assert f"cannot read {three_groups} row group 1 (rows " in caplog.text
    # the same rows are a third of the source: above the default limit, the run stops
    with pytest.raises(DataFault, match=r"10 of 30 rows unusable \(corrupt_row_group 10\)"):
        one_epoch(data, embedded_tokenizer)


def test_a_corrupt_row_group_stops_the_run_when_asked(three_groups, embedded_tokenizer):
    data = DataConfig(
        sources=[str(three_groups)], num_workers=1, on_corrupt_row_group="stop",
        validation_fraction=0,
    )  # fmt: skip
    with pytest.raises(DataFault, match=rf"{three_groups} row group 1 .*on_corrupt_row_group=stop"):
        one_epoch(data, embedded_tokenizer)


def test_a_vanished_file_stops_the_run_naming_it(tmp_path, embedded_tokenizer):
    for i in range(3):
        rows = fineweb_rows(20, offset=20 * i, chars=300)
        pq.write_table(pa.Table.from_pylist(rows, schema=FINEWEB_SCHEMA), tmp_path / f"{i}.parquet")
    data = DataConfig(sources=[f"{tmp_path}/*.parquet"], num_workers=1, validation_fraction=0)
    batches = build_train_data(data, embedded_tokenizer, 32, 4, 4, 0, 1, CPU)
    take(batches, 2)
    state = batches.state_dict()
    (tmp_path / "1.parquet").unlink()
    with pytest.raises(DataFault, match=r"1\.parquet"):
        for _ in range(200):
            take(batches, 1)
    assert batches.state_dict()["step"] >= state["step"]  # nothing of the failed step kept


def bad_jsonl(path, rows: int, bad) -> None:
    lines = [
        b'{"text": ""}' if bad(i) else json.dumps({"text": f"document {i} " * 30}).encode()
        for i in range(rows)
    ]
    write_openwebtext_jsonl(path, lines)


def test_an_early_cluster_of_bad_rows_does_not_stop_a_clean_source(tmp_path, embedded_tokenizer):
    """0.8% bad overall (4 of the first 151 rows, the rest spread out): trains a whole
    epoch; judged on the running share of a small early sample it would have stopped."""
    early = {10, 40, 90, 150}
    bad_jsonl(tmp_path / "a.jsonl", 2000, lambda i: i in early or (i > 151 and i % 167 == 0))
    data = DataConfig(sources=[str(tmp_path / "a.jsonl")], num_workers=0, validation_fraction=0)
    stats = one_epoch(data, embedded_tokenizer)
    assert stats["data/0/rows"] == 2000 and 0.007 < stats["data/0/empty"] / 2000 < 0.01


def test_a_consistently_bad_source_stops(tmp_path, embedded_tokenizer):
    bad_jsonl(tmp_path / "a.jsonl", 4000, lambda i: i % 20 == 0)  # 5%
    data = DataConfig(sources=[str(tmp_path / "a.jsonl")], num_workers=0, validation_fraction=0)
    batches = build_train_data(data, embedded_tokenizer, 32, 4, 4, 0, 1, CPU)
    with pytest.raises(DataFault, match=r"a\.jsonl: \d+ of \d+ rows unusable \(empty \d+\), more"):
        for _ in range(2000):
            take(batches, 1)
    stats = batches.stats()
    assert stats["data/0/epoch"] == 0 and stats["data/0/rows"] < 4000  # long before the end


def test_the_skip_rule():
    def problem(skipped, rows, whole=False):
        return skip_problem("x", {"rows": rows, "empty": skipped}, 0.01, 1000, whole)

    assert problem(4, 151) is None  # too few rows to judge
    assert problem(12, 1000) is None  # 1.2% but not surely above 1%
    assert problem(50, 1000)  # 5%: surely above
    assert problem(12, 1000, whole=True)  # the exact share of a whole source
    assert problem(10, 1000, whole=True) is None  # exactly the limit is allowed


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", b"", "empty.txt: 1 of 1 rows unusable (empty 1)"),
        ("binary.txt", bytes(range(256)) * 4, "binary.txt: 1 of 1 rows unusable (not_utf8 1)"),
        ("empty.jsonl", b"", "empty.jsonl: no rows (the file is empty)"),
        ("bad.jsonl", b"{oops\n[1]\n" * 3, "none of its first 6 rows is a JSON object"),
    ],
)
def test_start_up_data_errors_are_one_clear_line(tmp_path, name, content, message):
    from data_pipeline.build import check_data

    (tmp_path / name).write_bytes(content)
    data = DataConfig(sources=[str(tmp_path / name)])
    with pytest.raises(ValueError) as err:
        check_data(data)
        list(tokenizer_sample(data, progress=False))
    assert message in str(err.value) and str(err.value).startswith("data.sources.0")
