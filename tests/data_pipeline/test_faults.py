"""Data that fails while a run reads it: corrupt row groups (skipped or stopping), files
that vanish, sources with too many unusable rows (judged fairly), and start-up errors."""

import errno
import gzip
import json
import logging
import lzma
import re
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from corpora import (
    FINEWEB_SCHEMA,
    NEVER,
    corrupt_row_group,
    fineweb_rows,
    read_documents,
    source,
    take,
    write_openwebtext_jsonl,
)

from data_pipeline.build import build_train_data
from data_pipeline.config import DataConfig
from data_pipeline.failures import DataFault, failure_kind
from data_pipeline.sources import Source
from data_pipeline.stream import epoch_order, skip_problem

CPU = torch.device("cpu")


def three_row_groups(path):
    """30 FineWeb-Edu rows in row groups of 10."""
    rows = fineweb_rows(30, chars=300)
    pq.write_table(pa.Table.from_pylist(rows, schema=FINEWEB_SCHEMA), path, row_group_size=10)
    return path


@pytest.fixture
def three_groups(tmp_path):
    """Three row groups, the second corrupt."""
    path = three_row_groups(tmp_path / "data.parquet")
    corrupt_row_group(path, 1)
    return path


def one_epoch(data, tokenizer):
    """The data health once epoch 0 was read whole (streams have begun the next one)."""
    batches = build_train_data(data, tokenizer, 32, 4, 4, 0, 1, CPU)
    while batches.schedule.deals[0].oldest_epoch() == 0:
        assert batches.step < NEVER
        take(batches, 1)
    take(batches, 1)  # (the step judged on the whole epoch's counts)
    return batches.stats()


def test_a_corrupt_row_group_is_skipped_and_counted(three_groups, embedded_tokenizer, caplog):
    data = DataConfig(sources=[str(three_groups)], num_workers=0, validation_fraction=0)
    with caplog.at_level(logging.WARNING, logger="data_pipeline.stream"):
        stats = one_epoch(data.model_copy(update={"max_skipped_fraction": 0.5}), embedded_tokenizer)
    # (a step may read on into the next epoch's first units: at least the epoch's counts)
    corrupt, documents = stats["data/0/corrupt_row_group"], stats["data/0/documents"]
    assert corrupt >= 10 and documents >= 20 and corrupt + documents == stats["data/0/rows"]
    assert f"cannot read {three_groups} row group 1 (rows " in caplog.text
    # the same rows are a third of the source: above the default limit, the run stops
    pattern = r"(\d+) of (\d+) rows unusable \(corrupt_row_group \d+\)"
    with pytest.raises(DataFault, match=pattern) as fault:
        one_epoch(data, embedded_tokenizer)
    bad, rows = map(int, re.search(pattern, str(fault.value)).groups())
    assert bad >= 10 and rows >= 30 and 0.25 < bad / rows < 0.45


def test_a_corrupt_row_group_stops_the_run_when_asked(three_groups, embedded_tokenizer):
    data = DataConfig(
        sources=[str(three_groups)], num_workers=1, on_corrupt_row_group="stop",
        validation_fraction=0,
    )  # fmt: skip
    with pytest.raises(DataFault, match=rf"{three_groups} row group 1 .*on_corrupt_row_group=stop"):
        one_epoch(data, embedded_tokenizer)


def test_a_vanished_file_stops_the_run_naming_it(tmp_path, embedded_tokenizer):
    """12 files read by one reader; one late in the epoch's order vanishes after 2 steps:
    the run stops when its turn comes, naming it (a file read in parts may be served from
    the decoded row groups a process keeps; whole files are read from disk)."""
    for i in range(12):
        rows = fineweb_rows(20, offset=20 * i, chars=300)
        pq.write_table(pa.Table.from_pylist(rows, schema=FINEWEB_SCHEMA), tmp_path / f"{i}.parquet")
    data = DataConfig(
        sources=[f"{tmp_path}/*.parquet"], num_workers=1, validation_fraction=0, readers=1
    )
    batches = build_train_data(data, embedded_tokenizer, 32, 4, 4, 0, 1, CPU)
    units = batches.units[0]
    assert all(u.start == 0 and u.stop == 20 for u in units)  # whole files
    late = Path(batches.sources[0].files()[units[epoch_order(12, data.seed, 0)[9]].file])
    take(batches, 2)
    state = batches.state_dict()
    late.unlink()
    where = rf"{late.name} row group 0 \(rows 0-19\) at row \d+: \[Errno 2\] No such file"
    with pytest.raises(DataFault, match=rf"\*\.parquet: cannot read \S+/{where}"):
        for _ in range(200):
            take(batches, 1)
    # nothing of the failed step kept
    assert batches.state_dict()["schedule"]["step"] >= state["schedule"]["step"]


