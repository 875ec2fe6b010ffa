"""What belief_lm/compat.py assumes of torch's, megatron-core's and DeepSpeed's private parts,
checked against the installed versions: an upgrade that breaks one fails here, by name."""

import inspect

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from belief_lm import compat
from belief_lm.config import load_config
from tests.checkpoint.damage import poison
from tests.jobs import MICRO, ROOT
from tests.models import trainee_for


def test_torch_scales_a_list_of_tensors_in_place():
    tensors = [torch.ones(3), torch.full((2, 2), 3.0, dtype=torch.float64)]
    kept = [t.data_ptr() for t in tensors]
    compat.scale_in_place(tensors, 0.5)
    assert [t.data_ptr() for t in tensors] == kept, "torch._foreach_mul_ no longer works in place"
    assert tensors[0].tolist() == [0.5] * 3 and tensors[1].tolist() == [[1.5] * 2] * 2


def test_torch_norms_each_tensor_of_a_list():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, dtype=torch.float64)]
    found = compat.norms(tensors)
    assert [n.item() for n in found] == pytest.approx([t.norm().item() for t in tensors])
    assert [n.dtype for n in found] == [t.dtype for t in tensors] and compat.norms([]) == []


def test_torch_schedulers_report_the_rates_set_between_steps():
    """compat.set_last_lr (a branch's rates, set between steps): the scheduler reports them
    and its saved state holds them, until its next step computes its own."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    compat.set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25], "LRScheduler.get_last_lr no longer reads _last_lr"
    assert scheduler.state_dict()["_last_lr"] == [0.25]
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.5]


def test_torch_records_and_dumps_the_allocator_history_as_profiling_calls_it():
    """compat.record_memory_history / dump_memory_history's calls, by their signatures (the
    calls themselves need a GPU: tests/train/test_profile.py's GPU test)."""
    record = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"enabled", "max_entries"} <= record.keys(), (
        "torch.cuda.memory._record_memory_history changed: compat.record_memory_history"
    )
    dump = inspect.signature(torch.cuda.memory._dump_snapshot).parameters
    assert next(iter(dump)) == "filename", (
        "torch.cuda.memory._dump_snapshot changed: compat.dump_memory_history"
    )


def test_megatron_row_linear_takes_its_group_in_its_private_gemm_call():
    parameters = inspect.signature(RowParallelLinear._forward_impl).parameters
    assert "tp_group" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()), (
        "RowParallelLinear._forward_impl no longer takes tp_group: compat.RowLinear"
    )
    source = inspect.getsource(RowParallelLinear.forward)
    assert "_forward_impl(" in source, "RowParallelLinear.forward no longer calls _forward_impl"


def test_megatron_column_linear_reads_allreduce_dgrad_at_forward():
    source = inspect.getsource(ColumnParallelLinear.forward)
    assert "self.allreduce_dgrad" in source, (
        "ColumnParallelLinear.forward no longer reads allreduce_dgrad: compat.ColumnLinear"
    )


