#!/usr/bin/env bash
# Stands in for `belief-lm train` in the requeue tests of slurm/pretrain.sbatch until the
# trainer checkpoints (the checkpoints issue), keeping to the contract the template relies
# on: on SIGUSR1, save and exit 75 (launcher.slurm.REQUEUE_EXIT_CODE); when requeued
# (SLURM_RESTART_COUNT > 0), resume and finish.
set -euo pipefail
if ((${SLURM_RESTART_COUNT:-0} > 0)); then
  echo "task $SLURM_PROCID: resumed at restart $SLURM_RESTART_COUNT, finished"
  exit 0
fi
trap 'echo "task $SLURM_PROCID: SIGUSR1, checkpointed"; exit 75' USR1
echo "task $SLURM_PROCID: training"
for _ in $(seq 1 1200); do sleep 0.1; done
echo "task $SLURM_PROCID: no signal within 120 s" >&2
exit 1
