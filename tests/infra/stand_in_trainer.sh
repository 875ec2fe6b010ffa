#!/usr/bin/env bash
# Stands in for `belief-lm train` in the signal and requeue tests of slurm/pretrain.sbatch
# that need no training, keeping to the contract the template relies on: on a stop signal
# (SIGUSR1, SIGTERM, SIGINT), save and exit 75 (belief_lm.exit_codes.PREEMPTED); when
# requeued (SLURM_RESTART_COUNT > 0), resume and finish.
set -euo pipefail
if ((${SLURM_RESTART_COUNT:-0} > 0)); then
  echo "task $SLURM_PROCID: resumed at restart $SLURM_RESTART_COUNT, finished"
  exit 0
fi
# A stop can arrive twice (SLURM's warning to the tasks and the batch shell's copy through
# srun): the first one is acted on, later ones ignored, as the trainer does (a repeat during
# bash's exit would otherwise end the task by the signal: exit code 138).
for sig in USR1 TERM INT; do
  # shellcheck disable=SC2064  # the signal's name is fixed when the trap is set
  trap "trap '' USR1 TERM INT; echo \"task \$SLURM_PROCID: SIG$sig, checkpointed\"; exit 75" "$sig"
done
echo "task $SLURM_PROCID: training"
for _ in $(seq 1 1200); do sleep 0.1; done
echo "task $SLURM_PROCID: no signal within 120 s" >&2
exit 1
