"""A training step of belief-lm against a plain PyTorch loop of the same shapes (issue 35).

    .venv/bin/python -m bench.step_overhead                      # every CPU preset
    .venv/bin/python -m bench.step_overhead --presets tiny --steps 10 --profile

The plain loop is what a nanoGPT-style user writes: a `torch.nn.Module` with the model's
shapes (the same norm, activation, positions, biases, tied or untied head, GQA), SDPA
causal attention in [batch, seq] layout, `F.cross_entropy` over fp32 logits, `backward`,
`clip_grad_norm_`, torch's AdamW with the config's betas, eps and weight decay on >=2-D
weights (the same kernel flags, train.adamw_kernel), the same LR schedule. For belief_star
its attention core is `belief_lm.attention`'s (`residual_signal`) and it has the second
output projection W^s: the math is shared, so what differs is the framework around it.
belief-lm's step is `Trainee.train_step` of the engine training builds
(bench.common.bench_trainee: megatron-core layers in DeepSpeed's engine, ZeRO as the config
says, our AdamW with its skip guard, our clipping hook).

The two loops' steps alternate (which goes first alternates too), so a slow spell of the
shared machine hits both alike; each number is the median of the timed steps after the
warm-up. The machine's load average before and after is recorded. --profile adds a
`torch.profiler` run of a few steps of each loop: self CPU time by phase (the
`record_function` labels both loops carry: forward, loss, backward, clip, optimizer, and
what is left: the engine's bookkeeping) and the top ops of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from belief_lm import attention as family
from belief_lm.config import Config, ModelConfig, load_config
from belief_lm.model import gpt
from belief_lm.model.loss import IGNORE_INDEX, LossTerms
from belief_lm.parallel.dims import ParallelDims
from belief_lm.parallel.env import detect
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.train.optim import LRSchedule, adamw_kernel, param_groups
from bench.common import bench_trainee, write_result

TWO_LAYERS = ["model.vocab_size=4096", "model.num_layers=2"]
NARROW = [
    "model.hidden_size=64", "model.num_attention_heads=8", "model.ffn_hidden_size=128",
    "model.seq_length=32", "model.vocab_size=512",
]  # fmt: skip
PRESETS = {
    # name: (model config, overrides, micro-batch): the shapes (vocabulary 4096);
    # gpt2 and llama at 2 of their 12 layers (on this CPU a whole step is 12+ s), their
    # width, heads and sequence as shipped
    "gpt2-124m": ("configs/model/gpt2-124m.yaml", TWO_LAYERS, 4),
    "tiny": ("configs/model/tiny.yaml", ["model.vocab_size=4096"], 16),
    "llama-188m": ("configs/model/llama-188m.yaml", TWO_LAYERS, 4),
    # all 12 of gpt2's layers (its 148 weights and biases), narrow and short: the host's
    # work per step (--profile's leaf ops, about a GPU's kernel launches), not its FLOPs
    "gpt2-narrow": ("configs/model/gpt2-124m.yaml", NARROW, 2),
}
ATTENTIONS = ["softmax", "belief_star"]
PHASES = ["forward", "loss", "backward", "clip", "guard", "optimizer"]
"""The record_function labels both loops carry (the rest of a step: bookkeeping)."""


# ---- the plain PyTorch model -------------------------------------------------------------


class PlainBlock(nn.Module):
    """A pre-norm decoder layer as nanoGPT writes it ([batch, seq, hidden])."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        norm = nn.RMSNorm if m.normalization == "RMSNorm" else nn.LayerNorm
        d, heads, groups = m.hidden_size, m.num_attention_heads, m.query_groups
        self.heads, self.groups, self.head_dim = heads, groups, d // heads
        self.mixing, self.residual = m.variant
        self.gamma, self.swiglu = m.gamma, m.activation == "swiglu"
        self.norm1, self.norm2 = norm(d, eps=m.norm_epsilon), norm(d, eps=m.norm_epsilon)
        self.qkv = nn.Linear(d, (heads + 2 * groups) * self.head_dim, bias=m.bias)
        self.proj = nn.Linear(d, d, bias=m.bias)
        self.w_s = nn.Linear(d, d, bias=False) if m.variant.extra_projection else None
        self.fc1 = nn.Linear(d, m.ffn_size * (2 if self.swiglu else 1), bias=m.bias)
        self.fc2 = nn.Linear(m.ffn_size, d, bias=m.bias)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, *[self.groups * self.head_dim] * 2], dim=-1
        )
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [b, heads, s, d]
        k = k.view(b, s, self.groups, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.groups, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        h = family.attention_heads(q, k, v, self.mixing)  # SDPA causal
        h = h.transpose(1, 2)  # [b, s, heads, d]
        if self.residual == "mh":
            out = self.proj(h.reshape(b, s, -1))
        else:
            v_heads = family.heads_from_groups(v, self.heads).transpose(1, 2)
            signal = family.residual_signal(h, v_heads, self.residual, self.gamma)
            if self.w_s is None:
                out = self.proj(signal)
            else:
                delta, delta_s = signal.chunk(2, dim=-1)
                out = self.proj(delta) + self.w_s(delta_s)
        x = x + out
        hidden = self.fc1(self.norm2(x))
        if self.swiglu:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden)
        return x + self.fc2(hidden)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE, non-interleaved (megatron's layout): x [b, heads, s, d], cos/sin [s, d]."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class PlainLM(nn.Module):
    """The whole model as one plain module; forward returns the mean cross entropy."""

    def __init__(self, m: ModelConfig, vocab_size: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, m.hidden_size)
        learned = m.position_embedding == "learned_absolute"
        self.positions = nn.Embedding(m.seq_length, m.hidden_size) if learned else None
        self.rope_base = None if learned else m.rotary_base
        self.blocks = nn.ModuleList(PlainBlock(m) for _ in range(m.num_layers))
        norm = nn.RMSNorm if m.normalization == "RMSNorm" else nn.LayerNorm
        self.final_norm = norm(m.hidden_size, eps=m.norm_epsilon)
        self.head = nn.Linear(m.hidden_size, vocab_size, bias=False)
        if m.tie_embeddings:
            self.head.weight = self.embed.weight
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.ndim >= 2:
                nn.init.normal_(param, std=m.init_std)

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        seq = tokens.shape[1]
        x = self.embed(tokens)
        rope = None
        if self.positions is not None:
            x = x + self.positions(torch.arange(seq, device=tokens.device))
        else:
            head_dim = self.blocks[0].head_dim
            angles = family.rotary_angles(torch.arange(seq, device=tokens.device),
                                          head_dim, self.rope_base)  # fmt: skip
            rope = (angles.cos(), angles.sin())
        with torch.profiler.record_function("forward"):
            for block in self.blocks:
                x = block(x, rope)
            x = self.final_norm(x)
        with torch.profiler.record_function("loss"):
            logits = self.head(x).float().flatten(0, 1)
            return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX)


