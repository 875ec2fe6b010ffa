"""Shared fixtures: CPU DeepSpeed, a one-process gloo group with megatron's groups; and
the split of the suite between pytest-xdist's workers (pyproject: `-n 2 --dist loadgroup`)."""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers / lm-eval: local files only
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
"""pytest-xdist's worker processes running the suite side by side (1: no xdist)."""
if WORKERS > 1:  # each worker's torch takes its share of the cores, not all of them: OpenMP
    # threads of two workers on the same cores wait on each other (before torch is imported)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))
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
        lm = BeliefLM(cfg.model, SMALL_EMBEDDING_ROWS, seed=seed, eos_id=small_tokenizer.eos_id)
        torch.save({"module": lm.state_dict()}, step / "mp_rank_00_model_states.pt")
        (step / "config.yaml").write_text(cfg.to_yaml())
        shutil.copyfile(small_tokenizer.path, step / "tokenizer.model")
        info = CheckpointInfo(1, 0, 1, 1, 1, 0, SMALL_EMBEDDING_ROWS)
        (step / "run.json").write_text(json.dumps(dataclasses.asdict(info)))
        seal(step)  # the manifest belief-lm's save writes
        return step

    return make


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory, small_tokenizer, single_process_group):
    """A real checkpoint: 3 steps of `belief-lm train`'s training loop on a tiny model
    (ZeRO-1: model and optimizer states, run_state/rank00000.pt, data_state.pt)."""
    import json
    from pydoc_data.topics import topics

    from belief_lm.config import load_config
    from belief_lm.train.loop import train
    from tests.jobs import MICRO

    root = tmp_path_factory.mktemp("trained")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)))
    cfg = load_config(
        MICRO,
        [
            "model.hidden_size=32", "model.ffn_hidden_size=64", "train.micro_batch_size=4",
            "train.global_batch_size=4", "train.max_steps=3", "train.warmup_steps=1",
            f"data.sources=[{docs}]", f"data.tokenizer.path={small_tokenizer.path}",
            "data.num_workers=0", f"run.output_dir={root / 'run'}",
        ],
    )  # fmt: skip
    train(cfg)
    return root / "run" / "checkpoints" / "step_000003"


PER_WORKER = {"single_process_group", "cache_dir", "small_tokenizer", "make_checkpoint",
              "embedded_tokenizer"}  # fmt: skip
"""Session fixtures cheap enough for each xdist worker to make its own (a process group of
one, a tokenizer trained in about a second); every other session- or module-scoped
fixture (a training run, a multi-rank job) is made once, on one worker."""


GROUPS_FILE = "BELIEF_LM_TEST_GROUPS"
"""The variable naming the file where xdist's workers write each test's group for the
scheduler (FixtureGroups). xdist 3.8 tells its scheduler a test's xdist_group by renaming
the test's `_nodeid`, which pytest 9.2 no longer reads (node ids are derived anew), so
every test would go wherever a worker is free."""


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        folder = Path(tempfile.mkdtemp(prefix="belief-lm-test-groups-"))
        os.environ[GROUPS_FILE] = str(folder / "groups.json")  # the workers inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get(GROUPS_FILE) and not hasattr(config, "workerinput"):
        shutil.rmtree(Path(os.environ.pop(GROUPS_FILE)).parent, ignore_errors=True)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own (firstresult)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` with the groups the workers wrote to GROUPS_FILE."""
    from xdist.scheduler import LoadGroupScheduling

    class FixtureGroups(LoadGroupScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # written before the workers reported their collections
                path = Path(os.environ.get(GROUPS_FILE, "/nonexistent"))
                self.groups = json.loads(path.read_text()) if path.is_file() else {}
            if nodeid.startswith("tests/infra/"):  # one cluster, one dockerd: whatever happens
                return "infra"
            return self.groups.get(nodeid) or super()._split_scope(nodeid)

    return FixtureGroups(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks (its own modifyitems)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep the tests that share an expensive fixture on one xdist worker (`--dist loadgroup`
    sends each group to one worker; a test of no group goes wherever a worker is free), and
    order the work xdist hands out (`--no-loadscope-reorder`: in this order): tests/infra
    first (the longest chain, mostly waiting on SLURM), then the other groups, largest first,
    then the single tests, which fill in at the end. Without xdist the groups change nothing."""
    groups = fixture_groups(items)
    for item, group in groups.items():
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get(GROUPS_FILE):  # every worker writes the same, whole
        path = Path(os.environ[GROUPS_FILE])
        written = path.with_name(f"{os.getpid()}.json")
        written.write_text(json.dumps({i.nodeid: g for i, g in groups.items() if g is not None}))
        os.replace(written, path)
    size = collections.Counter(groups.values())
    position = {item: index for index, item in enumerate(items)}
    first = {}  # where each group begins now
    for item in items:
        first.setdefault(groups[item], position[item])

    def rank(item: pytest.Item) -> tuple:
        group = groups[item]
        if group is None:
            return (1, 1, 0, position[item])
        return (group != "infra", 0, -size[group], first[group])

    items.sort(key=rank)  # stable: a group's tests keep their order


def fixture_groups(items: list[pytest.Item]) -> dict[pytest.Item, str | None]:
    """Each test's xdist group: tests are joined when they use the same session-scoped
    fixture not in PER_WORKER, or the same module- or class-scoped fixture in the same
    module; tests/infra (one SLURM cluster, one dockerd on the machine) is one group,
    "infra". None for a test that shares nothing expensive."""
    parent = {}

    def where(path: Path) -> str:  # a group's name: "parallel/test_equivalence.zero_stages"
        return str(path.relative_to(Path(__file__).parent).with_suffix(""))

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {}
    for item in items:
        keys = ["infra"] if item.nodeid.startswith("tests/infra/") else []
        # pytest's resolved fixtures of the item (its closure: fixtures' fixtures too); ours
        # only (pytest's and plugins' own, e.g. tmp_path_factory, have no base id)
        for name, definitions in item._fixtureinfo.name2fixturedefs.items():
            scope = definitions[-1].scope if definitions[-1].baseid else "theirs"
            if scope == "session" and name not in PER_WORKER:
                keys.append(name)
            elif scope in ("module", "class"):
                keys.append(f"{where(item.path)}.{name}")
            elif scope == "package":
                keys.append(f"{where(item.path.parent)}.{name}")
        for key in keys[1:]:
            parent[find(key)] = find(keys[0])
        shared[item] = keys
    return {item: find(keys[0]) if keys else None for item, keys in shared.items()}
