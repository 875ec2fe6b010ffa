"""How processes start: rank/world/master from the launcher's environment (torchrun, SLURM,
MPI or a plain single process), and the launch commands built on it."""