class PlainLoop:
    """The plain loop's model, optimizer and schedule; `step` is one optimizer step."""

    def __init__(self, cfg: Config, device: torch.device):
        torch.manual_seed(cfg.run.seed)
        train = cfg.train
        self.model = PlainLM(cfg.model, cfg.model.vocab_size).to(device)
        # bf16 as nanoGPT runs it: autocast over fp32 weights and optimizer state
        bf16 = cfg.train.precision == "bf16"
        self.autocast = torch.autocast(device.type, torch.bfloat16, enabled=bf16)
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, train.weight_decay), lr=train.lr,
            betas=(train.beta1, train.beta2), eps=train.eps,
            **adamw_kernel(train.adamw_kernel, device),
        )  # fmt: skip
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, LRSchedule(train))
        self.clip = train.grad_clip

    def step(self, tokens: Tensor, labels: Tensor) -> Tensor:
        with self.autocast:
            loss = self.model(tokens, labels)
        with torch.profiler.record_function("backward"):
            loss.backward()
        with torch.profiler.record_function("clip"):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        with torch.profiler.record_function("optimizer"):
            self.optimizer.step()
            self.schedule.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


# ---- measuring ---------------------------------------------------------------------------


def comparison_config(
    path: str, overrides: list[str], attention: str, precision: str, micro_batch: int
) -> Config:
    """Model config `path` with `overrides`, one micro-batch a step (no accumulation)."""
    return load_config(path, [
        *overrides, f"model.attention={attention}", f"train.micro_batch_size={micro_batch}",
        f"train.global_batch_size={micro_batch}", "train.global_batch_tokens=null",
        f"train.precision={precision}",
    ])  # fmt: skip


