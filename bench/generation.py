"""Decoding speed with and without the KV cache, per attention variant.

    python bench/generation.py --threads 1                      # CPU: tiny, 512 new tokens
    python bench/generation.py --device cuda --model configs/model/llama-188m.yaml \
        model.seq_length=1024

Greedy decoding with belief-lm's own generator (`belief_lm.inference.generate`) on a
seeded random model: a 64-token prompt continued by 512 tokens (EOS never stops it), once
with the cache and once rerunning the model over the whole context at every step, the
variants and both modes taking turns over several rounds. Checks that both modes produce
the same tokens; writes JSON (tokens/s of every run) to bench/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from belief_lm.config import load_config
from belief_lm.inference.generate import Sampling, generate
from belief_lm.model.gpt import BeliefLM
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.runtime import select_device
from belief_lm.variants import VARIANTS
from bench.common import write_result

MODES = {"cache": True, "recompute": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="configs/model/tiny.yaml")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="turns of every variant and mode")
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's); on a shared, busy CPU "
        "1 avoids threads waiting for each other at every operation",
    )  # fmt: skip
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "overrides", nargs="*", help="model overrides (default: model.seq_length=640)"
    )
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    model_cfg = load_config(args.model, args.overrides or ["model.seq_length=640"]).model
    if args.prompt_tokens + args.new_tokens > model_cfg.seq_length:
        parser.error(
            f"{args.prompt_tokens} + {args.new_tokens} tokens do not fit in model.seq_length "
            f"({model_cfg.seq_length}): past it the cache is not used"
        )
    device = select_device(args.device)
    ProcessGrid.single_process()
    prompt = torch.randint(0, args.vocab, (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    models = {
        variant: BeliefLM(model_cfg.model_copy(update={"attention": variant}), args.vocab)
        .to(device)
        .eval()
        for variant in args.variants
    }
    options = {"context_length": model_cfg.seq_length, "vocab_size": args.vocab}

    def decode(variant: str, mode: str) -> tuple[float, list[int]]:
        start = time.perf_counter()
        ids = generate(models[variant], prompt, args.new_tokens, Sampling(temperature=0),
                       use_cache=MODES[mode], **options)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
        return args.new_tokens / (time.perf_counter() - start), ids

    for variant in models:  # warm-up (allocator, kernels), shorter
        for mode in MODES:
            generate(models[variant], prompt, 16, Sampling(temperature=0),
                     use_cache=MODES[mode], **options)  # fmt: skip
    # variants and modes take turns, round after round, so that a slow spell of the shared
    # machine hits all of them alike; each number is the median over the rounds
    load_before = os.getloadavg()  # the machine is shared: how busy it was, for the record
    samples = {variant: {mode: [] for mode in MODES} for variant in models}
    same_tokens = {variant: True for variant in models}
    for round_ in range(args.rounds):
        for variant in models:
            tokens = {}
            for mode in MODES:
                rate, tokens[mode] = decode(variant, mode)
                samples[variant][mode].append(rate)
                print(f"round {round_ + 1}: {variant} {mode} {rate:.1f} tokens/s", flush=True)
            same_tokens[variant] &= tokens["cache"] == tokens["recompute"]
    rows = {}
    for variant, by_mode in samples.items():
        median = {mode: statistics.median(rates) for mode, rates in by_mode.items()}
        rows[variant] = {
            "cache_tokens_per_s": median["cache"],
            "recompute_tokens_per_s": median["recompute"],
            "speedup": median["cache"] / median["recompute"],
            "same_tokens": same_tokens[variant],
            "samples_tokens_per_s": by_mode,
        }
        print(
            f"{variant:16s} cache {median['cache']:8.1f} tokens/s | recompute "
            f"{median['recompute']:8.1f} tokens/s | x{rows[variant]['speedup']:.2f} | "
            f"same tokens: {same_tokens[variant]}",
            flush=True,
        )

    out = args.out or f"bench/results/generation_{args.device}.json"
    result = {
        "benchmark": "greedy decoding tokens/s, with the KV cache and recomputing the context",
        "model": model_cfg.model_dump(mode="json"),
        "vocab": args.vocab,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        "variants": rows,
    }
    print("wrote", write_result(out, result, device))
    if not all(same_tokens.values()):
        sys.exit(
            "the cache changed the tokens of: "
            + ", ".join(v for v, s in same_tokens.items() if not s)
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
