"""`belief-lm report` reads a run directory as data: a line that is no row (cut short by a
crash, or not ours) is skipped with a warning; a config.yaml that is no run's config (a
Python tag safe YAML refuses, garbage) is exit 2 naming it."""

import json
import logging

from belief_lm.cli import main
from belief_lm.report import read_jsonl


def test_a_run_directory_is_read_as_data(tmp_path, capsys, caplog):
    row = {"step": 1, "loss": 2.0, "tokens_per_s": 10.0, "step_time_s": 0.1}
    (tmp_path / "metrics.jsonl").write_text(f'{json.dumps(row)}\n[1]\n"x"\n{{"step": 2, "lo')
    caplog.set_level(logging.WARNING, logger="belief_lm.report")
    assert read_jsonl(tmp_path / "metrics.jsonl") == [row]
    assert "skipped 3 line(s)" in caplog.text
    marker = tmp_path / "marker"
    tag = f"!!python/object/apply:builtins.exec [\"open({str(marker)!r}, 'w')\"]\n"
    for config in (tag, "[1, 2]\n", "train: {global_batch_size: x}\n"):
        (tmp_path / "config.yaml").write_text(config)
        assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")]) == 2
        assert f"{tmp_path / 'config.yaml'}: not a run's config" in capsys.readouterr().err
    assert not marker.exists()