def raised(action) -> BaseException:
    """The error `action()` raises."""
    try:
        action()
    except BaseException as err:
        return err
    raise AssertionError(f"{action} raised nothing")


def unreachable_url() -> str:
    """An http:// address nothing listens at (a port bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/000_00000.parquet"


def network_errors() -> dict[str, BaseException]:
    """What the installed network libraries raise when the hub or a server is unreachable
    (raised for real where a refused connection or a response object can raise them)."""
    import aiohttp
    import fsspec
    import httpx
    import httpx2  # huggingface_hub's HTTP client
    import requests
    import urllib3
    from huggingface_hub.utils import hf_raise_for_status

    url, hub = unreachable_url(), "https://huggingface.co/api/datasets/x/y"
    return {
        "fsspec http (aiohttp), server down": raised(lambda: fsspec.open(url, "rb").open()),
        "requests, server down": raised(lambda: requests.get(url, timeout=30)),
        "httpx, server down": raised(lambda: httpx.get(url)),
        "hf:// files (httpx2), server down": raised(lambda: httpx2.get(url)),
        "the hub, 503": raised(
            lambda: hf_raise_for_status(httpx2.Response(503, request=httpx2.Request("GET", hub)))
        ),
        "aiohttp, connection dropped": aiohttp.ServerDisconnectedError(),
        "aiohttp, payload cut short": aiohttp.ClientPayloadError("Response payload not complete"),
        "requests, chunked read broken": requests.exceptions.ChunkedEncodingError("broken"),
        "urllib3, connection aborted": urllib3.exceptions.ProtocolError("Connection aborted."),
        "a read timed out (socket.timeout)": TimeoutError("timed out"),
        "DNS": socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        "network unreachable": OSError(errno.ENETUNREACH, "Network is unreachable"),
        "connection reset": ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    }


def corrupt_errors(three_groups, tmp_path) -> dict[str, BaseException]:
    """What decoding damaged bytes raises (all for real)."""
    import zstandard

    packed = gzip.compress(bytes(range(256)) * 40)
    zstd = zstandard.ZstdCompressor().compress(bytes(range(256)) * 40)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"text": "a row"}\n' * 2000)[:-100])
    return {
        "parquet data page": raised(lambda: pq.ParquetFile(three_groups).read_row_group(1)),
        "parquet footer": raised(lambda: pq.ParquetFile(pa.BufferReader(b"not parquet" * 9))),
        "gzip cut short": raised(lambda: gzip.decompress(packed[:-20])),
        "gzip garbled": raised(lambda: gzip.decompress(packed[:12] + b"\xff" * 64 + packed[76:])),
        "not gzip": raised(lambda: gzip.decompress(b"plain text")),
        "zstd garbled": raised(
            lambda: zstandard.ZstdDecompressor().decompress(zstd[:6] + bytes(50) + zstd[56:])
        ),
        "xz garbled": raised(lambda: lzma.decompress(b"garbage")),
        "not UTF-8": raised(lambda: b"\xff\xfe".decode()),
        "a line file's stream cut short": raised(lambda: list(_rows_of(cut))),
    }


def _rows_of(path) -> list:
    src = source(str(path))
    return [row for unit in src.units() for row in src.rows(unit)]


def test_read_failures_are_classified_by_what_they_say_of_the_source(three_groups, tmp_path):
    """The network failing (retried, then the source fails), the file gone or the system
    failing (the source fails), the bytes undecodable (only that unit is corrupt), or a
    bug (raised as it is): classified by type, with the real errors of the installed
    libraries, most of which are no builtin ConnectionError (requests' and the hub's are
    OSErrors: taken for corrupt data before)."""
    gone = tmp_path / "gone.jsonl"
    gone.write_bytes(b'{"text": "a row"}\n')
    src = source(str(gone))
    units = src.units()
    gone.unlink()
    sources = {
        "a vanished file, read by lines": raised(lambda: list(src.rows(units[0]))),
        "a vanished file, opened": raised(lambda: pq.ParquetFile(tmp_path / "gone.parquet")),
        "fsspec http, 404": FileNotFoundError("http://example.org/000_00000.parquet"),
        "forbidden": PermissionError(errno.EACCES, "Permission denied"),
        "a disk error": OSError(errno.EIO, "Input/output error"),
    }
    bugs = {"a missing key": KeyError("text"), "a type": TypeError("unsupported operand")}
    cases = {
        **{name: (err, "transport") for name, err in network_errors().items()},
        **{name: (err, "source") for name, err in sources.items()},
        **{name: (err, "corrupt") for name, err in corrupt_errors(three_groups, tmp_path).items()},
        **{name: (err, None) for name, err in bugs.items()},
    }
    got = {name: (repr(err), failure_kind(err)) for name, (err, _) in cases.items()}
    assert got == {name: (repr(err), kind) for name, (err, kind) in cases.items()}


@pytest.mark.parametrize("failures", [2, 3])
def test_a_unit_is_read_again_where_the_network_failed(tmp_path, monkeypatch, caplog, failures):
    """The connection drops after every 3 rows of the first row group, `failures` times:
    read again from the row it had reached, the documents are those of an undisturbed
    read; dropped at every attempt (3), the source fails naming file, row group and row."""
    import requests

    path = three_row_groups(tmp_path / "data.parquet")
    monkeypatch.setattr("data_pipeline.failures.RETRY_PAUSE", 0)
    expected, _ = read_documents(source(str(path)))
    rows, calls = Source.rows, []

    def dropping(self, unit, skip=0):
        calls.append(skip)
        for n, row in enumerate(rows(self, unit, skip)):
            if n == 3 and len(calls) <= failures:
                raise requests.ConnectionError("Connection aborted: RemoteDisconnected")
            yield row

    monkeypatch.setattr(Source, "rows", dropping)
    with caplog.at_level(logging.WARNING, logger="data_pipeline.sources"):
        if failures == 3:
            with pytest.raises(DataFault) as fault:
                read_documents(source(str(path)))
            assert str(fault.value) == (
                f"{path}: cannot read {path} row group 0 (rows 0-9) at row 9: "
                "Connection aborted: RemoteDisconnected (after 3 attempts)"
            )
            return
        docs, counts = read_documents(source(str(path)))
    assert [d.id for d in docs] == [d.id for d in expected] and counts["rows"] == 30
    assert calls == [0, 3, 6, 0, 0]  # then the other two row groups, undisturbed
    assert f"{path} row group 0 (rows 0-9) at row 6: Connection aborted" in caplog.text
    assert "attempt 3 of 3" in caplog.text


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
    rows = stats["data/0/rows"]
    assert rows >= 2000 and 0.007 < stats["data/0/empty"] / rows < 0.01


def test_a_consistently_bad_source_stops(tmp_path, embedded_tokenizer):
    bad_jsonl(tmp_path / "a.jsonl", 4000, lambda i: i % 20 == 0)  # 5%
    data = DataConfig(sources=[str(tmp_path / "a.jsonl")], num_workers=0, validation_fraction=0)
    batches = build_train_data(data, embedded_tokenizer, 32, 4, 4, 0, 1, CPU)
    pattern = (
        r"a\.jsonl: \d+ of \d+ rows unusable \(empty \d+\) in (\d+) of (\d+) units read, more "
        r"than data.max_skipped_fraction=0.01; the first at \S+a\.jsonl byte \d+$"
    )
    with pytest.raises(DataFault, match=pattern) as fault:
        for _ in range(2000):
            take(batches, 1)
    bad, read = re.search(pattern, str(fault.value)).groups()
    assert bad == read  # bad throughout: in every unit
    stats = batches.stats()
    assert stats["data/0/epoch"] == 0 and stats["data/0/rows"] < 4000  # long before the end


def test_one_broken_shard_of_a_clean_corpus_is_skipped_and_counted(tmp_path, embedded_tokenizer):
    """16 .jsonl.gz shards, 30 bad rows at the start of one (0.375% of the corpus, 50% of
    that shard's first unit): the run reads the whole epoch, counting them; the same 30
    bad rows judged as if independent would have stopped it early."""
    for shard in range(16):
        bad_jsonl(tmp_path / f"{shard:02d}.jsonl.gz", 500, lambda i, s=shard: s == 3 and i < 30)
    data = DataConfig(
        sources=[f"{tmp_path}/*.jsonl.gz"], num_workers=1, validation_fraction=0, seed=2
    )
    stats = one_epoch(data, embedded_tokenizer)
    # (the step that finished the epoch may have read the bad rows' unit again)
    assert stats["data/0/rows"] >= 8000 and stats["data/0/empty"] in (30, 60)
    # as the run met it: 1028 rows read in 8 units, one with all 30 bad rows
    met = counts_of([(128, 30)] + [(128, 0)] * 7)
    assert skip_problem("x", met, 0.01, 1000) is None  # judged as a cluster: read on
    share = 30 / 1028  # judged as independent rows, they would have stopped it:
    assert share - 3 * (share * (1 - share) / 1028) ** 0.5 > 0.01


def counts_of(units: list[tuple[int, int]]) -> dict:
    """Counts as streams report them, for units of (rows, unusable rows), all finished."""
    return {
        "rows": sum(r for r, _ in units), "empty": sum(b for _, b in units),
        "units": len(units), "unit_rows": sum(r for r, _ in units),
        "unit_bad": sum(b for _, b in units), "unit_bad2": sum(b * b for _, b in units),
        "unit_rows2": sum(r * r for r, _ in units), "unit_rows_bad": sum(r * b for r, b in units),
        "bad_units": sum(b > 0 for _, b in units),
    }  # fmt: skip


def test_the_skip_rule():
    def problem(units, whole=False):
        return skip_problem("x", counts_of(units), 0.01, 1000, whole)

    assert problem([(150, 4)]) is None  # too few rows to judge
    assert problem([(200, 2)] * 4) is None  # too few units to judge
    assert problem([(125, 2)] * 7 + [(125, 1)]) is None  # 1.5%, but not surely above 1%
    assert problem([(125, 6)] * 8)  # 5% in every unit: surely above
    assert problem([(125, 50)] + [(125, 0)] * 7) is None  # 5%, all of it in one unit
    assert problem([(125, 50)] * 2 + [(125, 0)] * 30) is None  # 2 units of 32: maybe a cluster
    assert problem([(125, 12)] * 30 + [(125, 0)] * 66)  # a third of 96 units at 10%: stops
    assert problem([(1000, 12)], whole=True)  # the exact share of a whole source
    assert problem([(1000, 10)], whole=True) is None  # exactly the limit is allowed


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", b"", "empty.txt: no rows (the source is empty)"),
        ("binary.txt", bytes(range(256)) * 4, "no usable train document in any of its 1 rows"),
        ("utf16.txt", "a document in UTF-16".encode("utf-16"), "any of its 1 rows (not_utf8 1)"),
        ("empty.jsonl", b"", "empty.jsonl: no rows (the source is empty)"),
        ("blank.jsonl", b'{"text": "  "}\n' * 160, "in any of its 160 rows (empty 160)"),
        ("bad.jsonl", b"{oops\n[1]\n" * 3, "none of its first 6 rows is a JSON object"),
    ],
)  # fmt: skip
def test_start_up_data_errors_are_one_clear_line(tmp_path, caplog, name, content, message):
    from data_pipeline.build import check_data

    (tmp_path / name).write_bytes(content)
    for tokenizer in (None, str(tmp_path / "given.model")):  # with a tokenizer or without
        data = DataConfig(sources=[str(tmp_path / name)], tokenizer={"path": tokenizer})
        with pytest.raises(ValueError) as err, caplog.at_level(logging.WARNING):
            check_data(data)
        assert message in str(err.value) and str(err.value).startswith("data.sources.0")
        assert "\n" not in str(err.value) and not caplog.records  # one line, nothing logged


@pytest.mark.parametrize("schema", [FINEWEB_SCHEMA, None])  # None: no columns at all
def test_a_file_without_rows_is_skipped_unless_it_is_the_only_one(tmp_path, caplog, schema):
    from data_pipeline.build import check_data

    pq.write_table(pa.Table.from_pylist([], schema=schema), tmp_path / "0.parquet")
    alone = DataConfig(sources=[str(tmp_path / "0.parquet")])
    with pytest.raises(ValueError, match=r"^data\.sources\.0\.uri: \S+0\.parquet: no rows"):
        check_data(alone)
    three_row_groups(tmp_path / "1.parquet")
    data = DataConfig(sources=[f"{tmp_path}/*.parquet"])
    with caplog.at_level(logging.WARNING):
        check_data(data)
    assert f"{tmp_path / '0.parquet'} has no rows; skipped" in caplog.text
    units = Source(data.sources[0]).units(8)
    assert {u.file for u in units} == {1} and sum(u.stop - u.start for u in units) == 30
