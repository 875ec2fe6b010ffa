"""The 1B and 8B presets at the layouts they are meant for, built on the meta device: every
tensor-parallel rank and pipeline stage holds exactly the parameters the architecture
says, with no process group of that size (and the planner counts the same)."""

import pytest
import torch
from deepspeed.runtime.utils import partition_balanced

from belief_lm.config import ModelConfig
from belief_lm.description import describe, stage_layers
from belief_lm.model.gpt import BeliefLM, DecoderLayer
from belief_lm.model.pipeline import layer_specs
from belief_lm.parallel.gather import count_model_parameters
from belief_lm.variants import VARIANTS
from tests.models import preset, tensor_parallel_rank

pytestmark = pytest.mark.usefixtures("single_process_group")

LLAMA_VOCAB = 128_256


def expected_rank_parameters(
    model: ModelConfig, tp: int, stage: int = 0, stages: int = 1, layers: int | None = None
) -> int:
    """The architecture's count on one TP rank of one stage, written out here: QKV, W^o,
    W^s, fc1 (gate and up) and fc2 split over TP ranks, the embedding's rows too; the
    norms replicated; no biases (Llama)."""
    h, heads, groups, ffn = (
        model.hidden_size, model.num_attention_heads, model.query_groups, model.ffn_size,
    )  # fmt: skip
    d = h // heads
    qkv = (heads // tp + 2 * groups // tp) * d * h
    out = h * (heads // tp * d) * (2 if model.attention == "belief_star" else 1)
    mlp = h * (2 * ffn // tp) + (ffn // tp) * h
    layer = qkv + out + mlp + 2 * h
    count = (model.num_layers if layers is None else layers) * layer
    rows = LLAMA_VOCAB // tp * h
    if stage == 0:
        count += rows
    if stage == stages - 1:
        # final norm; an untied output layer, or the last stage's copy of a tied embedding
        count += h + (rows if not model.tie_embeddings or stages > 1 else 0)
    return count


def rank_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_whole_models_have_llamas_parameter_counts():
    with torch.device("meta"):
        one_b = count_model_parameters(BeliefLM(preset("llama-1b"), LLAMA_VOCAB))
        eight_b = count_model_parameters(BeliefLM(preset("llama-8b"), LLAMA_VOCAB))
    assert one_b == 1_235_814_400  # Llama 3.2 1B
    assert eight_b == 8_030_261_248  # Llama 3 8B
    assert one_b == expected_rank_parameters(preset("llama-1b"), 1)
    star = preset("llama-1b", attention="belief_star")
    with torch.device("meta"):
        assert count_model_parameters(BeliefLM(star, LLAMA_VOCAB)) == 1_302_923_264


@pytest.mark.parametrize(
    ("tp", "variant"),
    # every variant at TP=2; at TP=8 those whose parameters or head split differ
    [(2, v) for v in VARIANTS] + [(8, v) for v in ("softmax", "belief_star", "attention_bn_sh")],
)
def test_llama_1b_on_tensor_parallel_ranks(tp, variant):
    model = preset("llama-1b", attention=variant)
    for rank in (0, tp - 1):
        with tensor_parallel_rank(tp, rank), torch.device("meta"):
            built = BeliefLM(model, LLAMA_VOCAB, tensor_parallel=tp)
        shards = dict(built.named_parameters())
        assert shards["embedding.word_embeddings.weight"].shape == (LLAMA_VOCAB // tp, 2048)
        assert shards["layers.0.self_attention.linear_qkv.weight"].shape == (
            (32 + 16) // tp * 64,
            2048,
        )
        assert shards["layers.0.mlp.linear_fc2.weight"].shape == (2048, 8192 // tp)
        assert shards["layers.0.input_layernorm.weight"].shape == (2048,)  # replicated
        count = rank_parameters(built)
        assert count == expected_rank_parameters(model, tp), (tp, rank)
        assert count == describe(model, LLAMA_VOCAB).rank_parameters(tp, 1)[0]


def test_llama_8b_on_tp8_pp4_stages():
    """Each of the 4 stages as DeepSpeed's PipelineModule partitions the layer specs
    (type:DecoderLayer), built for a TP=8 rank: 8 layers each, the embedding on the first
    stage, the final norm and untied output layer on the last."""
    tp, stages = 8, 4
    for variant in ("softmax", "belief_star"):
        model = preset("llama-8b", attention=variant)
        with tensor_parallel_rank(tp, 5):
            specs = layer_specs(model, LLAMA_VOCAB, tp, seed=0)
            weights = [int(getattr(s, "typename", None) is DecoderLayer) for s in specs]
            parts = partition_balanced(weights, stages)
            assert [sum(weights[parts[s] : parts[s + 1]]) for s in range(stages)] == stage_layers(
                32, stages
            )
            for stage in range(stages):
                with torch.device("meta"):
                    built = [spec.build() for spec in specs[parts[stage] : parts[stage + 1]]]
                count = sum(rank_parameters(m) for m in built if isinstance(m, torch.nn.Module))
                expected = expected_rank_parameters(model, tp, stage, stages, layers=8)
                assert count == expected, (variant, stage)
                assert count == describe(model, LLAMA_VOCAB).rank_parameters(tp, stages)[stage]


@pytest.mark.parametrize("stages", range(1, 9))
def test_planner_splits_layers_as_deepspeed(stages):
    """description.stage_layers is DeepSpeed's partition_balanced of our layer specs."""
    for layers in range(stages, 41):
        weights = [0] + [1] * layers + [0, 0]  # embedding, layers, final norm, output
        parts = partition_balanced(weights, stages)
        split = [sum(weights[parts[s] : parts[s + 1]]) for s in range(stages)]
        assert split == stage_layers(layers, stages), (layers, stages)
