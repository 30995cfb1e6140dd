"""experiments/power.py: the confirmatory study's power simulation on data with a known answer."""

import os
import sys

import numpy as np

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


def test_pooled_sd_by_hand():
    # a: mean 2, squares 2; b: mean 4, squares 8; c adds nothing (one value): sqrt(10 / 3)
    assert power.pooled_sd({"a": [1, 3], "b": [2, 4, 6], "c": [5]}) == np.sqrt(10 / 3)


def test_v4_power_with_two_pilot_seeds_an_arm_uses_the_pooled_spread():
    two = {arm: [0.0, 0.01] for arm in ARMS}  # every arm alike but its spread: no effect
    lifted = {**two, "p2o_human": [0.5, 0.51], "p2o_human_no_crm": [1.0, 1.01], "rs_distill": [0.5, 0.51]}
    got = power.power({"a": lifted}, 6, 6, sims=200, contrasts=power.STRATEGY_CONTRASTS, pooled=True)["a"]
    assert list(got) == [1.0, 1.0, 1.0, 1.0]  # each contrast 0.5 or more, noise sd 0.5 x 0.0071
    assert max(power.power({"a": two}, 6, 6, sims=400, contrasts=power.STRATEGY_CONTRASTS, pooled=True)["a"]) < 0.1
    flat = {arm: [0.0, 0.0] for arm in ARMS}  # no spread anywhere: no test can confirm
    assert max(power.power({"a": flat}, 6, 6, sims=50, contrasts=power.STRATEGY_CONTRASTS, pooled=True)["a"]) == 0