def random_batch(cfg: Config, vocab: int, device: torch.device, seed: int) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_length + 1)
    chain = torch.randint(vocab, shape, generator=gen)
    return chain[:, :-1].to(device), chain[:, 1:].to(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[], Tensor], device: torch.device) -> tuple[float, float]:
    """Seconds of one step (its loss read: the step is done), and its loss."""
    synchronize(device)
    started = time.perf_counter()
    loss = step().item()  # host-device sync
    return time.perf_counter() - started, loss


def side_by_side(cfg: Config, grid: ProcessGrid, device: torch.device, warmup: int,
                 steps: int, profile_steps: int = 0) -> dict:  # fmt: skip
    """Both loops of `cfg` (train.precision fp32 or bf16) on the same batches, their steps
    alternating: each one's median step time, and their ratio; with `profile_steps`, the
    profile of each (`profiled`)."""
    vocab = cfg.model.vocab_size
    plain = PlainLoop(cfg, device)
    trainee = bench_trainee(cfg, grid, vocab, device)
    batches = [random_batch(cfg, vocab, device, seed) for seed in range(2)]
    loops = {
        "plain": lambda batch: plain.step(*batch),
        "belief_lm": lambda batch: trainee.train_step(iter([batch])).loss,
    }
    times = {name: [] for name in loops}
    losses = {name: [] for name in loops}
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        order = list(loops) if i % 2 == 0 else list(loops)[::-1]
        for name in order:
            seconds, loss = timed(lambda: loops[name](batch), device)  # noqa: B023
            losses[name].append(loss)
            if i >= warmup:
                times[name].append(seconds)
    out = {
        name: {"median_step_s": statistics.median(t), "step_times_s": t, "losses": losses[name]}
        for name, t in times.items()
    }
    out["ratio"] = out["belief_lm"]["median_step_s"] / out["plain"]["median_step_s"]
    if profile_steps:
        out["profile"] = {
            name: profiled(lambda: loop(batches[0]), profile_steps)  # noqa: B023
            for name, loop in loops.items()
        }
    if hasattr(trainee.engine, "destroy"):
        trainee.engine.destroy()
    return out


NO_KERNEL = {
    f"aten::{name}"
    for name in (
        "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "slice", "select",
        "narrow", "split", "split_with_sizes", "chunk", "unbind", "expand", "as_strided",
        "unsqueeze", "squeeze", "detach", "alias", "lift_fresh", "empty", "empty_like",
        "empty_strided", "resize_", "set_", "is_nonzero", "result_type",
    )
}  # fmt: skip
"""Leaf ops that launch no kernel on a GPU (views, allocations, metadata)."""


def launches_kernels(event) -> bool:
    """Whether a profiled CPU op stands for kernel launches on a GPU: a leaf aten op that
    is no view or allocation (NO_KERNEL), or a multi-tensor `_foreach_` op, one launch per
    chunk of tensors on a GPU, which the CPU runs as one op per tensor (not counted)."""
    if not event.name.startswith("aten::") or event.name in NO_KERNEL:
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::_foreach_"):
            return False
        parent = parent.cpu_parent
    return event.name.startswith("aten::_foreach_") or not event.cpu_children


