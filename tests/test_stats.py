"""experiments/stats.py: the report's intervals and p-values against tables, hand-computed
values, and their coverage on simulated comparisons with a known mean."""

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

import stats  # noqa: E402


@pytest.mark.parametrize("df, expected", [(1, 12.7062047), (2, 4.3026527), (3, 3.1824463), (4, 2.7764451),
                                          (5, 2.5705818), (10, 2.2281389), (30, 2.0422725)])
def test_t_quantile_matches_the_table(df, expected):
    assert stats.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-6)


def test_t_quantile_other_levels_and_the_normal_limit():
    assert stats.t_quantile(0.95, 4) == pytest.approx(2.1318468, abs=1e-6)
    assert stats.t_quantile(0.995, 2) == pytest.approx(9.9248432, abs=1e-6)
    assert stats.t_quantile(0.975, 100_000) == pytest.approx(1.959964, abs=1e-4)
    with pytest.raises(ValueError):
        stats.t_quantile(0.4, 3)


def test_t_interval_by_hand_and_three_seeds_are_not_min_max():
    mean, lo, hi = stats.t_interval([0.0, 0.1, 0.3])
    sd = math.sqrt(((0 - 0.4 / 3) ** 2 + (0.1 - 0.4 / 3) ** 2 + (0.3 - 0.4 / 3) ** 2) / 2)
    half = 4.3026527 * sd / math.sqrt(3)
    assert mean == pytest.approx(0.4 / 3) and (lo, hi) == (pytest.approx(mean - half), pytest.approx(mean + half))
    assert lo < 0.0 and hi > 0.3  # wider than [min, max], which is what a 3-value bootstrap returns
    with pytest.raises(ValueError):
        stats.t_interval([0.1])


def test_sign_flip_p_by_enumeration():
    assert stats.sign_flip_p([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)  # only all + and all - reach |mean| 3
    assert stats.sign_flip_p([1, -1, 1, -1, 1]) == 1.0  # every pattern's |sum| is odd, so >= 1
    # [3, 1, -1] (observed sum 3): the 8 patterns' |sums| are 3, 5, 1, 3, 3, 1, 5, 3 -> 6 of 8 reach 3
    assert stats.sign_flip_p([3, 1, -1]) == pytest.approx(6 / 8)
    assert stats.sign_flip_p([0.0, 0.0, 0.0, 0.0, 0.0]) == 1.0


def test_hierarchical_bootstrap_properties():
    a = np.full((5, 40), 0.3)
    assert stats.hierarchical_bootstrap(a, a - 0.1)[1:] == (pytest.approx(0.1), pytest.approx(0.1))  # constant
    rng = np.random.default_rng(1)
    a, b = rng.random((3, 40)), rng.random((3, 40))
    mean, lo, hi = stats.hierarchical_bootstrap(a, b)
    assert mean == pytest.approx((a - b).mean()) and lo < mean < hi
    per_seed = (a - b).mean(axis=1)
    assert (lo, hi) != (pytest.approx(per_seed.min()), pytest.approx(per_seed.max()))
    assert stats.hierarchical_bootstrap(a, b) == stats.hierarchical_bootstrap(a, b)  # seeded
    # pairing: the same problem indices for both arms, so a shared problem effect cancels
    shared = rng.normal(0, 1, 40)
    narrow = stats.hierarchical_bootstrap(a + shared, b + shared)
    assert narrow[2] - narrow[1] == pytest.approx(hi - lo, rel=1e-9)


def test_hierarchical_bootstrap_draws_one_problem_sample_for_all_seeds():
    """Problems are drawn once per resample and shared by every seed: with differences that are a
    problem effect alone (the same in every seed), the interval is the one-sample interval over
    problems (half-width 1.96 sd / sqrt(problems)), not sqrt(seeds) narrower as independent
    problem draws per seed would make it."""
    effect = np.random.default_rng(2).normal(0, 1, 40)
    d = np.tile(effect, (5, 1))
    mean, lo, hi = stats.hierarchical_bootstrap(d, np.zeros_like(d), n=20_000)
    assert (hi - lo) / 2 == pytest.approx(1.96 * effect.std() / math.sqrt(40), rel=0.06)


def test_t_interval_covers_95_percent_of_simulated_comparisons():
    """5 seeds, known mean: the coverage is 0.95 up to simulation error (2,000 runs: sd 0.005)."""
    coverage = stats.simulate_coverage(5, sims=2000, boot=200)
    assert 0.93 <= coverage["t"] <= 0.97


def test_hierarchical_bootstrap_covers_with_many_seeds():
    """The percentile bootstrap is asymptotic: with 20 seeds its coverage nears 0.95."""
    coverage = stats.simulate_coverage(20, sims=600, boot=500)
    assert 0.91 <= coverage["bootstrap"] <= 0.98


def test_t_interval_undercovers_when_one_seed_in_five_learns():
    """Lopsided seed effects (+0.15 with probability 0.2, else 0): with 5 seeds, none learns with
    probability 0.8^5 = 0.33, and then the interval sits around 0.05, well below the truth 0.08,
    so coverage is near 1 - 0.33 = 0.67, far from 0.95 (1,000 runs: sd 0.015); with 20 seeds a
    learner is almost always drawn (0.8^20 = 0.01) and coverage returns towards 0.95."""
    effects = {"seed_sd": 0.005, "problem_sd": 0.02, "learn_p": 0.2, "learn_effect": 0.15}
    five = stats.simulate_coverage(5, sims=1000, boot=0, **effects)["t"]
    twenty = stats.simulate_coverage(20, sims=1000, boot=0, **effects)["t"]
    assert 0.6 <= five <= 0.8 and 0.9 <= twenty <= 0.97
