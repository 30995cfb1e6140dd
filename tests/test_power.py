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




def test_pooled_sd_and_its_upper_limit_by_hand():
    # a: mean 2, squares 2; b: mean 4, squares 8; c adds nothing (one value): sqrt(10 / 3) on 3 df
    assert power.pooled_sd({"a": [1, 3], "b": [2, 4, 6], "c": [5]}) == (np.sqrt(10 / 3), 3)
    # chi-square(4)'s 20% quantile is 1.6488: the 80% upper limit is sd x sqrt(4 / 1.6488) = 1.5576 sd
    assert abs(power.sd_upper(1.0, 4) - 1.5576) < 2e-3


def v4_means(shift):
    """Every arm at 0 on every outcome (the gold log-prob at -1), `shift` (per outcome) added to the non-control arms."""
    base = {"held-out avg@16": 0.0, "held-out pass@16": 0.0, "gold answer mean log-prob": -1.0}
    return {name: {arm: b + (0.0 if arm == "grpo_k" else shift[name]) for arm in ARMS} for name, b in base.items()}


def test_v4_power_follows_the_registered_chains():
    sds = {"held-out avg@16": 0.01, "held-out pass@16": 0.05, "gold answer mean log-prob": 0.05}
    big = {"held-out avg@16": 0.2, "held-out pass@16": 0.5, "gold answer mean log-prob": 0.5}
    means = v4_means(big)
    means = {name: {**m, "p2o_human_no_crm": m["p2o_human"] + big[name]} for name, m in means.items()}
    got = power.strategy_power(means, sds, 6, 6, sims=100)
    assert all(list(p) == [1.0] * 4 for p in got.values())  # every contrast far above its noise, C4 too
    none = power.strategy_power(v4_means({n: 0.0 for n in big}), {n: 0.1 for n in sds}, 6, 6, sims=400)
    assert max(none["held-out avg@16"]) < 0.05  # one-sided confirmations at 0.05 / 4 under no effect
    # no effect on the first outcome: the chains stop there, whatever the later ones would show
    first_flat = v4_means({**big, "held-out avg@16": 0.0})
    gated = power.strategy_power(first_flat, {**sds, "held-out avg@16": 0.1}, 6, 6, sims=200)
    assert max(gated["gold answer mean log-prob"]) < 0.05
