"""Job submission: `belief-lm launch local` (the ranks of this machine) and `launch slurm`
(an sbatch script rendered from the run's `launch:` section). Where each process then
finds its rank and peers is `belief_lm.parallel.env`."""
