"""The model as DeepSpeed pipeline stages.

The same parts and seeds as `BeliefLM` (embedding, decoder layers, final norm, output
layer), so a pipelined model starts from the same weights as a single-process one. With
tied embeddings the output stage reuses the embedding through DeepSpeed's TiedLayerSpec,
which keeps the two copies identical (their gradients are summed across stages).

With train.loss_chunk_tokens the output stage returns (hidden, weight) instead of logits,
and the pipeline's loss_fn computes the loss from them a chunk at a time
(chunked_lm_loss): DeepSpeed's engine hands the last stage's outputs, as they are, to
loss_fn on that stage, the only place it sees the labels. The weight is the output layer's
own or the embedding's; its gradient comes from the loss_fn's backward like any other use
(a tied one is then summed across stages as usual). The weight is used outside its
module's forward, which only ZeRO-3 would mind, and pipelines run ZeRO 0-1.

Under model.attention_mask=document a stage hands the next (hidden states, document ends):
DeepSpeed's stage boundary takes a tuple whose last element is a boolean mask (sent as
half precision, received back as bool, never given a gradient) once the engine is told
(`set_has_attention_mask`, build_trainee); every stage derives the documents from the
marks. Shapes stay static: the marks are [micro-batch, seq] like the tokens.

With train.z_loss the loss_fn's gradient includes the z-loss, and `BeliefPipeline` reports
its term through DeepSpeed's get_additional_losses: the pipeline engine sums it over the
micro-batches, averages it over data parallelism and broadcasts it to every stage, as it
does the loss (the engine's get_additional_losses after train_batch).

Parameter names differ from BeliefLM's only by prefix; `canonical_name` maps them.
"""

from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import Tensor

from belief_lm.config import ModelConfig
from belief_lm.model.gpt import (
    DecoderLayer,
    OutputLayer,
    TokenEmbedding,
    final_norm_class,
    stage_seed,
    transformer_config,
    vocab_parallel_logits,
)
from belief_lm.model.loss import chunked_lm_loss, lm_loss
from belief_lm.parallel.collectives import sum_sequence_parallel_grads

TIED_KEY = "embedding"


def _tied_output(embedding: TokenEmbedding, hidden: Tensor) -> Tensor:
    weight, sequence_parallel = embedding.word_embeddings.weight, embedding.config.sequence_parallel
    return vocab_parallel_logits(hidden, weight, sequence_parallel)


def _tied_loss_inputs(embedding: TokenEmbedding, hidden: Tensor) -> tuple[Tensor, Tensor]:
    return hidden, embedding.word_embeddings.weight


