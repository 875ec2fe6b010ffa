"""bench/gpu.py runs end to end: --smoke on CPU at a tiny shape (so the GPU script cannot rot
between GPU sessions), and the real thing, shortened, where there is a GPU."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from belief_lm.config import load_config
from bench import gpu
from tests.jobs import job_env, run_job, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
RUN_KEYS = {"model", "attention", "fused", "micro_batch", "tokens_per_s", "tflops", "mfu"}
RUN_KEYS |= {"peak_memory_gb", "ratio_to_softmax"}


def bench(
    tmp_path, *arguments: str, timeout: float = 600, nproc: int = 1, accelerator: str = "cpu"
) -> dict:
    out = tmp_path / "result.json"
    script = ["bench/gpu.py", "--out", str(out), *arguments]
    command = [sys.executable, *script] if nproc == 1 else torchrun_command(nproc, *script)
    # job_env: without the rendezvous variables this test process may have exported
    run = run_job(command, timeout, cwd=ROOT, env=job_env({"DS_ACCELERATOR": accelerator}))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"].endswith(" ".join(script))
    assert "| model |" in run.stdout or "| config |" in run.stdout  # the README's table
    return result


@pytest.mark.slow
def test_smoke_runs_every_check_and_run(tmp_path):
    result = bench(tmp_path, "--smoke")
    assert result["packages"]["torch"] and result["device"].endswith("threads")
    checks = result["correctness"]
    assert checks["process_group"] == {
        "backend": "gloo", "world_size": 1, "tensor_parallel": 1, "all_reduce_ok": True
    }  # fmt: skip
    curve = checks["bf16_vs_fp32"]  # DeepSpeed's bf16 engine, on the CPU too
    assert curve["pass"] and len(curve["loss_fp32"]) == len(curve["loss_bf16"]) == 5
    assert curve["loss_bf16"] != curve["loss_fp32"]  # not the same run twice
    assert curve["loss_fp32"][-1] < curve["loss_fp32"][0]  # the synthetic stream is learnable
    for model in gpu.MODELS:
        kernels = checks["sdpa_kernels"][model]
        assert set(kernels) == set(gpu.VARIANTS) and all(kernels.values())
        # every variant in softmax's kernel, Attention-SH's pooled keys too (as causal
        # attention over query groups): flash, no math fallback (a mask, or torch < 2.9's
        # CPU kernel asked for GQA, would fall back)
        assert all(kernel == ["flash (CPU)"] for kernel in kernels.values()), kernels
        products = checks["belief_inner_products"][model]
        assert products["activations"] == "bfloat16" and products["plain"]["dtype"] == "float32"
        assert checks["belief_inner_products"][model]["pass"]
        # the document mask: on the CPU every document in the causal flash kernel (bins)
        documents = checks["document_kernels"][model]
        assert documents["document_kernel"] == "bins" and documents["pass"]
        assert set(documents["sdpa_kernels"]) == set(gpu.VARIANTS)
        assert all(k == ["flash (CPU)"] for k in documents["sdpa_kernels"].values()), documents
    runs = result["runs"]
    assert [(r["model"], r["option"], r["attention"]) for r in runs] == [
        (m, o, a) for m in gpu.MODELS for o in ("plain", "foreach_adamw") for a in gpu.ATTENTIONS
    ]
    for run in runs:
        assert set(run) >= RUN_KEYS, run
        assert run["micro_batch"] == 4 and run["tokens_per_s"] > 0 and run["tflops"] > 0
        assert len(run["step_times_s"]) == 2 and run["mfu"] is None  # no known peak on CPU
    assert [r["overrides"] for r in runs[3:6]] == [["train.adamw_kernel=foreach"]] * 3
    assert all(r["ratio_to_softmax"] == 1 for r in runs if r["attention"] == "softmax")


@pytest.mark.slow
def test_smoke_named_option_sets(tmp_path):
    """The fast paths a GPU run measures, by name (model.compile=layer aside: minutes of
    Inductor on a CPU), and the document mask."""
    result = bench(
        tmp_path, "--smoke", "--models", "gpt2-124m", "--attentions", "softmax", "belief_star",
        "--option", "fused", "--option", "fused_output", "--option", "chunked_loss",
        "--option", "documents", "--max-micro-batch", "2",
    )  # fmt: skip
    names = ("fused", "fused_output", "chunked_loss", "documents")
    assert [(r["option"], r["attention"], r["micro_batch"]) for r in result["runs"]] == [
        (name, attention, 2) for name in names for attention in ("softmax", "belief_star")
    ]
    assert [r["overrides"] for r in result["runs"][::2]] == [gpu.OPTION_SETS[n] for n in names]
    assert [r["fused"] for r in result["runs"]] == [True, True] + [False] * 6
    products = result["correctness"]["belief_inner_products"]["gpt2-124m"]
    assert products["fused"]["dtype"] == "float32" and products["pass"]


@pytest.mark.slow
def test_smoke_sequence_parallel_at_tp2(tmp_path):
    """--tensor 2 under torchrun (gloo on the CPU, as NCCL on 2 GPUs): the option sets
    sequence_parallel and no_sequence_parallel at one micro-batch, each on-run with its
    step time relative to the off-run's (peak memory too on a GPU: none on the CPU)."""
    result = bench(
        tmp_path, "--smoke", "--tensor", "2", "--models", "llama-188m", "--attentions",
        "softmax", "belief_star", "--option", "sequence_parallel", "--option",
        "no_sequence_parallel", "--max-micro-batch", "2", nproc=2,
    )  # fmt: skip
    assert result["correctness"] == {"process_group": {
        "backend": "gloo", "world_size": 2, "tensor_parallel": 2, "all_reduce_ok": True
    }}  # fmt: skip
    runs = result["runs"]
    names = ("sequence_parallel", "no_sequence_parallel")
    assert [(r["option"], r["attention"], r["micro_batch"]) for r in runs] == [
        (name, attention, 2) for name in names for attention in ("softmax", "belief_star")
    ]
    assert [r["overrides"] for r in runs[::2]] == [gpu.OPTION_SETS[n] for n in names]
    for on, off in zip(runs[:2], runs[2:], strict=True):
        assert on["step_time_to_no_sequence_parallel"] == on["step_time_s"] / off["step_time_s"]
        assert on["peak_memory_gb"] is None and "peak_memory_to_no_sequence_parallel" not in on


