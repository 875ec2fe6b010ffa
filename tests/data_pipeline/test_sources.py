"""Sources: the hub code path on local files, the local formats, filters, bad input."""

import gzip
import itertools
import json
import logging

import datasets
import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from corpora import (
    fineweb_rows,
    jsonl_lines,
    read_documents,
    source,
    texts,
    write_openwebtext_jsonl,
)

from belief_lm.config import ConfigError, load_config
from data_pipeline.build import check_data
from data_pipeline.config import DataConfig
from data_pipeline.documents import text_id


def test_hub_path_and_local_glob_read_the_same_fineweb_rows(fineweb):
    root, rows = fineweb
    hub = source(f"hf:{root}:sample-10BT", id_column="id")  # load_dataset(repo, name): README
    local = source(f"{root}/sample/10BT/*.parquet", id_column="id")
    assert hub.files() == local.files() and len(hub.units()) == 9  # 3 files x 3 row groups
    hub_docs, counts = read_documents(hub)
    assert hub_docs == read_documents(local)[0]
    assert sorted((d.id, d.text) for d in hub_docs) == sorted((r["id"], r["text"]) for r in rows)
    assert counts["rows"] == counts["documents"] == len(rows)


def test_openwebtext_schema_in_every_local_format(tmp_path):
    docs = texts(30)
    pq.write_table(pa.table({"text": docs}), tmp_path / "owt.parquet")
    write_openwebtext_jsonl(tmp_path / "owt.jsonl", jsonl_lines(docs))
    write_openwebtext_jsonl(tmp_path / "owt.jsonl.gz", jsonl_lines(docs))
    (tmp_path / "owt.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(b"".join(x + b"\n" for x in jsonl_lines(docs)))
    )
    (tmp_path / "txt").mkdir()
    for i, doc in enumerate(docs):
        (tmp_path / "txt" / f"{i:03d}.txt.gz").write_bytes(gzip.compress(doc.encode()))
    expected = sorted((text_id(t), t) for t in docs)  # no id column: ids hash the text
    for uri in ["owt.parquet", "owt.jsonl", "owt.jsonl.gz", "owt.jsonl.zst", "txt/*.txt.gz"]:
        got, counts = read_documents(source(str(tmp_path / uri)))
        assert sorted((d.id, d.text) for d in got) == expected, uri
        assert counts["documents"] == 30, uri


def test_text_units_paragraph_and_line(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n\n\nthree\n\nfour")
    paragraphs, _ = read_documents(source(str(tmp_path / "a.txt"), text_unit="paragraph"))
    lines, _ = read_documents(source(str(tmp_path / "a.txt"), text_unit="line"))
    assert [d.text for d in paragraphs] == ["one\ntwo", "three", "four"]
    assert [d.text for d in lines] == ["one", "two", "three", "four"]


def test_filters_keep_matching_rows(fineweb):
    root, rows = fineweb
    src = source(f"hf:{root}:sample-10BT", id_column="id", filters=["int_score >= 3"])
    docs, counts = read_documents(src)
    keep = {r["id"] for r in rows if r["int_score"] >= 3}
    assert 0 < len(keep) < len(rows)
    assert {d.id for d in docs} == keep
    assert counts["filtered"] == len(rows) - len(keep)


def test_bad_rows_are_skipped_counted_and_logged(tmp_path, caplog):
    good = jsonl_lines(texts(6))
    bad = [b'{"text": "unterminated', b'{"text": "caf\xe9"}', b'{"text": "  "}', b'{"txt": 1}']
    lines = good[:2] + bad[:2] + good[2:4] + bad[2:] + [b"[1, 2]"] + good[4:]
    path = tmp_path / "owt.jsonl"
    write_openwebtext_jsonl(path, lines)
    with caplog.at_level(logging.WARNING, logger="data_pipeline.stream"):
        docs, counts = read_documents(source(str(path)))
    assert [d.text for d in docs] == texts(6)
    assert (counts["corrupt"], counts["not_utf8"], counts["empty"]) == (3, 1, 1)
    logged = caplog.text
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line) + 1)
    for line, reason in [(3, "corrupt"), (4, "not_utf8"), (7, "empty"), (8, "corrupt")]:
        assert f"skipped a row ({reason}) at {path} byte {offsets[line - 1]}" in logged


def test_bad_parquet_cells_are_skipped(tmp_path):
    cells = [b"fine text", b"\xff\xfe broken", b"", None, b"more text"]
    pq.write_table(pa.table({"text": pa.array(cells, pa.binary())}), tmp_path / "b.parquet")
    docs, counts = read_documents(source(str(tmp_path / "b.parquet")))
    assert [d.text for d in docs] == ["fine text", "more text"]
    assert (counts["not_utf8"], counts["empty"], counts["corrupt"]) == (1, 1, 1)


