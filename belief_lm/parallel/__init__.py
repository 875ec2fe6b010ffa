"""Parallel wiring: the process grid (every process group), where a process is, the
model's tensor-parallel sums, gather/shard, heartbeats and lost peers."""