@pytest.mark.parametrize("kind", ["column", "row"])
def test_megatron_linears_take_torchs_gemm_where_they_communicate_nothing(
    single_process_group, kind
):
    """At one tensor-parallel rank compat's linears compute torch's F.linear instead of
    megatron's GEMM function (the keywords megatron hands `_forward_impl` say there is
    nothing to communicate): the same output and gradients as megatron's own linear."""
    from belief_lm.model.gpt import transformer_config
    from tests.models import tiny_model

    config = transformer_config(tiny_model("softmax"))
    plain, ours = (
        (ColumnParallelLinear, compat.ColumnGemm) if kind == "column"
        else (RowParallelLinear, compat.RowGemm)
    )  # fmt: skip
    options = {"config": config, "init_method": config.init_method, "bias": True}
    options |= {"gather_output": False} if kind == "column" else {"input_is_parallel": True}
    layers = [cls(32, 48, skip_bias_add=False, **options) for cls in (plain, ours)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(5, 2, 32)
    outputs, gemms = [], []
    for layer in layers:
        with torch.profiler.profile() as profile:
            out, _ = layer(x.clone().requires_grad_())
            out.square().sum().backward()
        outputs.append([out, layer.weight.grad, layer.bias.grad])
        gemms.append(any("LinearWithGradAccumulation" in e.name for e in profile.events()))
    assert gemms == [True, False], "megatron's GEMM function no longer runs where expected"
    for theirs, mine in zip(*outputs, strict=True):
        torch.testing.assert_close(mine, theirs)


def test_megatron_linears_put_empty_extra_state_into_state_dicts(single_process_group):
    from belief_lm.model.gpt import BeliefLM
    from tests.models import tiny_model

    model = BeliefLM(tiny_model("softmax"), 64)
    keys = [k for k, v in model.state_dict().items() if k.endswith("._extra_state")]
    assert keys, "megatron no longer writes _extra_state: drop compat.drop_empty_extra_state"
    for module in model.modules():
        module.register_state_dict_post_hook(compat.drop_empty_extra_state)
    assert not any(k.endswith("._extra_state") for k in model.state_dict())


def test_megatron_sequence_parallel_allocates_on_cuda_where_the_shim_says():
    """compat.megatron_collectives_on_host: SEQUENCE_PARALLEL_MODULES are where megatron's
    sequence-parallel paths allocate with torch.cuda.current_device() (drop the shim when
    none does), and after it their torch's current device is the CPU on this host."""
    import importlib

    for name in compat.SEQUENCE_PARALLEL_MODULES:
        source = inspect.getsource(importlib.import_module(name))
        assert "torch.cuda.current_device()" in source, f"{name}: compat shim unneeded?"
    compat.megatron_collectives_on_host()
    for name in compat.SEQUENCE_PARALLEL_MODULES:
        module = importlib.import_module(name)
        assert module.torch.cuda.current_device() == torch.device("cpu")
        assert module.torch.empty is torch.empty and module.torch.Tensor is torch.Tensor


def test_megatron_embedding_forks_its_rng_tracker_under_sequence_parallel():
    """compat.untracked_dropout_rng: megatron's embedding applies its dropout inside
    get_cuda_rng_tracker().fork() under sequence parallelism; after the shim the fork is
    a no-op here."""
    from megatron.core.models.common.embeddings import language_model_embedding
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    assert "get_cuda_rng_tracker().fork()" in inspect.getsource(language_model_embedding)
    compat.untracked_dropout_rng()
    with get_cuda_rng_tracker().fork():
        pass


@pytest.mark.parametrize("interleaved", [False, True])
def test_megatron_rope_without_its_no_op_passes_is_megatrons_bit_for_bit(interleaved):
    """compat.lean_rotary_embedding: q as megatron's attention hands it (a non-contiguous
    slice of the fused projection, [seq, batch, heads, dim]) gets megatron's values and
    gradient, bit for bit; a scale or a partial rotary dimension runs megatron's own."""
    from megatron.core.models.common.embeddings import rope_utils

    from belief_lm.attention import rotary_angles

    compat.lean_rotary_embedding()
    lean = rope_utils._apply_rotary_pos_emb_bshd
    megatrons = lean.megatrons
    freqs = rotary_angles(torch.arange(16), 8, 10000.0)[:, None, None, :]
    fused = torch.randn(16, 2, 3, 24, generator=torch.Generator().manual_seed(0))
    results = []
    for apply in (lean, megatrons):
        leaf = fused.clone().requires_grad_()
        out = apply(leaf[..., 8:16], freqs, interleaved)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert rope_utils._apply_rotary_pos_emb_bshd is lean  # building twice patches once
    compat.lean_rotary_embedding()
    assert rope_utils._apply_rotary_pos_emb_bshd is lean
    q = fused[..., :12]
    for args in ((q[..., :8], freqs, interleaved, False, 2.0), (q, freqs, interleaved)):
        assert torch.equal(lean(*args), megatrons(*args))


def test_deepspeed_lists_the_shm_op_it_may_build():
    import deepspeed.ops

    assert "deepspeed_shm_comm" in deepspeed.ops.__compatible_ops__, (
        "deepspeed.ops.__compatible_ops__ has no deepspeed_shm_comm: compat.disable_shm_comm"
    )


def test_deepspeed_zero_overflow_check_goes_through_the_pass_we_replace():
    """compat.one_pass_overflow_check replaces ZeRO-1/2's per-tensor pass by instance
    attribute: its has_overflow must call it through `self`, over `averaged_gradients` of
    each of `bit16_groups` (the behaviour: tests/train/test_engine.py's bf16 skip test)."""
    import inspect

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    assert "self.has_overflow_partitioned_grads_serial()" in inspect.getsource(Zero.has_overflow)
    serial = inspect.getsource(Zero.has_overflow_partitioned_grads_serial)
    assert "self.averaged_gradients[i]" in serial and "len(self.bit16_groups)" in serial


def test_deepspeed_zero_grad_norm_keeps_the_rules_our_one_pass_copies():
    """compat.one_pass_grad_norm reimplements ZeRO-1/2's get_grad_norm_direct (order 2):
    its rules must still be DeepSpeed's, and scaled_global_norm must still call it through
    `self` (our norm against DeepSpeed's on the same gradients: tests/train/test_engine.py;
    at TP, PP and DP > 1: the equivalence tests, which clip)."""
    import inspect

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    assert "self.get_grad_norm_direct(" in inspect.getsource(Zero.scaled_global_norm)
    source = inspect.getsource(Zero.get_grad_norm_direct)
    for rule in (
        'getattr(g, "_zero_padding", False)',
        "hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated",
        "is_model_parallel_parameter(p) or (self.model_parallel_rank == 0)",
        "torch.stack(all_norms).pow(norm_type).sum().float()",
        "dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)",
        "self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)",
        "mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)",
    ):
        assert rule in source, f"DeepSpeed's get_grad_norm_direct changed: {rule}"


def test_deepspeed_pipeline_steps_through_the_call_we_hook():
    """compat.before_pipeline_update hooks DeepSpeed's pipeline engine by replacing
    `_take_model_step` by instance attribute: the schedule's OptimizerStep must still run
    `_exec_optimizer_step`, which calls it through `self`, after the step's last backward
    and the gradients' reductions (the behaviour: the gradient norms and the loss check
    at TP=2 x PP=2 x DP=2, tests/parallel/test_equivalence.py::test_belief_star_tp2_pp2_dp2)."""
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert PipelineEngine._INSTRUCTION_MAP[schedule.OptimizerStep] is (
        PipelineEngine._exec_optimizer_step
    )
    assert "self._take_model_step(" in inspect.getsource(PipelineEngine._exec_optimizer_step)
    steps = inspect.getsource(schedule.TrainSchedule.steps)
    last = steps.index("if step_id == total_steps - 1:")
    reductions = [
        steps.index(f"cmds.append({name}())", last)
        for name in ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")
    ]
    assert reductions == sorted(reductions), "DeepSpeed's schedule no longer ends in its step"
    assert steps.index("BackwardPass(") < last
    assert "self._train_schedule()" in inspect.getsource(PipelineEngine.train_batch)


def test_deepspeed_pipeline_averages_the_loss_as_pipeline_step_loss_takes_it():
    """compat.pipeline_step_loss runs the pipeline engine's `_aggregate_total_loss` before
    the update: train_batch must take its returned loss from the same call after the
    schedule (so both are one number), which reads the total the schedule accumulated."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    train_batch = inspect.getsource(PipelineEngine.train_batch)
    run = train_batch.index("self._exec_schedule(sched)")
    assert train_batch.index("self.agg_train_loss = self._aggregate_total_loss()") > run
    assert "return self.agg_train_loss" in train_batch
    aggregate = inspect.getsource(PipelineEngine._aggregate_total_loss)
    assert "self._scale_loss_by_gas(self.total_loss)" in aggregate
    assert "self.total_loss = None" in train_batch  # reset at each step's start only


def test_deepspeed_engine_reports_the_norm_our_clipping_hands_it(single_process_group):
    """ZeRO-0 in fp32: our optimizer clips before its update and hands the norm over;
    the engine's get_global_grad_norm() must be that norm."""
    cfg = load_config(ROOT / MICRO, ["model.num_layers=1", "parallel.zero_stage=0"])
    trainee = trainee_for(cfg, single_process_group, 256)
    seen = []
    original = compat.report_grad_norm

    def recording(optimizer, norm):
        seen.append(norm)
        original(optimizer, norm)

    compat.report_grad_norm = recording
    try:
        rows = torch.randint(0, 256, (cfg.train.micro_batch_size, 17))
        trainee.train_step(iter([(rows[:, :-1], rows[:, 1:])] * 8))
    finally:
        compat.report_grad_norm = original
        engine = trainee.engine
    assert seen and engine.get_global_grad_norm() == pytest.approx(seen[-1]), (
        "DeepSpeed's engine no longer takes its grad norm from optimizer._global_grad_norm"
    )
    engine.destroy()


def test_deepspeed_names_its_checkpoint_files_as_consolidate_reads_them(
    single_process_group, tmp_path
):
    cfg = load_config(ROOT / MICRO, ["model.num_layers=1", "parallel.zero_stage=1"])
    engine = trainee_for(cfg, single_process_group, 256).engine
    engine.save_checkpoint(str(tmp_path), tag="step")
    step = tmp_path / "step"
    assert (step / compat.model_states_name(0)).is_file(), sorted(p.name for p in step.iterdir())
    optim = list(step.glob(compat.optim_states_pattern(0)))
    assert len(optim) == 1 and compat.zero_rank(optim[0].name) == 0, (
        "DeepSpeed's ZeRO file names changed: consolidate.py reads them"
    )
    engine.destroy()


def saved_engine(grid, tmp_path, tag: str, *overrides: str):
    """A one-layer engine of configs/test/micro.yaml with `overrides`, saved after a step
    as the trainer saves (the universal converter's sharding info in its client state)."""
    from belief_lm.checkpoint.universal import universal_info

    cfg = load_config(ROOT / MICRO, ["model.num_layers=1", *overrides])
    trainee = trainee_for(cfg, grid, 256)
    rows = torch.randint(0, 256, (cfg.train.micro_batch_size, 17))
    trainee.train_step(iter([(rows[:, :-1], rows[:, 1:])] * 8))  # the optimizer's state
    engine = trainee.engine
    info = {"universal_checkpoint_info": universal_info(cfg.model)}
    engine.save_checkpoint(str(tmp_path), tag=tag, client_state=info)
    engine.destroy()
    return cfg, tmp_path / tag


def test_deepspeed_pickles_only_the_classes_we_allow(single_process_group, tmp_path):
    """Every file DeepSpeed writes at ZeRO 0-3 needs nothing beyond loading.ALLOWED, and
    each allowed class is one it writes (the list stays minimal)."""
    from belief_lm.checkpoint import loading

    needed = set()
    for stage in (0, 1, 2, 3):
        _, step = saved_engine(single_process_group, tmp_path, f"zero{stage}",
                               f"parallel.zero_stage={stage}")  # fmt: skip
        assert loading.refusals(step) == [], f"ZeRO-{stage}: DeepSpeed pickles another class"
        for file in step.glob("*.pt"):
            needed.update(torch.serialization.get_unsafe_globals_in_checkpoint(file))
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in compat.deepspeed_checkpoint_types()}
    assert needed == allowed, (
        "compat.deepspeed_checkpoint_types lists a class DeepSpeed no longer writes"
    )


