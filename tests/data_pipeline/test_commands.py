"""`belief-lm tokenizer train` and `belief-lm prepare` as users run them (subprocesses)."""

import json

from data_pipeline.tokenizer import Tokenizer
from tests.jobs import run_cli as belief_lm


def test_tokenizer_train_then_prepare(tmp_path, fineweb):
    root, rows = fineweb
    source = f"data.sources=[{{uri: 'hf:{root}:sample-10BT', id_column: id}}]"
    model = tmp_path / "tok.model"
    out = belief_lm(
        "tokenizer",
        "train",
        "--output",
        str(model),
        source,
        "data.tokenizer.vocab_size=600",
        "data.tokenizer.sample_documents=50",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tokenizer sample: 100%" in out.stderr  # the progress bar ran to the end
    tokenizer = Tokenizer(model)
    assert tokenizer.vocab_size == 600
    assert (tokenizer.sp.unk_id(), tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (
        0,
        1,
        2,
        3,
    )
    text = "Grüße, 東京! " + rows[0]["text"][:200]
    assert tokenizer.decode(tokenizer.encode(text)) == text  # byte fallback: nothing unknown

    out = belief_lm(
        "prepare",
        "--output",
        str(tmp_path / "prepared"),
        "--workers",
        "2",
        source,
        f"data.tokenizer.path={model}",
        "data.validation_fraction=0.1",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"prepare hf:{root}:sample-10BT: 120doc" in out.stderr
    meta = json.loads((tmp_path / "prepared" / "meta.json").read_text())
    assert meta["train_documents"] + meta["validation_documents"] == len(rows)
    assert meta["tokenizer_sha256"] == tokenizer.sha256


def test_bad_data_input_exits_2_before_work(tmp_path):
    blank = tmp_path / "blank.jsonl"
    blank.write_bytes(b'{"text": ""}\n' * 160)
    for args in [
        ["tokenizer", "train", "--output", str(tmp_path / "t.model"), "data.sources=[nowhere]"],
        ["prepare", "--output", str(tmp_path / "p"), f"data.sources=[{tmp_path}/none.parquet]"],
        ["tokenizer", "train", "--output", str(tmp_path / "t.model"), f"data.sources=[{blank}]"],
        ["prepare", "--output", str(tmp_path / "p"), f"data.sources=[{blank}]"],
    ]:
        out = belief_lm(*args)
        assert out.returncode == 2, out.stderr[-2000:]
        lines = [x for x in out.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("belief-lm: data.sources.0.uri: ")
    assert not (tmp_path / "t.model").exists() and not (tmp_path / "p").exists()
