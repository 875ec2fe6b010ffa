"""Inference on a trained checkpoint: loading it in one process, sampling, generation."""
