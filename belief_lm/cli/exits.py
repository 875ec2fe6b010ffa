"""How a command ends on an exception: one table from the exception's type to the exit code
(belief_lm.exit_codes) and what the command says.

The library raises exceptions that carry their meaning (belief_lm.errors): our checks of
the command line, config, data and checkpoints raise BadInput (the data pipeline's own
BadDataInput), and a training run that stops early says why with its own type. An
exception of no type in the table, a ValueError raised inside torch, DeepSpeed or another
library included, is a failure: it goes on, and Python prints its traceback and exits with
1 (exit_codes.FAILED).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from belief_lm import exit_codes
from belief_lm.errors import (
    BAD_INPUT,
    DataStop,
    NonFiniteLossError,
    PeerLost,
    Preempted,
    SpikeStop,
)
from launcher.slurm import SubmitError


def say(err: BaseException) -> None:
    """'belief-lm: <message>' on stderr, no traceback."""
    print(f"belief-lm: {err}", file=sys.stderr)


def say_data_fault(err: BaseException) -> None:
    """'belief-lm: data fault: <the source, file and row>' on stderr."""
    print(f"belief-lm: data fault: {err}", file=sys.stderr)


def say_stopped(err: BaseException) -> None:
    """A stop request is a normal outcome: a warning on every rank's log."""
    logging.getLogger("belief_lm").warning("%s; exiting with %d", err, exit_codes.PREEMPTED)


def say_peer_lost(err: BaseException) -> None:
    """One line from the rank that knows what happened (it found the silent rank), or
    none: the launcher names a rank that died."""
    if isinstance(err, PeerLost) and err.line is not None:
        print(err.line, file=sys.stderr)


@dataclass(frozen=True)
class Ending:
    """How a command ends on an exception of one type."""

    code: int
    """Its exit code."""
    say: Callable[[BaseException], None] = say
    """What the command says about it (instead of a traceback)."""
    at_once: bool = False
    """Exit without Python's shutdown: a process group's destructor would join a worker
    thread that may still wait on a silent rank (an abandoned asynchronous wait)."""


ENDINGS: dict[type[BaseException], Ending] = {
    **dict.fromkeys(BAD_INPUT, Ending(exit_codes.BAD_INPUT)),
    NonFiniteLossError: Ending(exit_codes.FAILED),
    SubmitError: Ending(exit_codes.FAILED),
    SpikeStop: Ending(exit_codes.LOSS_SPIKES),
    DataStop: Ending(exit_codes.DATA_FAULT, say_data_fault),
    PeerLost: Ending(exit_codes.PEER_LOST, say_peer_lost, at_once=True),
    Preempted: Ending(exit_codes.PREEMPTED, say_stopped),
}
"""The table: an exception's type -> how the command ends. A subclass ends as its nearest
listed base (ConfigError and CheckpointError are BadInput)."""


def ending(err: BaseException) -> Ending | None:
    """The table's entry for `err` (its type's, or its nearest listed base's); None for a
    failure."""
    return next((ENDINGS[kind] for kind in type(err).__mro__ if kind in ENDINGS), None)


def run(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`command(args)`'s exit code, or the one the table gives the exception it raised (an
    exception the table does not list is raised on)."""
    try:
        return command(args)
    except Exception as err:
        end = ending(err)
        if end is None:
            raise
        end.say(err)
        if end.at_once:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(end.code)
        return end.code
