"""Heartbeats and the diagnosis of a collective's failure, in one process (the faults
themselves, with real ranks: tests/launcher/test_rank_faults.py)."""

import json
import os
import re
import socket
import time

import pytest

from belief_lm.exit_codes import PEER_LOST
from belief_lm.parallel import heartbeat, peers
from tests.parallel.conftest import torchrun


def test_a_heartbeat_is_rewritten_with_the_step_and_stops(tmp_path):
    beat = heartbeat.Heartbeat(tmp_path, rank=3, interval=0.05).start()
    try:
        first = heartbeat.read(tmp_path, [3])[3]
        assert (first.rank, first.pid, first.step) == (3, os.getpid(), 0)
        assert first.host == socket.gethostname()
        beat.step = 7
        time.sleep(0.3)
        later = heartbeat.read(tmp_path, [3])[3]
        assert later.step == 7 and later.time > first.time and later.started == first.started
    finally:
        beat.stop()
    assert heartbeat.silent(heartbeat.read(tmp_path, [3]), after_s=5) == []
    time.sleep(0.3)
    assert heartbeat.silent(heartbeat.read(tmp_path, [3]), after_s=0.2) == [3]
    assert [p.name for p in (tmp_path / heartbeat.DIRECTORY).iterdir()] == ["rank_00003.json"]


def test_a_rank_without_a_readable_heartbeat_is_silent(tmp_path):
    """No file, half a file, or one of another shape (a list, a time that is no number):
    no heartbeat; a peer report of another shape is none to the launcher either."""
    from launcher.local import Failure

    (tmp_path / heartbeat.DIRECTORY).mkdir()
    heartbeat.path_of(tmp_path, 1).write_text("{half a fi")
    heartbeat.path_of(tmp_path, 2).write_text('["a", "list"]')
    beat = {"rank": 3, "host": "h", "pid": 1, "step": 0, "time": "now", "started": 0.0}
    heartbeat.path_of(tmp_path, 3).write_text(json.dumps(beat))
    beats = heartbeat.read(tmp_path, [0, 1, 2, 3])
    assert beats == {0: None, 1: None, 2: None, 3: None}
    assert heartbeat.silent(beats, after_s=100) == [0, 1, 2, 3]
    (tmp_path / heartbeat.DIRECTORY / "peer_lost.x.json").write_text('["not", "a", "report"]')
    assert "silent" not in Failure(rank=0, pid=1, code=PEER_LOST).record(tmp_path, since=0.0)


def test_beats_are_a_tenth_of_the_timeout_within_bounds():
    assert [heartbeat.interval_for(t) for t in (1, 20, 600, 7200)] == [0.5, 2.0, 10.0, 10.0]


def raised(message: str, kind=RuntimeError) -> BaseException:
    try:
        raise kind(message)
    except BaseException as err:
        return err


GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"
GLOO_CLOSED = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:654"


@pytest.mark.parametrize(
    ("error", "lost"),
    [
        (raised(GLOO_TIMEOUT), True),
        (raised(GLOO_CLOSED), True),
        (raised("[c10d/ProcessGroupNCCL.cpp] Watchdog caught collective operation timeout"), True),
        (raised("the hub timed out"), False),  # not a backend's, not from a collective
        (raised("Connection reset by peer", ConnectionError), False),  # a data source's
        (raised("mismatched sizes in gloo allreduce"), False),  # a bug, not a peer
    ],
)
def test_which_failures_are_a_lost_peer(single_process_group, error, lost):
    assert peers.is_lost_peer(error) is lost


def test_ranks_are_one_short_phrase():
    assert peers.ranks_phrase([0, 1, 2, 3, 8, 10, 11]) == "ranks 0-3, 8, 10-11"
    assert peers.ranks_phrase([5]) == "rank 5"


def test_the_first_rank_to_report_a_timeout_prints_it(tmp_path):
    """Several ranks may time out at once: one line, from the first; the report stays as
    JSON for launchers."""
    beat = heartbeat.Heartbeat(tmp_path, rank=0, interval=1)
    watch = peers.Watch(tmp_path, 10, 60, beat, token=42)
    (tmp_path / heartbeat.DIRECTORY).mkdir()
    report = {"rank": 0, "line": "belief-lm: x", "silent": [1]}
    assert peers.first_to_report(watch, report)
    assert not peers.first_to_report(watch, {**report, "rank": 2})
    saved = tmp_path / heartbeat.DIRECTORY / "peer_lost.42.json"
    assert json.loads(saved.read_text()) == report


@pytest.mark.parametrize(
    ("case", "within", "line"),
    [
        ("slow", (1.5, 4), r"belief-lm: rank 1: rank_zero_first's wait for rank 0: rank 0 is "
         r"alive but did not finish within parallel.rank_zero_wait_s=2 s"),
        ("silent", (3.5, 8), r"belief-lm: rank 1: rank_zero_first's wait for rank 0 timed out "
         r"after \d s; not arrived: rank 0 \(host \S+, pid \d+; last heartbeat \d s ago, at "
         r"step 0\)"),
    ],
    ids=["slow", "silent"],
)  # fmt: skip
def test_rank_zero_first_waits_while_rank_zero_beats(tmp_path, case, within, line):
    """Rank 0's one-off work (a tokenizer, a conversion) may take long: the others wait up
    to parallel.rank_zero_wait_s, but a rank 0 that stops answering is lost within
    parallel.timeout_s (its heartbeat), whatever the wait allows."""
    result = torchrun(2, "tests/parallel/rank_zero_wait.py", str(tmp_path), case, timeout=120)
    assert (tmp_path / "rank1.json").exists(), result.stderr[-3000:]
    report = json.loads((tmp_path / "rank1.json").read_text())
    assert within[0] < report["seconds"] < within[1], report
    assert re.fullmatch(line, report["line"]), report["line"]
    assert report["silent"] == ([0] if case == "silent" else [])
