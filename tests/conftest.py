"""Shared fixtures: CPU DeepSpeed, a one-process gloo group with megatron's groups."""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed
warnings.filterwarnings("ignore")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def single_process_group():
    """torch.distributed (gloo, world size 1) and megatron's TP=PP=1 groups."""
    from belief_lm.parallel.setup import init_distributed, init_model_parallel
    from launcher.env import detect

    init_distributed(detect({}), torch.device("cpu"))
    return init_model_parallel(1, 1)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenizer cache for the session: the embedded tokenizer is trained once."""
    return str(tmp_path_factory.mktemp("cache"))
