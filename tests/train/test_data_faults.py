"""Data faults as `belief-lm train` meets them: bad sources at start-up are one line with
exit 2; a source that fails mid-run saves the last completed step and exits 65."""

import json

import pytest

from belief_lm.checkpoint.files import newest_checkpoint, read_info
from belief_lm.exit_codes import BAD_INPUT, DATA_FAULT
from belief_lm.train.loop import train
from tests.data_pipeline.corpora import write_openwebtext_jsonl
from tests.jobs import MICRO, metrics, run_cli


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", b"", "empty.txt: 1 of 1 rows unusable (empty 1)"),
        ("garbage.txt", bytes(range(256)) * 8, "garbage.txt: 1 of 1 rows unusable (not_utf8 1)"),
        ("empty.jsonl", b"", "empty.jsonl: no rows (the file is empty)"),
        ("bad.jsonl", b'{"text": \n' * 5, "none of its first 5 rows is a JSON object"),
    ],
)
def test_bad_sources_at_start_up_are_one_line_and_exit_2(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    done = run_cli(
        "train", "--config", MICRO, f"data.sources=[{tmp_path / name}]",
        f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
    )  # fmt: skip
    assert done.returncode == BAD_INPUT, done.stderr[-3000:]
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def one_row_in_ten_empty(path):
    write_openwebtext_jsonl(path, [
        b'{"text": ""}' if i % 10 == 0 else json.dumps({"text": f"row {i} " * 20}).encode()
        for i in range(3000)
    ])  # fmt: skip
    return path


def test_a_source_that_turns_bad_mid_run_saves_the_last_step_and_exits_65(
    tmp_path, small_tokenizer
):
    """One row in ten is empty: judged once 200 rows were read (over all readers), the run
    stops after some steps, with a checkpoint of the last completed step."""
    source = one_row_in_ten_empty(tmp_path / "a.jsonl")
    run = tmp_path / "run"
    done = run_cli(
        "train", "--config", MICRO, f"data.sources=[{source}]",
        f"data.tokenizer.path={small_tokenizer.path}", "data.skip_check_min_rows=200",
        "data.num_workers=1", "train.max_steps=1000", f"run.output_dir={run}",
    )  # fmt: skip
    assert done.returncode == DATA_FAULT, done.stderr[-3000:]
    line = next(x for x in done.stderr.splitlines() if x.startswith("belief-lm: data fault"))
    assert "a.jsonl: " in line and "rows unusable (empty " in line and "Traceback" not in line
    logged = [row["step"] for row in metrics(run)]
    saved = read_info(newest_checkpoint(run / "checkpoints")).step
    assert saved == logged[-1] > 1 and f"stopped after step {saved}" in line
    assert (newest_checkpoint(run / "checkpoints") / "data_state.pt").is_file()


def test_the_configured_skip_fraction_is_the_one_applied(tmp_path, small_tokenizer, tiny_config):
    """The same source with data.max_skipped_fraction=0.2 trains through, its skips counted
    in the metrics (a default of 1% would stop it, as above)."""
    source = one_row_in_ten_empty(tmp_path / "a.jsonl")
    result = train(tiny_config(
        f"data.sources=[{source}]", f"data.tokenizer.path={small_tokenizer.path}",
        "data.skip_check_min_rows=30", "data.max_skipped_fraction=0.2", "data.num_workers=0",
        "train.max_steps=20", "run.log_interval=20",
    ))  # fmt: skip
    assert list(result.losses) == [20]
    (row,) = metrics(result.run_dir)  # judged: past skip_check_min_rows, 10% empty
    assert row["data/0/rows"] > 30 and row["data/0/empty"] > 0.05 * row["data/0/rows"]
