"""The model's description (belief_lm.description) against its consumers: the megatron
build (names, shapes and tensor-parallel splits at TP=1 and TP=2, pipeline stages), the
shipped Hugging Face modeling file, the planner's parameter counts and the universal
checkpoint's patterns; for every preset in configs/model and every attention variant,
built on the meta device."""

import importlib
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from deepspeed.checkpoint import constants as ds
from deepspeed.runtime.utils import partition_balanced

from belief_lm.checkpoint.universal import universal_info
from belief_lm.description import COLUMN, describe
from belief_lm.model.gpt import BeliefLM, DecoderLayer
from belief_lm.model.pipeline import canonical_name, layer_specs, pipeline_name
from belief_lm.variants import VARIANTS
from tests.models import preset, tensor_parallel_rank

PRESETS = sorted(p.stem for p in Path("configs/model").glob("*.yaml"))
VOCAB = 1024  # divisible by TP; the presets' own vocabularies come from their tokenizers
CASES = [(name, variant) for name in PRESETS for variant in VARIANTS] + [
    (f"{name}+qk_norm", variant)
    for name, variant in (("tiny", "attention_bn"), ("gpt2-124m", "belief_star"),
                          ("llama-8b", "softmax"))
]  # fmt: skip
"""Every preset with every variant, and with model.qk_norm (RoPE and GQA; LayerNorm and
learned positions; the 8B's 128-wide heads)."""


def model_of(name: str, variant: str):
    """The preset with `variant` (and with QK-norm for a name ending in +qk_norm), cut to 3
    layers (every layer is alike; the planner's counts at full depth are
    tests/model/test_presets.py's)."""
    name, _, option = name.partition("+")
    return preset(name, attention=variant, num_layers=3, **({option: True} if option else {}))


def split_of(param: torch.nn.Parameter) -> tuple[int, int] | None:
    """megatron's tensor-parallel attributes of a built parameter: (dim, stride) or None."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return param.partition_dim, getattr(param, "partition_stride", 1)


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize(("name", "variant"), CASES)
def test_the_built_model_is_the_description(name, variant):
    """Every parameter of BeliefLM is a weight of the description, with its shape and its
    split, whole at TP=1 and as a shard on a TP=2 rank; the planner's count is the rank's."""
    model = model_of(name, variant)
    description = describe(model, VOCAB)
    with torch.device("meta"):
        whole = BeliefLM(model, VOCAB)
    assert {n: tuple(p.shape) for n, p in whole.named_parameters()} == {
        w.name: w.shape for w in description.weights()
    }
    splits = {n: split_of(p) for n, p in whole.named_parameters()}
    assert splits == {w.name: w.split and tuple(w.split) for w in description.weights()}
    with tensor_parallel_rank(2, 1), torch.device("meta"):
        shard = BeliefLM(model, VOCAB, tensor_parallel=2)
    shapes = {n: tuple(p.shape) for n, p in shard.named_parameters()}
    assert shapes == {w.name: w.shard_shape(2) for w in description.weights()}
    held = sum(p.numel() for p in shard.parameters())
    assert held == description.rank_parameters(2, 1)[0]


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize(("name", "variant"), [("gpt2-124m", "belief_star"), ("tiny", "softmax")])
@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stages_hold_the_described_weights(name, variant, tied):
    """Each of 3 stages of a TP=2 rank, as DeepSpeed's PipelineModule partitions the layer
    specs, holds the description's stage weights (a tied embedding's copy, learned
    positions included, on the last), named as the pipeline names them."""
    model = preset(name, attention=variant, num_layers=4, tie_embeddings=tied)
    description, stages = describe(model, VOCAB), 3
    with tensor_parallel_rank(2, 0):
        specs = layer_specs(model, VOCAB, 2, seed=0)
        weights = [int(getattr(s, "typename", None) is DecoderLayer) for s in specs]
        parts = partition_balanced(weights, stages)
        for stage in range(stages):
            held = {}
            for position in range(parts[stage], parts[stage + 1]):
                spec = specs[position]
                with torch.device("meta"):
                    module = spec.build()
                key = getattr(spec, "key", None)
                prefix = f"tied_modules.{key}." if key else f"{position}."
                if isinstance(module, torch.nn.Module):
                    held |= {prefix + n: tuple(p.shape) for n, p in module.named_parameters()}
            described = description.stage_weights(stage, stages)
            names = {pipeline_name(w.name, model.num_layers, tied) for w in described}
            assert set(held) == names, stage
            assert {canonical_name(n, model.num_layers): s for n, s in held.items()} == {
                w.name: w.shard_shape(2) for w in described
            }


@pytest.fixture(scope="module")
def shipped_model(tmp_path_factory):
    """The Hugging Face export's code (export/hf_template/ and the files shipped beside it)
    as an importable package: its BeliefLMForCausalLM and BeliefLMConfig."""
    from belief_lm.export.hf import SHIPPED_CODE

    root = tmp_path_factory.mktemp("shipped")
    package = root / "shipped_belief_lm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for file, source in SHIPPED_CODE.items():
        shutil.copyfile(source, package / file)
    sys.path.insert(0, str(root))
    try:
        modeling = importlib.import_module("shipped_belief_lm.modeling_belief_lm")
    finally:
        sys.path.remove(str(root))
    return modeling.BeliefLMForCausalLM, modeling.BeliefLMConfig


class Ids:
    bos_id, eos_id, pad_id = 1, 2, 3


@pytest.mark.parametrize(("name", "variant"), CASES)
def test_the_shipped_modeling_file_has_the_described_hf_names(shipped_model, name, variant):
    """The Hugging Face model the export ships holds exactly the description's Hugging
    Face tensors, with their shapes (so export and import-hf, which read them, fit it)."""
    from belief_lm.export.hf import hf_config

    causal_lm, config_class = shipped_model
    model = model_of(name, variant)
    config = config_class(**hf_config(model, VOCAB, Ids()))
    with torch.device("meta"):
        shipped = causal_lm(config)
    described = {
        part.name: w.hf_shape(part) for w in describe(model, VOCAB).weights() for part in w.hf
    }
    assert {n: tuple(t.shape) for n, t in shipped.state_dict().items()} == described


@pytest.mark.parametrize(("name", "variant"), CASES)
def test_universal_patterns_sort_every_weight_as_described(name, variant):
    """DeepSpeed's universal converter reads each parameter's split from universal_info's
    patterns: each weight, in both namings, matches the patterns of its split alone
    (column-parallel: none), and each pattern matches a weight in each naming (the
    converter rejects one that matches nothing)."""
    model = model_of(name, variant)
    info = universal_info(model)
    keys = {
        None: ds.TP_REPLICATED_PARAMETER_PATTERNS,
        (1, 1): ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
        (0, 2): ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    }
    lists = [key for key in keys.values() if key in info]
    weights = describe(model, VOCAB).weights()
    for naming in (
        lambda n: n,
        lambda n: pipeline_name(n, model.num_layers, model.tie_embeddings),
    ):
        names = {naming(w.name): w for w in weights}
        for key in lists:
            for pattern in info[key]:
                assert any(re.match(pattern, n) for n in names), (key, pattern)
        for n, weight in names.items():
            matched = {key for key in lists if any(re.match(p, n) for p in info[key])}
            expected = (
                set() if weight.split == COLUMN else {keys[weight.split and tuple(weight.split)]}
            )
            assert matched == expected, n
