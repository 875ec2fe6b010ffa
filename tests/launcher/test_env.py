import pytest

from launcher.env import detect


def test_torchrun_variables():
    env = detect(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (env.rank, env.local_rank, env.world_size) == (3, 1, 8)
    assert (env.master_addr, env.master_port, env.launcher) == ("10.0.0.1", 29500, "torchrun")


def test_single_process_gets_a_free_port():
    env = detect({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")
    assert env.master_addr == "127.0.0.1" and 0 < env.master_port < 65536


def test_incomplete_torchrun_variables():
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT"):
        detect({"RANK": "0", "WORLD_SIZE": "2"})
