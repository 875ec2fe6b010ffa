"""Data faults as `belief-lm train` meets them: bad sources at start-up are one line with
exit 2; a source that fails mid-run saves the last completed step and exits 65."""

import json

import pytest

from belief_lm.checkpoint.files import newest_checkpoint, read_info
from belief_lm.exit_codes import BAD_INPUT, DATA_FAULT
from tests.data_pipeline.corpora import write_openwebtext_jsonl
from tests.jobs import MICRO, run_cli


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


def test_a_source_that_turns_bad_mid_run_saves_the_last_step_and_exits_65(
    tmp_path, small_tokenizer
):
    """One row in ten is empty: judged once 200 rows were read (over all readers), the run
    stops after some steps, with a checkpoint of the last completed step."""
    lines = [
        b'{"text": ""}' if i % 10 == 0 else json.dumps({"text": f"row {i} " * 20}).encode()
        for i in range(3000)
    ]
    write_openwebtext_jsonl(tmp_path / "a.jsonl", lines)
    run = tmp_path / "run"
    done = run_cli(
        "train", "--config", MICRO, f"data.sources=[{tmp_path / 'a.jsonl'}]",
        f"data.tokenizer.path={small_tokenizer.path}", "data.skip_check_min_rows=200",
        "data.num_workers=1", "train.max_steps=1000", f"run.output_dir={run}",
    )  # fmt: skip
    assert done.returncode == DATA_FAULT, done.stderr[-3000:]
    line = next(x for x in done.stderr.splitlines() if x.startswith("belief-lm: data fault"))
    assert "a.jsonl: " in line and "rows unusable (empty " in line and "Traceback" not in line
    logged = [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()]
    saved = read_info(newest_checkpoint(run / "checkpoints")).step
    assert saved == logged[-1] > 1 and f"stopped after step {saved}" in line
    assert (newest_checkpoint(run / "checkpoints") / "data_state.pt").is_file()
