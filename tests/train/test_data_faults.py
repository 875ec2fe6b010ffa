"""Data faults as `belief-lm train` meets them: bad sources at start-up are one line with
exit 2; a source that fails mid-run saves the last completed step and exits 65."""

import json
import os
from pathlib import Path

import pytest
import torch

from belief_lm.checkpoint.files import newest_checkpoint, read_info
from belief_lm.exit_codes import BAD_INPUT, DATA_FAULT
from belief_lm.train.loop import DataStop, train
from data_pipeline.build import build_train_data
from data_pipeline.schedule import UNITS_PER_READER
from data_pipeline.sources import Source
from data_pipeline.stream import epoch_order
from tests.data_pipeline.corpora import (
    corrupt_row_group,
    one_row_group_files,
    source,
    take,
    write_openwebtext_jsonl,
)
from tests.jobs import MICRO, metrics, run_cli

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "content", "message", "no_document"),
    [
        ("empty.txt", b"", "empty.txt: no rows (the source is empty)", False),
        ("garbage.txt", bytes(range(256)) * 8, "garbage.txt: no usable train document in any "
         "of its 1 rows (not_utf8 1)", True),
        ("empty.jsonl", b"", "empty.jsonl: no rows (the source is empty)", False),
        ("bad.jsonl", b'{"text": \n' * 5, "none of its first 5 rows is a JSON object", False),
        ("blank.jsonl", b'{"text": "  "}\n' * 160, "in any of its 160 rows (empty 160)", True),
    ],
)  # fmt: skip
def test_bad_sources_at_start_up_are_one_line_and_exit_2(
    tmp_path, small_tokenizer, name, content, message, no_document
):
    """One line on stderr, exit 2, nothing written; a source without a usable document
    also with a tokenizer given (data.tokenizer.path: no sample of the sources is read)."""
    (tmp_path / name).write_bytes(content)
    given_tokenizer = [f"data.tokenizer.path={small_tokenizer.path}"]
    for given in ([], given_tokenizer) if no_document else ([],):
        done = run_cli(
            "train", "--config", MICRO, f"data.sources=[{tmp_path / name}]", *given,
            f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        )  # fmt: skip
        assert done.returncode == BAD_INPUT, done.stderr[-3000:]
        lines = [x for x in done.stderr.splitlines() if x.startswith("belief-lm:")]
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr
        assert "skipped a row" not in done.stderr
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


def saved_step(run) -> int:
    """The step of the run's newest checkpoint, which must be its last logged step (and
    hold the data position)."""
    checkpoint = newest_checkpoint(run / "checkpoints")
    step = read_info(checkpoint).step
    assert [row["step"] for row in metrics(run)] == list(range(1, step + 1))  # resumed, once
    assert (checkpoint / "data_state.pt").is_file()
    return step


def test_a_run_meets_three_faults_mid_run_and_resumes_after_each(
    tmp_path, small_tokenizer, tiny_config, monkeypatch
):
    """Nine one-row-group files read by one logical reader in a seeded order. The 2nd file
    read has a corrupt row group (data.on_corrupt_row_group=stop), the 3rd sits behind a
    network that stays down, the 4th vanishes when its turn comes. Each fault ends its run
    after saving the last completed step, with one line naming the source, file, row group
    and row (through the CLI: exit 65); each next run resumes from that checkpoint (the
    file repaired), and the last one's data position continues as an undisturbed read."""
    import requests

    # 64 short rows a file (16 a step), more than the 32 documents a reader tokenizes
    # ahead: each fault is met steps after the previous run's last
    one_row_group_files(tmp_path / "corpus", [64] * 9, chars=20)
    uri = f"{tmp_path}/corpus/*.parquet"
    overrides = [
        f"data.sources=[{uri}]", f"data.tokenizer.path={small_tokenizer.path}",
        "data.readers=1", "data.num_workers=1", "data.on_corrupt_row_group=stop",
        "train.max_steps=40",
    ]  # fmt: skip
    cfg, run = tiny_config(*overrides), tmp_path / "run"
    corpus = source(uri)
    units = corpus.units(UNITS_PER_READER)
    assert len(units) == len(corpus.files())  # a unit per file
    order = [corpus.files()[units[u].file] for u in epoch_order(len(units), cfg.data.seed, 0)]
    corrupt, down, vanishing = (Path(order[i]) for i in (1, 2, 3))
    intact = {path: path.read_bytes() for path in (corrupt, vanishing)}
    corrupt_row_group(corrupt, 0)

    done = run_cli("train", "--config", MICRO, *overrides, f"run.output_dir={run}")
    assert done.returncode == DATA_FAULT, done.stderr[-3000:]
    line = next(x for x in done.stderr.splitlines() if x.startswith("belief-lm: data fault"))
    steps = [saved_step(run)]
    assert line.startswith(
        f"belief-lm: data fault: {uri}: cannot read {corrupt} row group 0 (rows 0-63) at row 0: "
    ) and line.endswith(f"(data.on_corrupt_row_group=stop); stopped after step {steps[0]}")
    assert steps[0] > 1 and "Traceback" not in done.stderr
    corrupt.write_bytes(intact[corrupt])  # repaired: the same size, so the same data

    monkeypatch.setattr("data_pipeline.failures.RETRY_PAUSE", 0)
    rows = Source.rows
    unreachable = "HTTPSConnectionPool(host='huggingface.co', port=443): Max retries exceeded"

    trainer = os.getpid()  # the faults strike the loader worker, not the pre-flight's read

    def network_down(self, unit, skip=0):
        if Path(self.files()[unit.file]) == down and os.getpid() != trainer:
            raise requests.ConnectionError(unreachable)
        yield from rows(self, unit, skip)

    def vanish(self, unit, skip=0):
        if Path(self.files()[unit.file]) == vanishing and os.getpid() != trainer:
            vanishing.unlink()
        yield from rows(self, unit, skip)

    for reader, where, reason in [
        (network_down, down, f"{unreachable} (after 3 attempts)"),
        (vanish, vanishing, f"[Errno 2] No such file or directory: '{vanishing}'"),
    ]:
        with monkeypatch.context() as patch, pytest.raises(DataStop) as stop:
            patch.setattr(Source, "rows", reader)  # the loader worker forks with it
            train(cfg)
        steps.append(saved_step(run))  # resumed from the previous checkpoint
        assert str(stop.value) == (
            f"{uri}: cannot read {where} row group 0 (rows 0-63) at row 0: {reason}; "
            f"stopped after step {steps[-1]}"
        )
        assert steps[-1] > steps[-2]

    vanishing.write_bytes(intact[vanishing])  # back: the saved position is valid again
    data = cfg.data.model_copy(update={"num_workers": 0})

    def stream():
        shape = cfg.model.seq_length, cfg.train.global_batch_size, cfg.train.micro_batch_size
        return build_train_data(data, small_tokenizer, *shape, 0, 1, CPU)

    reference, resumed = take(stream(), steps[-1] + 2), stream()
    saved = newest_checkpoint(run / "checkpoints") / "data_state.pt"
    resumed.load_state_dict(torch.load(saved, weights_only=False))
    assert take(resumed, 2) == reference[-2:]
