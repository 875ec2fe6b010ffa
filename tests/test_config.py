"""Configuration: composition, overrides, and errors that name the key."""

from pathlib import Path

import pytest
from pydantic import BaseModel

from belief_lm.config import Config, ConfigError, load_config

CONFIGS = sorted(Path("configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=str)
def test_every_shipped_config_validates(path):
    assert isinstance(load_config(path), Config)


def test_includes_compose_and_the_file_wins(tmp_path):
    (tmp_path / "model.yaml").write_text("model: {num_layers: 3, hidden_size: 96}\n")
    (tmp_path / "run.yaml").write_text(
        "include: [model.yaml]\nmodel: {hidden_size: 64}\ntrain: {max_steps: 7}\n"
    )
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.max_steps) == (3, 64, 7)


def test_dotted_overrides_are_typed():
    cfg = load_config(
        "configs/tiny.yaml",
        [
            "model.attention=belief",
            "train.max_steps=50",
            "run.output_dir=out/x",
            "model.sh_scales=[1, 2]",
            "train.lr=5e-3",
            "run.tensorboard=false",
        ],
    )
    assert cfg.model.attention == "belief" and cfg.train.max_steps == 50
    assert cfg.run.output_dir == "out/x" and cfg.model.sh_scales == [1, 2]
    assert cfg.train.lr == 5e-3 and cfg.run.tensorboard is False


def test_effective_config_round_trips(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["model.attention=attentionx"])
    (tmp_path / "effective.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path / "effective.yaml") == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.atention=belief"], "model.atention: unknown key (did you mean 'attention'?)"),
        (["trian.max_steps=1"], "trian: unknown key (did you mean 'train'?)"),
        (["model.attention=softmaxx"], "model.attention = 'softmaxx': Input should be"),
        (["model.gamma=0"], "model.gamma = 0: Input should be greater than 0"),
        (["model.gamma=1.5"], "model.gamma = 1.5: Input should be less than or equal to 1"),
        (["train.max_steps=ten"], "train.max_steps = 'ten': Input should be a valid integer"),
        (["train.lr=-1"], "train.lr = -1: Input should be greater than 0"),
        (["model.hidden_size=130"], "hidden_size (130) must be divisible by num_attention_heads"),
        (
            ["model.num_query_groups=3"],
            "num_attention_heads (4) must be divisible by num_query_groups (3)",
        ),
        (["model.sh_scales=[1,2,3]"], "sh_scales has 3 entries"),
        (
            ["train.global_batch_size=20"],
            "global_batch_size (20) must be a multiple of micro_batch_size (16)",
        ),
        (["train.min_lr=1"], "min_lr (1.0) must not exceed lr"),
        (["parallel.zero_stage=4"], "parallel.zero_stage = 4"),
        (
            ["data.sources=[{uri: embedded, weigth: 2}]"],
            "data.sources.0.weigth: unknown key (did you mean 'weight'?)",
        ),
        (["data.sources=[]"], "at least one source is required"),
        (["model"], "not of the form section.key=value"),
        (["model.num_layers.x=1"], "model.num_layers is not a section"),
        (["train.spike.min_history=200"], "train.spike: min_history (200) must not exceed"),
        (["train.spike.action=halt"], "train.spike.action = 'halt': Input should be"),
        (["run.wandb.mode=cloud"], "run.wandb.mode = 'cloud': Input should be"),
        (["run.profile.steps=0"], "run.profile.steps = 0: Input should be greater than 0"),
        (
            ["parallel.tensor=4", "model.seq_length=130"],
            "model.seq_length (130) is not divisible by parallel.tensor (4), which sequence "
            "parallelism needs: set model.seq_length to a multiple of 4, parallel.tensor to "
            "one of [2], or parallel.sequence_parallel=false",
        ),
    ],
)
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", overrides)
    assert message in str(err.value)


def test_global_batch_in_tokens():
    cfg = load_config(
        "configs/model/tiny.yaml", ["model.seq_length=64", "train.global_batch_tokens=1024"]
    )
    assert cfg.train.global_batch_size == 16
    assert load_config(None, [f"{k}={v}" for k, v in _flat(cfg)]) == cfg  # round trip
    with pytest.raises(ConfigError, match=r"global_batch_tokens \(1000\) must be a multiple"):
        load_config("configs/model/tiny.yaml", ["train.global_batch_tokens=1000"])
    with pytest.raises(ConfigError, match="disagree; set one of them"):
        load_config("configs/tiny.yaml", ["train.global_batch_tokens=1024"])


def _flat(cfg):
    return [
        (f"{section}.{key}", value)
        for section, values in cfg.model_dump(mode="json").items()
        for key, value in values.items()
        if not isinstance(value, dict | list) and value is not None
    ]


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*missing\.yaml"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "a.yaml").write_text("include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("include: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"nowhere.yaml \(included from .*c.yaml\)"):
        load_config(tmp_path / "c.yaml")


def test_sections_document_every_field():
    """Every field of every section, nested sections (train.spike, run.wandb) included."""
    sections = [field.annotation for field in Config.model_fields.values()]
    while sections:
        section = sections.pop()
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no docstring"
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                sections.append(field.annotation)


def test_activation_checkpointing_modes_and_the_old_booleans():
    """none | selective | full; true and false (the field was a bool, and checkpoints'
    config.yaml files still say so) load as full and none."""
    assert load_config("configs/tiny.yaml").train.activation_checkpointing == "none"
    for value, mode in [("true", "full"), ("false", "none"), ("selective", "selective")]:
        cfg = load_config("configs/tiny.yaml", [f"train.activation_checkpointing={value}"])
        assert cfg.train.activation_checkpointing == mode
        assert f"activation_checkpointing: {mode}\n" in cfg.to_yaml()
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing = 'partial'"):
        load_config("configs/tiny.yaml", ["train.activation_checkpointing=partial"])


def test_sequence_parallel_is_on_whenever_tensor_parallel():
    """parallel.sequence_parallel: unset is on at TP > 1; false turns it off (and lets a
    sequence that does not divide over TP through); at TP=1 there is nothing to split."""
    on = load_config("configs/tiny.yaml", ["parallel.tensor=2"]).parallel
    assert on.sequence_parallel is None and on.sequence_parallel_on
    off = ["parallel.tensor=4", "model.seq_length=130", "parallel.sequence_parallel=false"]
    assert not load_config("configs/tiny.yaml", off).parallel.sequence_parallel_on
    assert not load_config(
        "configs/tiny.yaml", ["parallel.sequence_parallel=true"]
    ).parallel.sequence_parallel_on
