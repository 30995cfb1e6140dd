"""experiments/power.py: the confirmatory study's power simulation on data with a known answer."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import power  # noqa: E402

ARMS = ("grpo_k", "p2o_human", "p2o_human_no_crm", "rs_distill")


def test_the_committed_runs_give_five_seeds_per_arm_and_outcome():
    data = power.committed()
    assert set(data) == {"probe response mean log p", "probe fact-token log p", "held-out avg@16"}
    assert all(sorted(values) == sorted(ARMS) and all(len(v) == 5 for v in values.values())
               for values in data.values())


def test_power_is_one_for_a_huge_effect_and_small_without_one():
    rng = np.random.default_rng(0)
    base = {arm: list(rng.normal(0.0, 1.0, 5)) for arm in ARMS}
    huge = {"a": {**base, "p2o_human_no_crm": [x + 50 for x in base["p2o_human_no_crm"]],
                  "rs_distill": [x + 50 for x in base["rs_distill"]]}}
    got = power.power(huge, 6, 8, sims=200)["a"]
    assert got[0] == 1.0 and got[2] == 1.0 and got[1] == 1.0  # no CRM is 50 above the masked arm too
    same = {"a": {arm: list(rng.normal(0.0, 1.0, 5)) for arm in ARMS}}
    assert max(power.power(same, 6, 8, sims=400)["a"]) < 0.1  # one-sided confirmations under no effect
    # a family gate: with no effect in the first outcome, the second (huge) is never reached
    gated = power.power({"first": same["a"], "second": huge["a"]}, 6, 8, sims=200)
    assert max(gated["second"]) < 0.1




def test_pooled_sd_and_its_upper_limit_by_hand():
    # a: mean 2, squares 2; b: mean 4, squares 8; c adds nothing (one value): sqrt(10 / 3) on 3 df
    assert power.pooled_sd({"a": [1, 3], "b": [2, 4, 6], "c": [5]}) == (np.sqrt(10 / 3), 3)
    # chi-square(4)'s 20% quantile is 1.6488: the 80% upper limit is sd x sqrt(4 / 1.6488) = 1.5576 sd
    assert abs(power.sd_upper(1.0, 4) - 1.5576) < 2e-3


def v4_means(shift):
    """Every contrast's mean paired difference, per outcome."""
    return {name: {c: shift[name] for c in power.STRATEGY_CONTRASTS} for name in shift}


def test_v4_power_follows_the_registered_chains():
    sds = {n: {c: 0.01 for c in power.STRATEGY_CONTRASTS} for n in ("held-out avg@16", "held-out pass@16",
                                                                    "gold answer mean log-prob")}
    big = {"held-out avg@16": 0.2, "held-out pass@16": 0.5, "gold answer mean log-prob": 0.5}
    got = power.strategy_power(v4_means(big), sds, 6, sims=100)
    assert all(list(p) == [1.0] * 4 for p in got.values())  # every contrast far above its noise
    wide = {n: {c: 0.1 for c in power.STRATEGY_CONTRASTS} for n in sds}
    none = power.strategy_power(v4_means({n: 0.0 for n in big}), wide, 6, sims=400)
    assert max(none["held-out avg@16"]) < 0.05  # one-sided confirmations at 0.05 / 4 under no effect
    # no effect on the first outcome: the chains stop there, whatever the later ones would show
    gated = power.strategy_power(v4_means({**big, "held-out avg@16": 0.0}), wide, 6, sims=200)
    assert max(gated["gold answer mean log-prob"]) < 0.05


def test_v4_paired_sds_pool_the_coupled_contrasts_by_hand():
    data = {"x": {"grpo_k": [0.0, 0.1], "p2o_human": [0.0, 0.2], "p2o_human_no_crm": [0.1, 0.2],
                  "rs_distill": [0.3, 0.1]}}
    # coupled differences: (0, 0.1), (0.1, 0.1), (0.1, 0): squares 0.005 + 0 + 0.005 over 3 df -> sqrt(1/300)
    # rejection sampling: within-arm sds of rs (0.3, 0.1) and grpo (0, 0.1): squares 0.02 + 0.005 over 2 df
    sds = power.paired_sds(data)["x"]
    assert sds[("p2o_human", "grpo_k")] == pytest.approx(np.sqrt(1 / 300))
    assert sds[("rs_distill", "grpo_k")] == pytest.approx(np.sqrt(2) * np.sqrt(0.025 / 2))
