"""The process's console: our log lines (rank 0 at INFO, other ranks at WARNING), and the
libraries' known, harmless chatter kept off it.

Each message of NOISE is named: megatron-core's and DeepSpeed's notices that optional
accelerations are absent or that a setting is untested, DeepSpeed's note that it built its
CPU communication op, torch's deprecation notices for the collectives DeepSpeed calls,
setuptools' deprecation notice. They come as Python warnings, as
DeepSpeed log records (its logger writes to stdout) or as plain prints to stdout; all
three are caught and logged at DEBUG on the `belief_lm.noise` logger. Every other warning
and library message passes (the libraries' loggers stay at WARNING), so a real problem
still shows. BELIEF_LM_VERBOSE=1 leaves everything as the libraries print it.

Torch-free: the command line sets this up before anything heavy is imported.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import TextIO

NOISE = {
    "megatron-core: no Transformer Engine / Apex": r"(Transformer Engine and Apex are|Apex is) "
    r"not installed",
    "megatron-core: deprecated cuda graph scope default": r"full scope is deprecated\. Use "
    r"empty cuda_graph_scope",
    "DeepSpeed: accelerator auto-detected as CPU": r"Setting accelerator to CPU\. If you have "
    r"GPU",
    "DeepSpeed: CPU comm op built": r"^DeepSpeed \S+ built successfully$",
    "DeepSpeed: ZeRO with our AdamW": r"You are using ZeRO with an untested optimizer",
    "DeepSpeed: deprecated torch.distributed calls": r"`torch\.distributed\.\w+` is "
    r"deprecated\. Please use",
    "setuptools: pkg_resources deprecated": r"pkg_resources is deprecated as an API",
}
"""Known harmless messages, by what they are: a regular expression searched in each."""

LIBRARY_LOGGERS = ("megatron", "DeepSpeed", "deepspeed", "torch.distributed")
"""Loggers whose INFO chatter stays off the console (their warnings still show)."""

_PATTERN = re.compile("|".join(f"(?:{p})" for p in NOISE.values()))
noise_log = logging.getLogger("belief_lm.noise")
_configured = False


def is_noise(message: str) -> bool:
    """Whether `message` is one of NOISE."""
    return _PATTERN.search(message) is not None


def configure(rank: int) -> None:
    """Set up this process's logging for a command run as `rank` (once: later calls do
    nothing)."""
    global _configured
    if _configured:
        return
    _configured = True
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if os.environ.get("BELIEF_LM_VERBOSE"):
        return
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.showwarning = WarningFilter(warnings.showwarning)
    # DeepSpeed's logger writes to the sys.stdout it finds when first imported: this one
    sys.stdout = quieted(sys.stdout)


def quieted(stream: TextIO) -> TextIO:
    """`stream` without the NOISE lines (as it is with BELIEF_LM_VERBOSE=1)."""
    if os.environ.get("BELIEF_LM_VERBOSE") or isinstance(stream, NoiseFilter):
        return stream
    return NoiseFilter(stream)


class WarningFilter:
    """A warnings.showwarning that shows every warning as `show` does except the NOISE ones
    (logged at DEBUG instead)."""

    def __init__(self, show: Callable[..., None]):
        self.show = show

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        if is_noise(str(message)):
            noise_log.debug("%s: %s", category.__name__, message)
        else:
            self.show(message, category, filename, lineno, file, line)


class NoiseFilter:
    """A text stream that passes every line to `stream` except the NOISE ones (logged at
    DEBUG instead). A line is held until its newline arrives or the stream is flushed."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        kept = []
        for line in lines:
            if is_noise(line):
                noise_log.debug("%s", line)
            else:
                kept.append(line + "\n")
        if kept:
            self.stream.write("".join(kept))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self.stream.write(self._pending)
            self._pending = ""
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)  # fileno, isatty, encoding, buffer, ...