def profiled(step: Callable[[], Tensor], steps: int, top: int = 20) -> dict:
    """Per step: the CPU time under each phase label, the step's whole time, and the top
    ops by self CPU time (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("step"):
                step().item()
    averages = prof.key_averages()
    total = {e.key: e.cpu_time_total / 1e6 / steps for e in averages}  # (incl. children)
    phases = {phase: total.get(phase, 0.0) for phase in PHASES}
    whole = total["step"]
    phases["rest"] = whole - sum(phases.values())
    ops = sorted(
        (e for e in averages if e.key not in {"step", *PHASES} and not e.key.startswith("[")),
        key=lambda e: e.self_cpu_time_total, reverse=True,
    )  # fmt: skip
    leaves = [e for e in prof.events() if launches_kernels(e)]
    return {
        "step_s": whole,
        "phases_s": phases,
        # the ops that launch kernels on a GPU (launches_kernels), counted on the CPU
        "leaf_ops": len(leaves) // steps,
        "top_ops": [
            {"op": e.key, "self_s": e.self_cpu_time_total / 1e6 / steps, "calls": e.count // steps}
            for e in ops[:top]
        ],
    }


def torch_cross_entropy(logits: Tensor, labels: Tensor, z_loss: float = 0.0) -> LossTerms:
    """belief_lm.model.loss.lm_loss through torch's F.cross_entropy (one process: the
    vocabulary not split; no z-loss): --torch-loss, what swapping megatron's vocab-parallel
    cross entropy for torch's would change in a step."""
    if z_loss:
        raise SystemExit("--torch-loss takes no train.z_loss")
    flat = logits.float().flatten(0, 1)  # [seq * batch, vocab], labels sequence-major
    loss = F.cross_entropy(flat, labels.t().reshape(-1), ignore_index=IGNORE_INDEX)
    return LossTerms(loss, loss.detach().new_zeros(()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--attentions", nargs="+", default=ATTENTIONS)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7, help="timed steps of each loop")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also profile STEPS steps of each loop (phases, top ops)")  # fmt: skip
    parser.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32",
        help="bf16: DeepSpeed's bf16 engine against autocast, as on a GPU",
    )  # fmt: skip
    parser.add_argument("--torch-loss", action="store_true",
                        help="belief-lm's loss through torch's F.cross_entropy")  # fmt: skip
    parser.add_argument("--out", default="bench/results/step_overhead_cpu.json")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    if args.torch_loss:
        gpt.lm_loss = torch_cross_entropy
    device = torch.device("cpu")
    grid = ProcessGrid.join(detect({}), device, ParallelDims(1, 1, 1))  # one process
    load_before = os.getloadavg()
    runs = []
    for preset in args.presets:
        for attention in args.attentions:
            path, overrides, micro_batch = PRESETS[preset]
            overrides = [*overrides, *args.overrides]
            cfg = comparison_config(path, overrides, attention, args.precision, micro_batch)
            run = {"preset": preset, "attention": attention, "overrides": overrides}
            run["micro_batch"], run["seq_length"] = micro_batch, cfg.model.seq_length
            run |= side_by_side(cfg, grid, device, args.warmup, args.steps, args.profile)
            runs.append(run)
            print(f"{preset:11s} {attention:12s} plain {run['plain']['median_step_s']:.3f} s  "
                  f"belief-lm {run['belief_lm']['median_step_s']:.3f} s  "
                  f"x{run['ratio']:.3f}", flush=True)  # fmt: skip
    result = {
        "benchmark": "median step time, belief-lm's Trainee.train_step against a plain "
        "PyTorch loop of the same shapes, steps alternating",
        "precision": args.precision,
        "loss": "F.cross_entropy" if args.torch_loss else "megatron's vocab-parallel steps",
        "warmup": args.warmup,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "note": "shared 2-core machine: the load averages say how busy it was",
        "runs": runs,
    }
    print("wrote", write_result(args.out, result, device))


if __name__ == "__main__":
    main()
