"""What belief_lm/compat.py assumes of torch's, megatron-core's and DeepSpeed's private parts,
checked against the installed versions: an upgrade that breaks one fails here, by name."""

import inspect

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from belief_lm import compat
from belief_lm.config import load_config
from tests.jobs import MICRO, ROOT
from tests.models import trainee_for


def test_torch_scales_a_list_of_tensors_in_place():
    tensors = [torch.ones(3), torch.full((2, 2), 3.0, dtype=torch.float64)]
    kept = [t.data_ptr() for t in tensors]
    compat.scale_in_place(tensors, 0.5)
    assert [t.data_ptr() for t in tensors] == kept, "torch._foreach_mul_ no longer works in place"
    assert tensors[0].tolist() == [0.5] * 3 and tensors[1].tolist() == [[1.5] * 2] * 2


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


def test_megatron_linears_put_empty_extra_state_into_state_dicts(single_process_group):
    from belief_lm.model.gpt import BeliefLM
    from tests.models import tiny_model

    model = BeliefLM(tiny_model("softmax"), 64)
    keys = [k for k, v in model.state_dict().items() if k.endswith("._extra_state")]
    assert keys, "megatron no longer writes _extra_state: drop compat.drop_empty_extra_state"
    for module in model.modules():
        module.register_state_dict_post_hook(compat.drop_empty_extra_state)
    assert not any(k.endswith("._extra_state") for k in model.state_dict())


def test_deepspeed_lists_the_shm_op_it_may_build():
    import deepspeed.ops

    assert "deepspeed_shm_comm" in deepspeed.ops.__compatible_ops__, (
        "deepspeed.ops.__compatible_ops__ has no deepspeed_shm_comm: compat.disable_shm_comm"
    )


def test_deepspeed_engine_reports_the_norm_our_clipping_hands_it(single_process_group):
    """ZeRO-0 in fp32: we clip in the optimizer's pre-step hook and hand the norm over;
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
