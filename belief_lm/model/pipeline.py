"""The model as DeepSpeed pipeline stages.

The same parts and seeds as `BeliefLM` (embedding, decoder layers, final norm, output
layer), so a pipelined model starts from the same weights as a single-process one. With
tied embeddings the output stage reuses the embedding through DeepSpeed's TiedLayerSpec,
which keeps the two copies identical (their gradients are summed across stages).

Parameter names differ from BeliefLM's only by prefix; `canonical_name` maps them.
"""

from __future__ import annotations

from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import Tensor

from belief_lm.config import ModelConfig
from belief_lm.model.gpt import (
    DecoderLayer,
    OutputLayer,
    TokenEmbedding,
    final_norm_class,
    lm_loss,
    stage_seed,
    transformer_config,
    vocab_parallel_logits,
)

TIED_KEY = "embedding"


def _tied_output(embedding: TokenEmbedding, hidden: Tensor) -> Tensor:
    return vocab_parallel_logits(hidden, embedding.word_embeddings.weight)


def layer_specs(model: ModelConfig, vocab_size: int, tensor_parallel: int, seed: int) -> list:
    """[embedding, layer 1..L, final norm, output] as DeepSpeed layer specs."""
    config = transformer_config(model, tensor_parallel)
    embedding_args = (TokenEmbedding, config, model, vocab_size, stage_seed(seed, 0))
    layers = [
        LayerSpec(DecoderLayer, config, model, i + 1, stage_seed(seed, i + 1))
        for i in range(model.num_layers)
    ]
    norm = LayerSpec(final_norm_class(config), config.hidden_size, eps=config.layernorm_epsilon)
    if model.tie_embeddings:
        weight = "word_embeddings.weight"
        first = TiedLayerSpec(TIED_KEY, *embedding_args, tied_weight_attr=weight)
        last = TiedLayerSpec(
            TIED_KEY, *embedding_args, forward_fn=_tied_output, tied_weight_attr=weight
        )
    else:
        first = LayerSpec(*embedding_args)
        last = LayerSpec(
            OutputLayer, config, vocab_size, False, stage_seed(seed, model.num_layers + 1)
        )
    return [first, *layers, norm, last]


def build_pipeline(
    model: ModelConfig,
    vocab_size: int,
    topology: PipeModelDataParallelTopology,
    tensor_parallel: int,
    seed: int,
) -> PipelineModule:
    """This rank's stage of the pipelined model; decoder layers are balanced over stages.
    The output stage's copy of a tied embedding is marked `pipeline_duplicate`: sums over
    the whole model (parameter count, gradient norm) must not count it twice."""
    stage = PipelineModule(
        layers=layer_specs(model, vocab_size, tensor_parallel, seed),
        topology=topology,
        loss_fn=lm_loss,
        partition_method="type:DecoderLayer",
    )
    if stage.stage_id > 0:
        for name, param in stage.named_parameters():
            param.pipeline_duplicate = name.startswith("tied_modules.")
    return stage


def canonical_name(pipeline_name: str, num_layers: int) -> str | None:
    """BeliefLM's name for a PipelineModule parameter; None for the output stage's copy of
    a tied embedding (the first stage's copy is canonical)."""
    index, _, rest = pipeline_name.partition(".")
    if index == "tied_modules":
        _key, _, rest = rest.partition(".")
        return f"embedding.{rest}"
    position = int(index)
    if position == 0:
        return f"embedding.{rest}"
    if position <= num_layers:
        return f"layers.{position - 1}.{rest}"
    return f"final_norm.{rest}" if position == num_layers + 1 else f"output_layer.{rest}"


def pipeline_name(name: str, num_layers: int, tied: bool) -> str:
    """The PipelineModule name of BeliefLM parameter `name` (inverse of canonical_name)."""
    part, _, rest = name.partition(".")
    if part == "embedding":
        return f"tied_modules.{TIED_KEY}.{rest}" if tied else f"0.{rest}"
    if part == "layers":
        index, _, rest = rest.partition(".")
        return f"{int(index) + 1}.{rest}"
    return f"{num_layers + 1 if part == 'final_norm' else num_layers + 2}.{rest}"
