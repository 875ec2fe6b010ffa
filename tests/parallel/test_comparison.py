"""The equivalence check itself rejects the deviations it exists to catch."""

import copy

import pytest
import torch

from tests.parallel.conftest import assert_equivalent


def record(seed=0):
    gen = torch.Generator().manual_seed(seed)
    grads = [
        {"w": torch.randn(8, 8, generator=gen), "b": torch.randn(8, generator=gen)}
        for _ in range(3)
    ]
    params = {"w": torch.randn(8, 8, generator=gen), "b": torch.randn(8, generator=gen)}
    return {
        "losses": [5.0, 4.9, 4.8],
        "grad_norms": [1.5, 1.2, 1.1],
        "grads": grads,
        "params": params,
    }


def test_identical_records_pass():
    assert_equivalent(copy.deepcopy(record()), record())


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda r: r["grads"][0]["w"].mul_(1.001),  # a 0.1% gradient error at step 0
        lambda r: r["grads"][2]["b"].add_(0.01 * r["grads"][2]["b"].norm()),
        lambda r: r["params"]["w"][0].add_(3e-3),  # one row off by an lr-sized update
        lambda r: r["losses"].__setitem__(1, 4.9001),
        lambda r: r["grad_norms"].__setitem__(0, 1.5 * 1.0001),
        lambda r: r["grads"][1].pop("b"),
    ],
)
def test_deviations_fail(corrupt):
    run = copy.deepcopy(record())
    corrupt(run)
    with pytest.raises(AssertionError):
        assert_equivalent(run, record())
