"""The console's noise filter: the libraries' known messages, as they print them, are
caught and kept at DEBUG; anything else passes (the whole command is checked in
tests/train/test_observe.py)."""

import io
import logging

import pytest

from belief_lm.logs import NoiseFilter, WarningFilter, is_noise

SEEN = [
    # megatron-core 0.16 warnings (UserWarning) without Transformer Engine and Apex
    "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    "Transformer Engine and Apex are not installed. Falling back to local implementations of "
    "multi_tensor_applier and multi_tensor_scale",
    "Apex is not installed. Falling back to Torch Norm",
    "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
    # DeepSpeed 0.19 on stdout: its logger, and a print
    "[2026-11-25 13:34:43,353] [WARNING] [real_accelerator.py:213:get_accelerator] Setting "
    "accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
    "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
    "[2026-11-25 13:36:24,980] [WARNING] [engine.py:2304:_do_optimizer_sanity_check] **** You "
    "are using ZeRO with an untested optimizer, proceed with caution *****",
    # torch 2.13 on DeepSpeed's ZeRO collectives
    "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
    "`torch.distributed.all_gather_into_tensor` instead.",
    # setuptools
    "pkg_resources is deprecated as an API. See https://setuptools.pypa.io/en/latest/pkg_r",
]


@pytest.mark.parametrize("message", SEEN)
def test_the_known_messages_are_noise(message):
    assert is_noise(message)


@pytest.mark.parametrize(
    "message",
    [
        "13:36:25 belief_lm.train: step 3/3 | loss 8.275 | ETA 00:00",
        "DeepSpeed could not build deepspeed_shm_comm_op: g++ not found",
        "[WARNING] [engine.py:1] ZeRO stage 3 is running out of memory",
        "Apex is installed but failed to load",
        "step 6: loss spike 240.7, 1129.9 deviations above the median 8.211",
    ],
)
def test_other_messages_pass(message):
    assert not is_noise(message)


def test_the_filter_drops_noise_lines_and_keeps_the_rest():
    out = io.StringIO()
    stream = NoiseFilter(out)
    stream.write("first line\nDeepSpeed x built successfully")
    assert out.getvalue() == "first line\n"  # a line is held until it ends
    stream.write("\npartial")
    assert out.getvalue() == "first line\n"
    stream.flush()
    assert out.getvalue() == "first line\npartial"
    print("last", file=stream)
    assert out.getvalue() == "first line\npartiallast\n"
    assert stream.getvalue() == out.getvalue()  # the rest of the stream's interface


def test_the_noise_is_kept_at_debug_on_its_logger(caplog):
    """Printed or warned, a known message is logged at DEBUG on belief_lm.noise (kept for a
    handler at that level, not lost); a real warning is shown as before."""
    shown = []
    show = WarningFilter(lambda message, *where: shown.append(str(message)))
    with caplog.at_level(logging.DEBUG, logger="belief_lm.noise"):
        NoiseFilter(io.StringIO()).write(f"{SEEN[5]}\n")
        show(UserWarning(SEEN[0]), UserWarning, "megatron/core/__init__.py", 1)
        show(UserWarning("weights are NaN"), UserWarning, "belief_lm/train/loop.py", 2)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("belief_lm.noise", logging.DEBUG, SEEN[5]),
        ("belief_lm.noise", logging.DEBUG, f"UserWarning: {SEEN[0]}"),
    ]
    assert shown == ["weights are NaN"]
