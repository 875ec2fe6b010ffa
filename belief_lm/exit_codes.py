"""Exit codes of the `belief-lm` command: what a job script or scheduler acts on.

Defined here only: the command maps exceptions to them (belief_lm.cli.exits), `launch
local` acts on them (launcher.local), and `launch slurm` renders them into the sbatch
template (launcher.slurm.exit_code_settings). Torch-free and importing nothing, so job
submission and tests read them without the training stack.
"""

DONE = 0
"""The command finished."""
FAILED = 1
"""Failed while running (a crash, or too many non-finite steps; the last good state was
saved where a checkpoint could be written)."""
BAD_INPUT = 2
"""Bad command line, config, data or checkpoint, found before any work: nothing was run. A
damaged checkpoint named explicitly (train --resume DIR, evaluate, generate, export) is
one; `checkpoint verify` exits with it when the newest checkpoint is damaged."""
LOSS_SPIKES = 3
"""The loss spiked train.spike.max_in_row steps in a row with train.spike.action=stop: the
run saved its last step and stopped for a person to look (lower the learning rate, skip
the data, or resume from an earlier checkpoint with checkpoint.resume=DIR)."""
DATA_FAULT = 65
"""A data source failed mid-run (too many unusable rows, a corrupt row group with
data.on_corrupt_row_group=stop, a vanished file, an unreachable hub): the last completed
step was saved; the message names the source, file and row (EX_DATAERR)."""
PEER_LOST = 69
"""Another rank of the job was lost: a collective timed out waiting for a silent rank (one
line names the collective and the ranks that did not arrive), or a peer's connection
closed because it died (its launcher names it). Nothing was saved (a checkpoint needs
every rank): the run resumes from its last checkpoint (launch.failure_restarts restarts it
in place; EX_UNAVAILABLE)."""
PREEMPTED = 75
"""Stopped by SIGTERM, SIGUSR1 or SIGINT after saving a checkpoint (EX_TEMPFAIL, 'try again
later'): requeue the job and it resumes from there."""

NOT_RESTARTED = (DONE, BAD_INPUT, LOSS_SPIKES, PREEMPTED)
"""Ends that restarting the ranks in place (launch.failure_restarts) would not change: done,
bad input, a person's call (loss spikes), a stop (the job is requeued instead). Every other
end of a training step is a failure that a restart from the newest checkpoint may get past."""
