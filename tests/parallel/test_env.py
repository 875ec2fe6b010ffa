import os
import subprocess
import sys

import pytest
import torch

from belief_lm.parallel.env import LaunchEnvError, detect, expand_nodelist
from belief_lm.runtime import backend_for, device_for
from tests.jobs import ROOT

TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
# What srun gives task 5 of 8 (2 nodes x 4 tasks) in job 4242: the step's own variables
# differ from the allocation's (3 nodes, 12 tasks) on purpose.
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "5",
    "SLURM_STEP_ID": "0",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "12",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_JOB_NODELIST": "gpu[01-03]",
    "SLURM_STEP_NODELIST": "gpu[02-03]",
}


def test_torchrun_variables():
    env = detect(TORCHRUN)
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (3, 1, 8, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("10.0.0.1", 29500, "torchrun")


def test_single_process_gets_a_free_port():
    env = detect({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")
    assert env.master_addr == "127.0.0.1" and 0 < env.master_port < 65536


def test_incomplete_torchrun_variables():
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR, MASTER_PORT"):
        detect({"RANK": "0", "WORLD_SIZE": "2"})


def test_slurm_task_uses_its_step():
    env = detect(SLURM)
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (5, 1, 8, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("gpu02", 24242, "slurm")


def test_slurm_without_step_task_count_and_node_list_uses_the_job():
    env = detect(
        {k: v for k, v in SLURM.items() if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST")}
    )
    assert (env.world_size, env.master_addr) == (12, "gpu01")


def test_slurm_batch_script_is_a_single_process():
    batch = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP")}
    assert detect(batch).launcher == "single"


def test_torchrun_inside_slurm_wins():
    assert detect({**SLURM, **TORCHRUN}).launcher == "torchrun"


def test_slurm_master_overrides():
    env = detect({**SLURM, "MASTER_ADDR": "gpu02-ib", "MASTER_PORT": "31000"})
    assert (env.master_addr, env.master_port) == ("gpu02-ib", 31000)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("node[1-2]", ["node1", "node2"]),
        ("a1,b[3-4]", ["a1", "b3", "b4"]),
        ("node[9-11]", ["node9", "node10", "node11"]),
        ("solo", ["solo"]),
        ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
        ("x-[008-010].cluster,y", ["x-008.cluster", "x-009.cluster", "x-010.cluster", "y"]),
    ],
)
def test_nodelist_expansion(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "problem"),
    [
        ("gpu[01-04", "unbalanced brackets"),
        ("gpu01-04]", "unbalanced brackets"),
        ("gpu[[1-2]]", "unbalanced brackets"),
        ("gpu[4-1]", "bad range '4-1'"),
        ("gpu[a-b]", "bad range 'a-b'"),
        ("gpu[]", "bad range ''"),
        ("a,,b", "empty host name"),
        ("", "empty host name"),
    ],
)
def test_malformed_nodelist_is_named(nodelist, problem):
    with pytest.raises(LaunchEnvError, match=r"SLURM_STEP_NODELIST .*" + problem):
        detect({**SLURM, "SLURM_STEP_NODELIST": nodelist})


def test_bad_integer_names_the_variable():
    with pytest.raises(LaunchEnvError, match="SLURM_PROCID='x' is not an integer"):
        detect({**SLURM, "SLURM_PROCID": "x"})
    with pytest.raises(LaunchEnvError, match="rank 8 is outside world size 8"):
        detect({**SLURM, "SLURM_PROCID": "8"})


def test_open_mpi():
    env = detect(
        {
            "OMPI_COMM_WORLD_RANK": "6",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "MASTER_ADDR": "head",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (6, 2, 8, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("head", 29500, "mpi")


def test_pmi():
    env = detect(
        {
            "PMI_RANK": "1",
            "PMI_SIZE": "2",
            "MPI_LOCALRANKID": "1",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1234",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.master_port) == (1, 1, 2, 1234)


def test_mpi_needs_master_addr():
    with pytest.raises(LaunchEnvError, match="MPI launch without MASTER_ADDR"):
        detect({"PMI_RANK": "0", "PMI_SIZE": "2"})


def test_device_and_backend_on_cpu():
    device = device_for(local_rank=3, choice="cpu")
    assert device == torch.device("cpu") and backend_for(device) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_requested_without_gpu():
    with pytest.raises(RuntimeError, match=r"run\.device=cuda"):
        device_for(0, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_index_wraps_over_visible_devices():
    visible = torch.cuda.device_count()
    assert device_for(visible + 1, "auto") == torch.device("cuda", 1 % visible)


def test_child_processes_of_a_test_join_no_world(single_process_group):
    """The session's process group is up (init_distributed exported its world for the
    rendezvous), yet a test and the processes it starts see none of it (tests/conftest.py):
    a child started with this environment as it is is a single process of its own."""
    assert torch.distributed.is_initialized()
    world = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    assert not {name: os.environ[name] for name in world if name in os.environ}
    code = "from belief_lm.parallel.env import detect; print(detect().launcher)"
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert child.stdout.strip() == "single", child.stderr
