"""torchrun --nproc_per_node=2 tests/parallel/fast_paths.py OUT

The opt-in fast paths at TP=2 against the plain path at TP=2 (which test_equivalence holds
to TP=1), belief_star with an untied output layer: model.fused_output_projection (each
rank's GEMM against its shards [W^o_r | W^s_r], then the one all-reduce),
train.loss_chunk_tokens (the chunked loss over each rank's vocabulary shard) and
model.compile=layer (each decoder layer, its tensor-parallel collectives included, through
torch.compile and Inductor); and sequence parallelism (parallel.sequence_parallel) with the
plain path, each fast path and each recompute mode. Saves each rank's loss and gradients
of every path, and torch.compile's graph and graph-break counts of the compiled paths
without and with sequence parallelism, to OUT.rank<r>. In the same job, for
tests/test_plan.py's count of activations at TP=2: the bytes each rank's forward saves at
one and two layers (ACTIVATION_CASES), with and without sequence parallelism."""

import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from belief_lm.config import load_config  # noqa: E402
from belief_lm.model.gpt import BeliefLM  # noqa: E402
from belief_lm.variants import VARIANTS  # noqa: E402
from tests.models import tiny_model  # noqa: E402
from tests.parallel.driver import join  # noqa: E402

VOCAB, CHUNK, SEED = 256, 23, 3
PATHS = {"plain": ({}, 0), "fused_output": ({"fused_output_projection": True}, 0)}
PATHS |= {"chunked_loss": ({}, CHUNK), "compiled": ({"compile": "layer"}, 0)}
"""Name: (model options, train.loss_chunk_tokens)."""
SEQUENCE_PARALLEL_PATHS = {f"sequence_parallel_{name}": path for name, path in PATHS.items()}
SEQUENCE_PARALLEL_PATHS |= {
    f"sequence_parallel_recompute_{mode}": ({}, 0, mode) for mode in ("selective", "full")
}
"""The same with sequence parallelism, and each recompute mode with it: name: (model
options, train.loss_chunk_tokens[, train.activation_checkpointing])."""
ACTIVATION_CASES = [
    *((variant, "float32", True) for variant in VARIANTS),
    *((variant, "float32", False) for variant in ("softmax", "belief_star")),
    *((variant, "bfloat16", True) for variant in VARIANTS),
]
"""(variant, dtype, sequence parallelism) at tests/test_plan.py's small llama shape, each
recompute mode: every variant with it in fp32 and in bf16, two without it."""


def kept_at(tensor_parallel: int) -> dict:
    """{(variant, dtype, sequence_parallel, layers, recompute): bytes this rank's forward
    saves for backward} at TP=`tensor_parallel` (tests/test_plan.py's saved_by_autograd),
    for ACTIVATION_CASES."""
    from belief_lm.plan import RECOMPUTE_MODES
    from tests.test_plan import BATCH, LLAMA, SEQ, SMALL, VOCAB, saved_by_autograd

    rows = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    kept = {}
    for variant, dtype, sequence_parallel in ACTIVATION_CASES:
        for layers in (1, 2):
            overrides = [*SMALL, *LLAMA, f"model.num_layers={layers}", f"model.attention={variant}"]
            cfg = load_config("configs/model/tiny.yaml", overrides).model
            for mode in RECOMPUTE_MODES:
                model = BeliefLM(
                    cfg, VOCAB, tensor_parallel, recompute=mode,
                    sequence_parallel=sequence_parallel,
                ).to(getattr(torch, dtype)).train()  # fmt: skip
                with torch.no_grad():
                    model(rows)  # warm-up: what a first forward allocates once is not counted
                key = (variant, dtype, sequence_parallel, layers, mode)
                kept[key] = saved_by_autograd(model, rows)
    return kept


def tokens() -> torch.Tensor:
    """[2, 33]: inputs and next-token labels, the same on every rank."""
    return torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(0))


def loss_and_grads(
    options: dict, chunk: int, tensor_parallel: int, recompute: str = "none", **execution
) -> tuple:
    cfg = tiny_model("belief_star", tie_embeddings=False, **options)
    model = BeliefLM(
        cfg, VOCAB, tensor_parallel, seed=SEED, loss_chunk_tokens=chunk, recompute=recompute,
        **execution,
    )  # fmt: skip
    rows = tokens()
    loss = model(rows[:, :-1], rows[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def main() -> None:
    join(2, 1, timeout_s=120)
    paths = {name: loss_and_grads(*path, 2) for name, path in PATHS.items()}
    graphs = [(counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))]
    counters.clear()
    for name, (options, chunk, *recompute) in SEQUENCE_PARALLEL_PATHS.items():
        paths[name] = loss_and_grads(options, chunk, 2, *recompute, sequence_parallel=True)
    graphs.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
    saved = {"paths": paths, "graphs_and_breaks": graphs, "kept": kept_at(2)}
    torch.save(saved, f"{sys.argv[1]}.rank{dist.get_rank()}")


if __name__ == "__main__":
    main()
