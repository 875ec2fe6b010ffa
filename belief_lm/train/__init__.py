"""Training: optimizer and schedule, the DeepSpeed engine, metrics, the loop."""