class OutputLossInputs(OutputLayer):
    """The (untied) output stage under loss chunking: its input and its weight, for the
    loss_fn's chunked output GEMM, instead of logits."""

    def forward(self, hidden: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return hidden, self.weight


class BeliefPipeline(PipelineModule):
    """DeepSpeed's PipelineModule whose loss_fn is the model's loss: from the output
    stage's logits, or a chunk at a time from its (hidden, weight) with
    `loss_chunk_tokens`; with the z-loss of coefficient `z_loss`, whose term of the last
    micro-batch get_additional_losses reports (on every stage: the engine asks each for
    the names it will receive). The train step sets `label_weights`, one factor per
    micro-batch of the step (train/engine.py label_weights: the loss weighted by tokens),
    which the loss_fn uses up in the order the engine runs them; once they are used up (as
    in evaluation), each micro-batch's own mean."""

    def __init__(
        self,
        *,
        loss_chunk_tokens: int = 0,
        z_loss: float = 0.0,
        sequence_parallel: bool = False,
        **pipeline,
    ):
        super().__init__(loss_fn=self.loss, **pipeline)
        self.loss_chunk_tokens, self.z_loss = loss_chunk_tokens, z_loss
        self.sequence_parallel = sequence_parallel
        self.last_z_loss = torch.zeros(())
        self.label_weights: list[Tensor] = []

    def loss(self, outputs, labels: Tensor) -> Tensor:
        if self.loss_chunk_tokens:
            hidden, weight = outputs
            terms = chunked_lm_loss(
                hidden, weight, labels, self.loss_chunk_tokens, self.z_loss,
                self.sequence_parallel,
            )  # fmt: skip
        else:
            terms = lm_loss(outputs, labels, self.z_loss)
        share = self.label_weights.pop(0) if self.label_weights else 1.0
        self.last_z_loss = terms.z_loss * share
        return terms.loss * share

    def get_additional_losses(self) -> dict[str, Tensor] | None:
        return {"z_loss": self.last_z_loss} if self.z_loss else None


def layer_specs(
    model: ModelConfig,
    vocab_size: int,
    tensor_parallel: int,
    seed: int,
    chunked: bool = False,
    recompute: str = "none",
    sequence_parallel: bool = False,
    eos_id: int | None = None,
) -> list:
    """[embedding, layer 1..L, final norm, output] as DeepSpeed layer specs; `chunked`: the
    output stage returns (hidden, weight) for a chunked loss instead of logits; `recompute`:
    train.activation_checkpointing; `sequence_parallel`: parallel.sequence_parallel,
    resolved (the stages then pass [seq / TP, batch, hidden] between them); `eos_id`: the
    tokenizer's EOS (document masks)."""
    config = transformer_config(model, tensor_parallel, sequence_parallel)
    embedding_args = (TokenEmbedding, config, model, vocab_size, stage_seed(seed, 0), eos_id)
    layers = [
        LayerSpec(DecoderLayer, config, model, i + 1, stage_seed(seed, i + 1), recompute)
        for i in range(model.num_layers)
    ]
    norm = LayerSpec(
        final_norm_class(config), config.hidden_size, eps=config.layernorm_epsilon,
        sequence_parallel=config.sequence_parallel,
    )  # fmt: skip
    if model.tie_embeddings:
        weight = "word_embeddings.weight"
        output = _tied_loss_inputs if chunked else _tied_output
        first = TiedLayerSpec(TIED_KEY, *embedding_args, tied_weight_attr=weight)
        last = TiedLayerSpec(TIED_KEY, *embedding_args, forward_fn=output, tied_weight_attr=weight)
    else:
        output = OutputLossInputs if chunked else OutputLayer
        first = LayerSpec(*embedding_args)
        last = LayerSpec(output, config, vocab_size, False, stage_seed(seed, model.num_layers + 1))
    return [first, *layers, norm, last]


def build_pipeline(
    model: ModelConfig,
    vocab_size: int,
    topology: PipeModelDataParallelTopology,
    tensor_parallel: int,
    seed: int,
    loss_chunk_tokens: int = 0,
    recompute: str = "none",
    eos_id: int | None = None,
    z_loss: float = 0.0,
    sequence_parallel: bool = False,
) -> PipelineModule:
    """This rank's stage of the pipelined model; decoder layers are balanced over stages.
    `loss_chunk_tokens` is train.loss_chunk_tokens, `recompute`
    train.activation_checkpointing, `eos_id` the tokenizer's EOS (where documents end under
    model.attention_mask=document), `z_loss` train.z_loss, `sequence_parallel`
    parallel.sequence_parallel (resolved). The output stage's copy of a
    tied embedding is marked `pipeline_duplicate`: sums over the whole model (parameter
    count, gradient norm) must not count it twice."""
    stage = BeliefPipeline(
        layers=layer_specs(
            model,
            vocab_size,
            tensor_parallel,
            seed,
            loss_chunk_tokens > 0,
            recompute,
            sequence_parallel,
            eos_id,
        ),
        topology=topology,
        partition_method="type:DecoderLayer",
        loss_chunk_tokens=loss_chunk_tokens,
        z_loss=z_loss,
        sequence_parallel=sequence_parallel and tensor_parallel > 1,
    )
    sum_sequence_parallel_grads(stage)
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
