"""The statistics of experiments/compare.py's report: paired differences of an arm against a
baseline over seeds, and how often their intervals cover the truth.

    python experiments/stats.py        # simulated coverage of each interval -> results/compare/coverage.md

Three tools, each for what it can say:
- t_interval: the mean of the per-seed paired differences with a Student-t interval (n - 1
  degrees of freedom). Its claim is about the problems scored (they are the same for every
  seed); it is exact when per-seed differences are normal, and needs no more than 2 seeds.
- hierarchical_bootstrap: resample seeds, then problems, with the same problem indices for both
  arms and every drawn seed (each seed scored the same problems: a crossed design, so the
  pairing by problem is kept); percentile interval. It treats the problems as a sample too, so
  it is wider when problems disagree. A percentile
  bootstrap over few seeds under-covers: with 3 seeds the seed level has only 10 distinct
  resamples. simulate_coverage measures it; the report states the measured coverage.
- sign_flip_p: exact two-sided permutation p-value of "the mean difference is 0" by flipping
  the signs of the per-seed differences (2^n patterns; the smallest possible p is 2 / 2^n, so
  5 seeds cannot go below 0.0625).

Why not a bootstrap over the seed differences alone (what the report used before): with 3
values, every resample is one of 10 multisets, and the 2.5% and 97.5% points are the minimum
and maximum, so "95%" is [min, max], which covers the mean ~75% of the time.
"""

import argparse
import itertools
import math
import os
import sys

import numpy as np


def t_cdf_two_sided(t, df):
    """P(|T| <= t) for Student's t with integer df (the closed-form finite series; exact)."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd
        term, total = math.cos(theta), 0.0  # cos, (2/3) cos^3, (2*4)/(3*5) cos^5, ...
        for j in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c2 * (2 * j) / (2 * j + 1)
        return 2 / math.pi * (theta + s * total)
    term, total = 1.0, 0.0  # 1, (1/2) cos^2, (1*3)/(2*4) cos^4, ...
    for j in range(1, df // 2 + 1):
        total += term
        term *= c2 * (2 * j - 1) / (2 * j)
    return s * total


def t_quantile(q, df):
    """The q-quantile (q > 0.5) of Student's t with integer df >= 1, by bisection on the CDF."""
    if not 0.5 < q < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < q < 1 and df >= 1, got q={q}, df={df}")
    target, lo, hi = 2 * q - 1, 0.0, 1.0
    while t_cdf_two_sided(hi, df) < target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf_two_sided(mid, df) < target else (lo, mid)
    return (lo + hi) / 2


def t_interval(diffs, level=0.95):
    """(mean, low, high): Student-t interval of the mean of the per-seed differences (>= 2)."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size < 2:
        raise ValueError("a t-interval needs at least 2 seeds")
    mean, se = d.mean(), d.std(ddof=1) / math.sqrt(d.size)
    half = t_quantile(0.5 + level / 2, d.size - 1) * se
    return mean, mean - half, mean + half


def hierarchical_bootstrap(a, b, n=10_000, level=0.95, seed=0):
    """(mean, low, high) of mean(a - b) for per-problem scores a, b of shape [seeds, problems]
    (row s of both arms from seed s, the same problems in every row): resample seeds, then
    problems, the same problem indices for both arms and all drawn seeds; percentile interval."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.ndim != 2:
        raise ValueError(f"per-problem scores are [seeds, problems], got shape {d.shape}")
    rng = np.random.default_rng(seed)
    s, p = d.shape
    seeds = rng.integers(0, s, size=(n, s))  # [n, s]
    problems = rng.integers(0, p, size=(n, p))  # [n, p]
    means = d[seeds[:, :, None], problems[:, None, :]].mean(axis=(1, 2))
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return d.mean(), float(lo), float(hi)


def sign_flip_p(diffs):
    """Exact two-sided sign-flip permutation p-value of mean(diffs) = 0."""
    d = np.asarray(diffs, dtype=np.float64)
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=d.size)))  # [2^n, n]
    observed = abs(d.mean())
    return float(np.mean(np.abs(signs @ d / d.size) >= observed - 1e-12))