@pytest.mark.slow
def test_smoke_paper_mode_projects_from_the_measured_rate(tmp_path):
    result = bench(tmp_path, "--smoke", "--paper")
    configs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs/paper").glob("*.yaml"))
    assert [r["config"] for r in result["runs"]] == configs
    for run in result["runs"]:
        assert run["steps"] == 4 and run["tokens_per_step"] == 2 * 2 * 32
        projection, launch = run["projection"], load_config(run["config"]).launch
        gpus = launch.nodes * launch.gpus_per_node  # the config's own allocation (8 or 32)
        assert projection["what"].startswith("PROJECTED") and projection["gpus"] == gpus
        hours = projection["full_run_tokens"] / (run["tokens_per_s"] * gpus) / 3600
        assert projection["hours"] == pytest.approx(hours)


def test_smoke_overhead_against_plain_pytorch(tmp_path):
    """--overhead: bench/step_overhead.py's comparison in bf16 (the CPU's bf16 here):
    both loops step, learn a language model of the vocabulary, and their ratio is kept."""
    result = bench(
        tmp_path, "--smoke", "--overhead", "--models", "gpt2-124m", "llama-188m",
        "--attentions", "softmax", "belief_star",
    )  # fmt: skip
    runs = result["runs"]
    assert [(r["model"], r["attention"]) for r in runs] == [
        (m, a) for m in ("gpt2-124m", "llama-188m") for a in ("softmax", "belief_star")
    ]
    for run in runs:
        assert run["precision"] == "bf16" and run["micro_batch"] == 2, run
        for loop in ("plain", "belief_lm"):
            times, losses = run[loop]["step_times_s"], run[loop]["losses"]
            assert len(times) == 2 and len(losses) == 3 and min(times) > 0
            assert losses[0] == pytest.approx(math.log(512), abs=0.15)  # SMOKE_SHAPE's vocab
        assert run["ratio"] == run["belief_lm"]["median_step_s"] / run["plain"]["median_step_s"]


def test_micro_batch_search():
    """Doubling while it fits, halving while not, then bisecting to within a quarter."""
    assert gpu.next_candidate(1, None, 128) == 2
    assert gpu.next_candidate(64, None, 100) is None  # the cap
    assert gpu.next_candidate(None, 8, 128) == 4
    assert gpu.next_candidate(None, 1, 128) is None
    assert gpu.next_candidate(32, 64, 128) == 48
    assert gpu.next_candidate(48, 64, 128) == 56
    assert gpu.next_candidate(56, 64, 128) is None  # within a quarter of the fit


def test_document_runs_hold_documents():
    """The documents option set's synthetic batches hold EOS (about one in DOCUMENT_TOKENS);
    the others' do not (the learnable chain as it was)."""
    cfg = load_config("configs/tiny.yaml", [*gpu.SMOKE_SHAPE, *gpu.OPTION_SETS["documents"]])
    tokens, _ = gpu.batches_for(cfg, 64, seed=0, device="cpu")[0]  # 2,048 tokens
    documents = (tokens == gpu.DOCUMENT_END).sum().item()
    expected = tokens.numel() / gpu.DOCUMENT_TOKENS
    assert expected / 2 < documents < 2 * expected
    plain_cfg = load_config("configs/tiny.yaml", gpu.SMOKE_SHAPE)
    plain, _ = gpu.batches_for(plain_cfg, 64, seed=0, device="cpu")[0]
    assert (plain == gpu.DOCUMENT_END).sum() + expected / 2 < documents  # the chain hits 2 too


def test_option_sets_by_name_or_overrides():
    assert gpu.parse_option("tuned") == ("tuned", gpu.FAST_PATHS)
    assert {*gpu.OPTIONS, *gpu.SMOKE_OPTIONS} <= gpu.OPTION_SETS.keys()
    for overrides in gpu.OPTION_SETS.values():
        load_config("configs/tiny.yaml", overrides)  # every key exists, every value is valid
    for text in ("=model.compile=projections", "fast"):
        with pytest.raises(SystemExit, match="expected one of plain, fused"):
            gpu.parse_option(text)
    assert gpu.parse_option("fused=model.compile=projections,train.adamw_kernel=fused") == (
        "fused", ["model.compile=projections", "train.adamw_kernel=fused"]
    )  # fmt: skip
    assert gpu.parse_option("plain=") == ("plain", [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_shortened(tmp_path):
    result = bench(
        tmp_path, "--models", "gpt2-124m", "--attentions", "softmax", "belief",
        "--option", "plain=", "--steps", "2", "--warmup", "1", "--max-micro-batch", "2",
        "--check-steps", "10", accelerator="cuda",
    )  # fmt: skip
    checks = result["correctness"]
    assert checks["process_group"]["backend"] == "nccl"
    assert checks["bf16_vs_fp32"]["pass"] and checks["belief_inner_products"]["gpt2-124m"]["pass"]
    assert all(r["peak_memory_gb"] > 0 and r["micro_batch"] == 2 for r in result["runs"])