def test_parquet_skips_name_the_file_row_group_and_row(tmp_path, caplog):
    cells = [f"text {i}".encode() for i in range(10)]
    cells[7] = b"\xff not utf-8"
    path = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": pa.array(cells, pa.binary())}), path, row_group_size=4)
    with caplog.at_level(logging.WARNING, logger="data_pipeline.stream"):
        docs, counts = read_documents(source(str(path)))
    assert len(docs) == 9 and counts["not_utf8"] == 1
    assert f"skipped a row (not_utf8) at {path} row group 1 row 3" in caplog.text


def check(tmp_path, uri, **fields):
    with pytest.raises(ValueError) as err:
        check_data(DataConfig(sources=[{"uri": str(tmp_path / uri), **fields}]))
    return str(err.value)


def test_preflight_names_the_key_file_and_column(tmp_path):
    rows = fineweb_rows(4)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows).drop_columns(["id"]), tmp_path / "b.parquet")
    message = check(tmp_path, "*.parquet", id_column="id")
    assert message.startswith(f"data.sources.0.id_column: {tmp_path / 'b.parquet'}: no column 'id'")
    message = check(tmp_path, "a.parquet", text_column="content")
    assert (
        "data.sources.0.text_column: " in message
        and "no column 'content' (columns: text, id" in message
    )
    message = check(tmp_path, "a.parquet", filters=["int_scor >= 3"])
    assert message.startswith(
        f"data.sources.0.filters: {tmp_path / 'a.parquet'}: no column 'int_scor'"
    )
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    message = check(tmp_path, "ints.parquet")
    assert message == (
        f"data.sources.0.text_column: {tmp_path / 'ints.parquet'}: column 'text' has type int64, "
        "not a string"
    )
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    assert check(tmp_path, "junk.parquet").startswith(
        f"data.sources.0.uri: cannot read {tmp_path / 'junk.parquet'}: "
    )
    (tmp_path / "junk.jsonl.gz").write_bytes(b"not gzip")
    assert check(tmp_path, "junk.jsonl.gz").startswith("data.sources.0.uri: cannot read ")
    write_openwebtext_jsonl(tmp_path / "c.jsonl", [b'{"content": "x"}'])
    assert check(tmp_path, "c.jsonl") == (
        f"data.sources.0.text_column: {tmp_path / 'c.jsonl'}: no column 'text' (columns: content)"
    )
    assert check(tmp_path, "none/*.parquet") == (
        f"data.sources.0.uri: no files match '{tmp_path / 'none/*.parquet'}'"
    )
    assert "data.sources.0.uri: unknown data source" in check(tmp_path, "file.csv")
    with pytest.raises(ValueError, match=r"data\.sources\.0\.uri: .* is not a finished `belief-lm"):
        check_data(DataConfig(sources=[f"prepared:{tmp_path}"]))


def test_preflight_of_an_unreachable_hub_dataset(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ValueError,
        match=r"data\.sources\.0\.uri: cannot open hub dataset "
        r"'HuggingFaceFW/fineweb-edu': Couldn't reach",
    ):
        check_data(DataConfig(sources=["hf:HuggingFaceFW/fineweb-edu:sample-10BT"]))


def test_a_hub_dataset_of_only_a_loading_script_says_what_to_set(tmp_path):
    """`datasets` (>= 4) refuses a dataset that ships a loading script (OpenWebText's repo
    did): the pre-flight names the key that reads the hub's parquet copy of it instead.
    Here a local directory holding `<name>.py`, which `datasets` refuses alike."""
    root = tmp_path / "openwebtext"
    root.mkdir()
    (root / "openwebtext.py").write_text("import datasets\n")
    with pytest.raises(
        ValueError,
        match=r"data\.sources\.0\.uri: hub dataset '.*openwebtext' has only a loading script "
        r"\(Dataset scripts are no longer supported, but found openwebtext\.py\); set "
        r"hub_revision: refs/convert/parquet",
    ):
        check_data(DataConfig(sources=[f"hf:{root}"]))


def test_a_hub_revision_reads_the_hubs_parquet_copy(tmp_path, monkeypatch, caplog):
    """hub_revision goes to `datasets`, which resolves the files of that branch; the
    hub's parquet copy (refs/convert/parquet: CONFIG/SPLIT/NNNN.parquet, partial-SPLIT for a
    dataset over 5 GB), laid out here locally, is read whole, with a warning that it is
    partial."""
    part = tmp_path / "openwebtext/plain_text/partial-train"
    part.mkdir(parents=True)
    docs = texts(20)
    for i in range(2):
        pq.write_table(pa.table({"text": docs[i::2]}), part / f"{i:04d}.parquet")
    revisions, real = [], datasets.load_dataset_builder

    def load_dataset_builder(path, name=None, **options):
        revisions.append(options.get("revision"))
        return real(path, name, **options)

    monkeypatch.setattr(datasets, "load_dataset_builder", load_dataset_builder)
    src = source(f"hf:{tmp_path}/openwebtext", hub_revision="refs/convert/parquet")
    with caplog.at_level(logging.WARNING):
        got, counts = read_documents(src)
    assert revisions == ["refs/convert/parquet"]
    assert sorted(d.text for d in got) == sorted(docs) and counts["documents"] == 20
    assert "parquet copy of this dataset is partial (its first 5 GB)" in caplog.text