def test_deepspeed_reads_checkpoints_with_torch_load_by_its_name():
    """compat.deepspeed_loads_through replaces `torch.load`: DeepSpeed must call it by that
    name (never bind torch.load or torch.serialization.load to another)."""
    import importlib
    from pathlib import Path

    import deepspeed

    for name in compat.DEEPSPEED_DIRECT_LOADS:
        assert "torch.load(" in inspect.getsource(importlib.import_module(name)), name
    for path in Path(deepspeed.__file__).parent.rglob("*.py"):
        source = path.read_text(errors="replace")
        for other in ("from torch import load", "torch.serialization.load(", "= torch.load\n"):
            assert other not in source, f"{path}: {other!r}: compat.deepspeed_loads_through"


def test_deepspeeds_own_loads_go_through_the_route(single_process_group, tmp_path):
    """zero_to_fp32 (consolidate.py's ZeRO-3 weights), the universal converter (its own
    process, whose workers fork) and the ZeRO optimizer's universal loading, given a
    poisoned file through compat.deepspeed_loads_through(loading.load): refused, never run."""
    import functools
    import multiprocessing

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from belief_lm.checkpoint import loading
    from belief_lm.checkpoint.universal import convert

    marker = tmp_path / "marker"
    refused = functools.partial(pytest.raises, loading.RefusedFile, match="builtins.exec")
    _, zero3 = saved_engine(single_process_group, tmp_path / "z3", "step", "parallel.zero_stage=3")
    poison(next(zero3.glob(compat.optim_states_pattern(0))), marker)
    with refused(), compat.deepspeed_loads_through(loading.load):
        get_fp32_state_dict_from_zero_checkpoint(str(zero3.parent), tag=zero3.name)

    assert multiprocessing.get_start_method() == "fork", (
        "ds_to_universal's worker processes no longer fork: they would not inherit "
        "compat.deepspeed_loads_through (universal.convert still forces weights-only loads)"
    )
    cfg, zero1 = saved_engine(single_process_group, tmp_path / "z1", "step")
    (zero1 / "run_state").mkdir()  # (what the converter copies from a trainer's checkpoint)
    universal = convert(zero1, tmp_path / "universal", cfg.model)
    optimizer = next(zero1.glob(compat.optim_states_pattern(0)))
    poison(optimizer, marker)
    with refused():
        convert(zero1, tmp_path / "universal-2", cfg.model)
    param = sorted(p for p in (universal / "zero").iterdir() if p.is_dir())[0]
    poison(param / "exp_avg.pt", marker)
    engine = trainee_for(cfg, single_process_group, 256, load_universal=True).engine
    with refused(), compat.deepspeed_loads_through(loading.load):
        engine.load_checkpoint(str(universal.parent), tag=universal.name)
    engine.destroy()
    assert not marker.exists()
