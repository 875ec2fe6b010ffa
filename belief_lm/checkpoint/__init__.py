"""Checkpoints: atomic save, resume (also on another layout), consolidation."""
