"""Small model configurations the tests share: the two architecture families at the size
of make_checkpoint (tests/conftest.py), random token ids from the small tokenizer, the
presets, and building a model as one rank of a tensor-parallel group without the group."""

import contextlib

import torch

from belief_lm.config import ModelConfig, load_config
from belief_lm.variants import VARIANTS

SMALL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
SMALL |= {"ffn_hidden_size": 48, "seq_length": 16, "init_std": 0.3}
"""ModelConfig fields of the tests' small models (2 layers, width 32, 16 positions)."""

GPT2_LIKE = {
    "normalization": "LayerNorm",
    "activation": "gelu",
    "position_embedding": "learned_absolute",
    "tie_embeddings": True,
    "bias": True,
}
LLAMA_LIKE = {
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "position_embedding": "rope",
    "rotary_base": 500.0,
    "num_query_groups": 2,
    "tie_embeddings": False,
    "bias": False,
}
ARCHITECTURES = {"gpt2": GPT2_LIKE, "llama": LLAMA_LIKE}
VARIANTS_AND_ARCHITECTURES = [(variant, "llama") for variant in VARIANTS] + [
    ("belief_star", "gpt2"),
    ("attention_bn_sh", "gpt2"),
]
"""Every variant at the harder architecture (RoPE, GQA), two at the other (learned positions)."""


def preset(name: str, **updates) -> ModelConfig:
    """The model of configs/model/<name>.yaml, with `updates`."""
    return load_config(f"configs/model/{name}.yaml").model.model_copy(update=updates)


class StandInGroup:
    """What megatron 0.16's layers ask of their tensor-parallel group while being built:
    its size and this rank's place in it (they read them from the group object, through
    get_pg_size / get_pg_rank, not from parallel_state's world-size setters)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@contextlib.contextmanager
def tensor_parallel_rank(size: int, rank: int):
    """Build as rank `rank` of `size` tensor-parallel ranks: a stand-in group in
    parallel_state, and its world-size / rank setters for code that asks them; all
    restored afterwards."""
    from megatron.core import parallel_state as ps

    saved = ps._TENSOR_MODEL_PARALLEL_GROUP
    ps._TENSOR_MODEL_PARALLEL_GROUP = StandInGroup(size, rank)
    ps.set_tensor_model_parallel_world_size(size)
    ps.set_tensor_model_parallel_rank(rank)
    try:
        yield
    finally:
        ps._TENSOR_MODEL_PARALLEL_GROUP = saved
        ps.set_tensor_model_parallel_world_size(None)
        ps.set_tensor_model_parallel_rank(None)


def tokens(n: int, seed: int = 0, rows: int = 2) -> torch.Tensor:
    """Random ids [rows, n] of the small tokenizer's 400."""
    return torch.randint(0, 400, (rows, n), generator=torch.Generator().manual_seed(seed))


def tiny_model(variant: str, **updates) -> ModelConfig:
    """The tiny preset (RMSNorm, SwiGLU, RoPE, GQA, tied) cut to 2 layers of 32 tokens."""
    model = load_config("configs/model/tiny.yaml").model
    return model.model_copy(update={"attention": variant, "num_layers": 2, "seq_length": 32,
                                    **updates})  # fmt: skip


def assert_same(result: tuple, reference: tuple) -> None:
    """Loss and every gradient equal up to fp32 rounding (sums taken in another order)."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def trainee_for(cfg, grid, vocab_size: int, device=None, **options):
    """build_trainee as the trainer calls it, with pre-flight's precision and accumulation
    for `cfg` on process grid `grid` (options: load_universal, weights)."""
    from belief_lm.preflight import grad_accumulation_steps, use_bf16
    from belief_lm.train.engine import build_trainee

    device = device or torch.device("cpu")
    return build_trainee(
        cfg, grid, vocab_size, device, bf16=use_bf16(cfg.train.precision, device.type),
        accumulation=grad_accumulation_steps(cfg, grid.layout.data), **options,
    )  # fmt: skip


class ModuleEngine:
    """The part of DeepSpeed's engine the diagnostics use: the model, as `module`."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