def test_shipped_hub_configs_name_the_real_datasets():
    fineweb = load_config("configs/data/fineweb-edu.yaml").data.sources[0]
    assert (fineweb.uri, fineweb.id_column, fineweb.filters) == (
        "hf:HuggingFaceFW/fineweb-edu:sample-10BT",
        "id",
        ["int_score >= 3"],
    )
    assert load_config("configs/data/openwebtext.yaml").data.sources[0].uri == (
        "hf:Skylion007/openwebtext"
    )


@pytest.mark.parametrize("bad", ["int_score => 3", "int_score", ">= 3", "x < "])
def test_filter_syntax_is_checked_with_the_config(bad):
    with pytest.raises(
        ConfigError, match=r"data\.sources\.0\.filters: filter .* is not 'COLUMN OP"
    ):
        load_config(None, [f"data.sources=[{{uri: x.parquet, filters: ['{bad}']}}]"])


def test_a_row_group_read_in_parts_is_decoded_once(tmp_path, monkeypatch):
    """A small corpus's row group cut into parts for its readers: every part reads its own
    rows (a restored position inside a part included), from one decoding of the group."""
    rows = fineweb_rows(40)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=40)
    src = source(str(tmp_path / "a.parquet"), id_column="id")
    parts = src.units(8)
    assert len(parts) == 8 and {(p.group, p.stop - p.start) for p in parts} == {(0, 5)}
    decoded = []  # a new source: none of its groups is decoded yet
    read_row_group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile, "read_row_group",
        lambda self, *a, **k: decoded.append(a) or read_row_group(self, *a, **k),
    )  # fmt: skip
    read = [row["id"] for part in parts for row, _ in src.rows(part)]
    assert read == [row["id"] for row in rows] and len(decoded) == 1
    row, where = next(src.rows(parts[3], skip=2))
    assert row["id"] == rows[17]["id"] and where.endswith("row group 0 row 17")


@pytest.mark.parametrize("fmt", ["jsonl", "txt"])
def test_line_files_are_cut_where_lines_start(tmp_path, fmt):
    """A file cut into byte ranges for its readers: each range starts at a line and is
    sized by the lines it owns, so a long line is one range of its true size rather than
    one short range followed by ranges that own no line; every line is read once."""
    lengths = [30, 20, 4000, 25, 40, 3000, 10, 15, 35]  # two lines each span many cuts
    texts_ = ["".join(chr(97 + (i + k) % 26) for k in range(n)) for i, n in enumerate(lengths)]
    path = tmp_path / f"a.{fmt}"
    with open(path, "w", newline="\n") as f:
        f.writelines((json.dumps({"text": t}) if fmt == "jsonl" else t) + "\n" for t in texts_)
    src = source(str(path), text_unit="line")  # (a .txt's default: the whole file)
    units = src.units(40)
    assert all(u.size == u.stop - u.start > 0 for u in units)
    assert units[0].start == 0 and units[-1].stop == path.stat().st_size
    assert all(a.stop == b.start for a, b in itertools.pairwise(units))
    raw = path.read_bytes()
    assert all(u.start == 0 or raw[u.start - 1 : u.start] == b"\n" for u in units)
    big = [u for u in units if u.size > 3000]
    assert len(big) == 2 and len(units) < 40
    read = [row["raw"] for u in units for row, _ in src.rows(u)]
    assert [r.decode().rstrip("\n") for r in read] == (
        [json.dumps({"text": t}) for t in texts_] if fmt == "jsonl" else texts_
    )


def test_remote_line_files_keep_byte_cuts(tmp_path, monkeypatch):
    """Finding line starts in a remote file would fetch a block per range, in every
    process: remote files keep ranges of equal bytes (lines still read once each)."""
    import data_pipeline.sources

    path = tmp_path / "a.jsonl"
    write_openwebtext_jsonl(path, jsonl_lines([f"document {i} " * (1 + i % 50) for i in range(60)]))
    monkeypatch.setattr(data_pipeline.sources, "is_local", lambda path: False)
    src = source(str(path))
    units = src.units(16)
    sizes = {u.size for u in units}
    assert len(units) == 16 and max(sizes) - min(sizes) <= 1
    assert len([row for u in units for row, _ in src.rows(u)]) == 60
