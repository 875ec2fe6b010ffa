"""Distributed training equals single-process training, from the same initial weights
(run.seed) on the same global batches: losses, every gradient at every step, and the final
weights, within fp32 tolerance."""

import pytest

from belief_lm.model.attention_layer import VARIANTS
from tests.parallel.conftest import assert_equivalent, load_run, run_driver


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_every_variant(reference, tp2, variant):
    assert_equivalent(load_run(tp2, variant, 1), load_run(reference, variant, 1))


def test_belief_star_tp2_pp2(reference, tmp_path):
    out = run_driver(tmp_path, 2, 2, 1, 1, ["belief_star"])
    assert_equivalent(load_run(out, "belief_star", 1), load_run(reference, "belief_star", 1))


def test_belief_star_tp2_pp2_dp2(reference, tmp_path):
    out = run_driver(tmp_path, 2, 2, 2, 1, ["belief_star"])
    assert_equivalent(load_run(out, "belief_star", 1), load_run(reference, "belief_star", 1))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_stages_tp2_dp2(reference, tmp_path, zero):
    out = run_driver(tmp_path, 2, 1, 2, zero, ["belief_star"])
    assert_equivalent(load_run(out, "belief_star", zero), load_run(reference, "belief_star", 1))
