"""Shared fixtures: CPU DeepSpeed, a one-process gloo group with megatron's groups."""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers / lm-eval: local files only
warnings.filterwarnings("ignore")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.jobs import RENDEZVOUS  # noqa: E402

PYTEST_WORLD = {name: os.environ.get(name) for name in RENDEZVOUS if name != "LOCAL_RANK"}
"""The variables that place a process in a job (RANK and WORLD_SIZE make detect() see a
torchrun rank; MASTER_ADDR/PORT its rank 0) as pytest started: normally none. LOCAL_RANK is
not among them: DeepSpeed's engine reads it at every deepspeed.initialize, also that of a
test's in-process run after the session's process group exists."""


def restore_world() -> None:
    """Put PYTEST_WORLD back into os.environ."""
    for name, value in PYTEST_WORLD.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def no_world_for_child_processes():
    """Every test starts and ends with PYTEST_WORLD. init_distributed (the session's
    single_process_group, or a test's in-process train) exports the variables of its world
    of one for torch's env:// rendezvous, which needs them only while it joins; a child
    process inheriting them would take itself for rank 0 of that world and bind its port
    (bench/gpu.py's smoke runs: EADDRINUSE). Session- and module-scoped fixtures are set up
    before this one, so what they export is gone before the test runs."""
    restore_world()
    yield
    restore_world()


@pytest.fixture(scope="session")
def single_process_group():
    """The process grid of one process: torch.distributed (gloo, world size 1) and
    megatron's TP=PP=1 groups."""
    from belief_lm.parallel.dims import ParallelDims
    from belief_lm.parallel.env import detect
    from belief_lm.parallel.grid import ProcessGrid

    return ProcessGrid.join(detect({}), torch.device("cpu"), ParallelDims(1, 1, 1))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenizer cache for the session: the embedded tokenizer is trained once."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def tiny_config(tmp_path, cache_dir):
    """Factory: the tests' small run (configs/test/micro.yaml) writing to tmp_path/run, with
    the session's tokenizer cache, plus `overrides` (section.key=value)."""
    from belief_lm.config import load_config
    from tests.jobs import MICRO, ROOT

    def make(*overrides: str):
        run = [f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={cache_dir}"]
        return load_config(ROOT / MICRO, [*run, *overrides])

    return make


SMALL_VOCAB, SMALL_EMBEDDING_ROWS = 400, 512
"""The small tokenizer's pieces, and the embedding rows of small models (padded past it)."""


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory):
    """A 400-piece sentencepiece model (byte fallback, as training makes them) trained in a
    fraction of a second on Python's help() topics."""
    from pydoc_data.topics import topics

    from data_pipeline.tokenizer import train_tokenizer

    texts = [topics[name] for name in sorted(topics)]
    return train_tokenizer(texts, SMALL_VOCAB, tmp_path_factory.mktemp("tokenizer") / "400.model")


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory, small_tokenizer, single_process_group):
    """Factory: a checkpoint step directory holding a seeded random BeliefLM with the
    small tokenizer, laid out as a one-process `belief-lm train` at ZeRO-0 saves it. Keyword
    arguments are ModelConfig fields over a 2-layer, width-32, 16-token model."""
    import dataclasses
    import json
    import shutil

    from belief_lm.checkpoint.files import CheckpointInfo
    from belief_lm.checkpoint.manifest import seal
    from belief_lm.config import Config
    from belief_lm.model.gpt import BeliefLM
    from tests.models import SMALL

    def make(seed: int = 0, **model):
        cfg = Config.model_validate({"model": SMALL | model, "run": {"seed": seed}})
        step = tmp_path_factory.mktemp("run") / "checkpoints" / "step_000001"
        step.mkdir(parents=True)
        lm = BeliefLM(cfg.model, SMALL_EMBEDDING_ROWS, seed=seed)
        torch.save({"module": lm.state_dict()}, step / "mp_rank_00_model_states.pt")
        (step / "config.yaml").write_text(cfg.to_yaml())
        shutil.copyfile(small_tokenizer.path, step / "tokenizer.model")
        info = CheckpointInfo(1, 0, 1, 1, 1, 0, SMALL_EMBEDDING_ROWS)
        (step / "run.json").write_text(json.dumps(dataclasses.asdict(info)))
        seal(step)  # the manifest belief-lm's save writes
        return step

    return make
