"""The exceptions that end a `belief-lm` command with a meaning its caller acts on.

Each has one exit code (belief_lm.cli.exits maps the types to belief_lm.exit_codes):
- `BadInput`: our checks refused the command line, config, data or a checkpoint before
  any work (data_pipeline.errors.BadDataInput is the data pipeline's own);
- the ways a training run stops early: `DataStop` (a source failed mid-run),
  `SpikeStop` (loss spikes in a row), `NonFiniteLossError` (too many non-finite steps),
  `Preempted` (a stop request, after its checkpoint) and `PeerLost` (another rank is
  silent or gone).

Any other exception, a ValueError raised inside torch, DeepSpeed or another library
included, is a failure (exit code 1, with its traceback). Torch-free: the command line
imports these before anything heavy.
"""

from __future__ import annotations

from data_pipeline.errors import BadDataInput


class BadInput(ValueError):
    """A command line, config, data source or checkpoint that our checks refuse before any
    work (the message names the option, key, file or value to change)."""


BAD_INPUT = (BadInput, BadDataInput)
"""Every type of bad input: ours, and the data pipeline's (which imports nothing of ours)."""


class DataStop(RuntimeError):
    """A data source failed mid-run; the last completed step was saved."""


class SpikeStop(RuntimeError):
    """train.spike.max_in_row loss spikes in a row with train.spike.action=stop; the step
    was saved."""


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps had non-finite gradients."""


class Preempted(Exception):  # a normal outcome, not an error
    """Raised after the checkpoint of a stop request is saved."""

    def __init__(self, step: int):
        super().__init__(f"stopped on request after step {step}; checkpoint saved")
        self.step = step


class PeerLost(RuntimeError):
    """A collective failed because a peer is silent or gone (belief_lm.parallel.peers)."""

    def __init__(self, message: str, line: str | None, silent: list[int] | None = None):
        super().__init__(message)
        self.line = line
        """The one line to print; None where another process reports it."""
        self.silent = silent or []
        """The ranks found silent (empty: a vanished peer, or none silent)."""