# ----------------------------------------------------------------------------- coverage


def simulate(rng, n_seeds, n_problems, mean=0.05, seed_sd=0.03, problem_sd=0.15, noise_sd=0.1, learn_p=0.0,
             learn_effect=0.0):
    """One simulated comparison: per-problem differences D[s, i] = mean + u_s + L_s + v_i + e_si
    (seed, problem and residual effects, normal; L_s = learn_effect for a seed that "learns", with
    probability learn_p, else 0) -> (a, b, the t-interval's truth, the bootstrap's truth). b is 0;
    the t-interval is about these problems (truth mean + learn_p learn_effect + mean(v)), the
    bootstrap about the population they are drawn from (without mean(v))."""
    v = rng.normal(0, problem_sd, n_problems)
    learnt = learn_effect * (rng.random((n_seeds, 1)) < learn_p) if learn_p else 0.0  # else: no draw, same stream
    d = mean + rng.normal(0, seed_sd, (n_seeds, 1)) + learnt + v + rng.normal(0, noise_sd, (n_seeds, n_problems))
    population = mean + learn_p * learn_effect
    return d, np.zeros_like(d), population + v.mean(), population


def simulate_coverage(n_seeds, n_problems=40, sims=1000, boot=1000, seed=0, **effects):
    """Fraction of simulated comparisons whose 95% interval holds the truth: {"t": ..., "bootstrap": ...}
    (boot=0: the t-interval only)."""
    rng = np.random.default_rng(seed)
    hits = {"t": 0, "bootstrap": 0}
    for i in range(sims):
        a, b, t_truth, boot_truth = simulate(rng, n_seeds, n_problems, **effects)
        _, lo, hi = t_interval((a - b).mean(axis=1))
        hits["t"] += lo <= t_truth <= hi
        if boot:
            _, lo, hi = hierarchical_bootstrap(a, b, n=boot, seed=i)
            hits["bootstrap"] += lo <= boot_truth <= hi
    return {k: v / sims for k, v in hits.items() if boot or k == "t"}


SCENARIOS = {  # name -> simulate()'s effects
    # "normal:" or "lopsided:" (a kind report.coverage_range reads)
    "normal: problems dominate (seed sd 0.03, problem sd 0.15)": {"seed_sd": 0.03, "problem_sd": 0.15},
    "normal: seeds dominate (seed sd 0.06, problem sd 0.02)": {"seed_sd": 0.06, "problem_sd": 0.02},
    # no CRM on made-up units: one seed in five learnt the rule (+0.15), the others stayed at the floor
    "lopsided: one seed in five learns (+0.15 with probability 0.2; seed sd 0.005, problem sd 0.02)":
        {"seed_sd": 0.005, "problem_sd": 0.02, "learn_p": 0.2, "learn_effect": 0.15},
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sims", type=int, default=2000)
    ap.add_argument("--out", default="results/compare/coverage.md")
    args = ap.parse_args(argv)
    lines = ["# Coverage of the report's 95% intervals (simulated)", "",
             f"`python experiments/stats.py --sims={args.sims}`: per-problem differences D[s, i] = 0.05 + seed "
             "effect + problem effect + noise (sd 0.1), 40 problems, normal effects (and, in the last scenario, "
             "a seed effect that is +0.15 or 0). The t-interval's truth is "
             "the mean over the problems scored, the bootstrap's the population mean. Binomial standard error "
             f"of each figure about {math.sqrt(0.95 * 0.05 / args.sims):.3f}.", ""]
    for name, effects in SCENARIOS.items():
        lines += [f"**{name}**", "", "| seeds | t-interval | hierarchical bootstrap |", "|---|---|---|"]
        for n_seeds in (3, 5, 10, 20):
            c = simulate_coverage(n_seeds, sims=args.sims, **effects)
            lines.append(f"| {n_seeds} | {c['t']:.3f} | {c['bootstrap']:.3f} |")
            print(name, lines[-1], flush=True)
        lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
