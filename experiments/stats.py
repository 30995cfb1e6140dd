"""The statistics of experiments/compare.py's report: paired differences of an arm against a
baseline over seeds, and how often their intervals cover the truth.

    python experiments/stats.py        # simulated coverage of each interval -> results/compare/coverage.md
    python experiments/stats.py --power_only   # what n seeds can detect -> results/compare/power.md

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

And for the confirmatory study (docs/PREREGISTRATION.md), where arms run on different seeds:
- welch: the unpaired difference of two arms' per-seed values, Welch's interval and p, its
  Welch-Satterthwaite degrees of freedom rounded down (conservative: a wider interval).
- holm: Holm's step-down adjustment of a family of p-values (family-wise error at most alpha).
- gatekeep: families of hypotheses tested in a fixed order, Holm within each, a family only
  when all before it were rejected (serial gatekeeping; family-wise error at most alpha).
- barnard: Barnard's unconditional exact test of two binomial proportions (how many seeds of
  each arm learnt), two-sided, pooled score statistic, the nuisance parameter maximised.

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


def t_p_two_sided(t, df):
    """P(|T| >= |t|) for Student's t with integer df >= 1."""
    return max(0.0, 1.0 - t_cdf_two_sided(t, df))


def no_spread(mean, scale):
    """A difference without spread (welch, paired_test): no test, df None, p 1 when it is 0 (up to scale)
    and 0 otherwise, the interval the point. deciding_p reads such a p as 1."""
    same = abs(mean) <= scale
    return {"mean": 0.0 if same else mean, "low": mean, "high": mean, "p": float(same), "df": None}


def deciding_p(test):
    """The p a multiplicity rule should use for a test (welch, paired_test): 1 where there was no test
    (df None), so it is counted and can never be confirmed or open a gate."""
    return 1.0 if test["df"] is None else test["p"]


def welch(a, b, level=0.95):
    """Unpaired mean(a) - mean(b) of two arms' per-seed values (>= 2 each): {"mean", "low", "high",
    "p", "df"}; df = Welch-Satterthwaite, rounded down (never below 1). Two arms that do not vary
    at all (up to rounding): df None, p 1 when their means agree, 0 otherwise, the interval the point."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.size < 2 or b.size < 2:
        raise ValueError(f"Welch's test needs at least 2 values per arm, got {a.size} and {b.size}")
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    mean, se = a.mean() - b.mean(), math.sqrt(va + vb)
    scale = 1e-12 * max(1.0, abs(a.mean()), abs(b.mean()))
    if np.ptp(a) <= scale and np.ptp(b) <= scale:  # neither arm varies (up to rounding): no test
        return no_spread(mean, scale)
    # rounded down, with room for float noise: a whole-number df (equal variances and sizes) is not one lower
    df = max(1, math.floor((va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1)) + 1e-9))
    half = t_quantile(0.5 + level / 2, df) * se
    return {"mean": mean, "low": mean - half, "high": mean + half, "p": t_p_two_sided(mean / se, df), "df": df}


def paired_test(diffs, level=0.95):
    """The paired t-test of per-seed differences (>= 2): {"mean", "low", "high", "p", "df"} as welch gives
    them, df = n - 1. Differences that do not vary at all (up to rounding): df None, p 1 when they are 0 and
    0 otherwise, the interval the point."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size < 2:
        raise ValueError(f"a paired test needs at least 2 seeds, got {d.size}")
    mean = d.mean()
    scale = 1e-12 * max(1.0, float(np.abs(d).max()))
    if np.ptp(d) <= scale:
        return no_spread(mean, scale)
    se, df = d.std(ddof=1) / math.sqrt(d.size), d.size - 1
    half = t_quantile(0.5 + level / 2, df) * se
    return {"mean": mean, "low": mean - half, "high": mean + half, "p": t_p_two_sided(mean / se, df), "df": df}


def holm(pvalues):
    """Holm-adjusted p-values in the given order: the i-th smallest p times (m - i + 1), made
    non-decreasing in that order, capped at 1. Reject hypothesis j at family-wise level alpha
    when its adjusted p <= alpha. None (a test not run) is left None and not counted in m."""
    given = [(p, j) for j, p in enumerate(pvalues) if p is not None]
    out, running = [None] * len(pvalues), 0.0
    for rank, (p, j) in enumerate(sorted(given)):
        running = max(running, min(1.0, (len(given) - rank) * p))
        out[j] = running
    return out


def gatekeep(families, alpha=0.05, signs=None):
    """Serial gatekeeping: families of p-values tested in order, each with Holm at alpha, a family
    only when every hypothesis of the families before it was rejected (family-wise error over
    all of them at most alpha). signs: per family, per hypothesis, whether the estimate has the
    predicted sign; then a rejection opens the next family only with that sign (stricter, so
    still at most alpha). -> one list per family: the Holm-adjusted p-values of a family tested,
    None for each hypothesis of a family not reached (and for a None p)."""
    out, gate_open = [], True
    for i, ps in enumerate(families):
        adjusted = holm(ps) if gate_open else [None] * len(ps)
        out.append(adjusted)
        ok = signs[i] if signs is not None else [True] * len(ps)
        gate_open = gate_open and all(a is not None and a <= alpha and good for a, good in zip(adjusted, ok))
    return out


def fixed_sequences(chains, alpha=0.05, signs=None):
    """One fixed-sequence test per chain, Bonferroni over the chains: chains[c] holds hypothesis c's
    p-values in their tested order (one per outcome); each is tested at alpha / (number of chains),
    the next of a chain only when every one before it in that chain was rejected with its predicted
    sign (signs[c][i]). Each chain then errs with probability at most alpha / m, all of them at most
    alpha. -> the same shape: p x m capped at 1 where tested, None where a chain stopped (or the p
    is None, which stops its chain)."""
    m = len(chains)
    out = []
    for c, ps in enumerate(chains):
        adjusted, going = [], True
        for i, p in enumerate(ps):
            a = min(1.0, m * p) if going and p is not None else None
            adjusted.append(a)
            good = signs[c][i] if signs is not None else True
            going = going and a is not None and a <= alpha and good
        out.append(adjusted)
    return out


def binomial_tail(c, n, p):
    """P(X >= c) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, x) * p ** x * (1 - p) ** (n - x) for x in range(max(c, 0), n + 1))


def _log_binom(n):
    """log C(n, x) for x = 0..n."""
    return np.array([math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1) for x in range(n + 1)])


def barnard(x1, n1, x2, n2, grid=1000):
    """Barnard's exact unconditional test of p1 = p2 from x1 of n1 and x2 of n2 successes
    -> (statistic, two-sided p). The statistic is the pooled score z = (x1/n1 - x2/n2) /
    sqrt(p(1 - p)(1/n1 + 1/n2)), p = (x1 + x2)/(n1 + n2) (0 for a table with p 0 or 1); the p-value
    is max over the common success probability pi of P_pi(|Z| >= |z_observed|), over the tables of
    two independent binomials. The maximum is found on a grid of pi, then refined by a golden
    section search around the grid's best point."""
    if not (0 <= x1 <= n1 and 0 <= x2 <= n2 and n1 > 0 and n2 > 0):
        raise ValueError(f"Barnard's test needs 0 <= x <= n, n > 0: got {x1}/{n1} and {x2}/{n2}")
    a, b = np.arange(n1 + 1)[:, None], np.arange(n2 + 1)[None, :]
    pooled = (a + b) / (n1 + n2)
    var = pooled * (1 - pooled) * (1 / n1 + 1 / n2)
    z = np.divide(a / n1 - b / n2, np.sqrt(var), out=np.zeros(var.shape), where=var > 0)
    observed = z[x1, x2]
    extreme = np.abs(z) >= abs(observed) - 1e-12  # [n1 + 1, n2 + 1]
    log_c = _log_binom(n1)[:, None] + _log_binom(n2)[None, :]
    successes = a + b

    def p_at(pi):
        if pi <= 0.0 or pi >= 1.0:
            return float(extreme[0, 0]) if pi <= 0.0 else float(extreme[n1, n2])
        logp = log_c + successes * math.log(pi) + (n1 + n2 - successes) * math.log1p(-pi)
        return float(np.exp(logp[extreme]).sum())

    pis = np.linspace(0.0, 1.0, grid + 1)
    values = [p_at(pi) for pi in pis]
    best = int(np.argmax(values))
    lo, hi = pis[max(best - 1, 0)], pis[min(best + 1, grid)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):  # golden section on [lo, hi] (p(pi) is smooth there)
        c, d = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if p_at(c) >= p_at(d):
            hi = d
        else:
            lo = c
    return float(observed), min(1.0, max(values[best], p_at((lo + hi) / 2)))


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


def simulate_power(n_seeds, n_problems=40, sims=4000, seed=0, **effects):
    """{"power": fraction of simulated comparisons whose 95% t-interval excludes 0 (a two-sided
    paired t-test at 0.05 rejecting), "coverage": ... whose interval holds the truth}."""
    rng = np.random.default_rng(seed)
    rejects = covers = 0
    for _ in range(sims):
        a, b, truth, _ = simulate(rng, n_seeds, n_problems, **effects)
        _, lo, hi = t_interval((a - b).mean(axis=1))
        rejects += lo > 0 or hi < 0
        covers += lo <= truth <= hi
    return {"power": rejects / sims, "coverage": covers / sims}


def power_table(sims, seeds=(5, 6, 10, 20, 40)):
    """Markdown: the paired t-test's power and coverage at each number of seeds, per SCENARIO."""
    lines = ["# What n seeds can detect (simulated)", "",
             f"`python experiments/stats.py --power_only --sims={sims}`: the scenarios of coverage.md (a mean "
             "difference of 0.05 for every seed, plus 0.15 for the one seed in five that learns in the lopsided "
             "one), and the lopsided process at the floor, as on made-up units (the seeds that do not learn differ "
             "by 0, so the mean difference is 0.2 x 0.15 = 0.03); 40 problems; power: the share "
             "of simulated comparisons whose paired 95% t-interval over seeds excludes 0 (a two-sided t-test at "
             "0.05); coverage: the share whose interval holds the true mean. Six seeds are the fewest at which an "
             "exact sign-flip test can reach p < 0.05 at all (2/64, all six differences of one sign); that is what "
             "is attainable, not what is likely.", ""]
    floor = {"lopsided at the floor: one seed in five learns (+0.15), the others differ by 0 (mean 0.03)":
             {**SCENARIOS[next(k for k in SCENARIOS if k.startswith("lopsided"))], "mean": 0.0}}
    for name, effects in (SCENARIOS | floor).items():
        lines += [f"**{name}**", "", "| seeds | power | coverage |", "|---|---|---|"]
        for n in seeds:
            r = simulate_power(n, sims=sims, **effects)
            lines.append(f"| {n} | {r['power']:.3f} | {r['coverage']:.3f} |")
            print(name, lines[-1], flush=True)
        lines.append("")
    return lines


SCENARIOS = {  # name -> simulate()'s effects
    # "normal:" or "lopsided:" (a kind report.coverage_range reads)
    "normal: problems dominate (seed sd 0.03, problem sd 0.15)": {"seed_sd": 0.03, "problem_sd": 0.15},
    "normal: seeds dominate (seed sd 0.06, problem sd 0.02)": {"seed_sd": 0.06, "problem_sd": 0.02},
    # no CRM on made-up units: one seed in five learnt the rule (+0.15), the others stayed at the floor
    "lopsided: one seed in five learns (+0.15 with probability 0.2; seed sd 0.005, problem sd 0.02)":
        {"seed_sd": 0.005, "problem_sd": 0.02, "learn_p": 0.2, "learn_effect": 0.15},
}


def write_lines(path, lines):
    """A markdown file from its lines (its folder made), and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sims", type=int, default=2000)
    ap.add_argument("--out", default="results/compare/coverage.md")
    ap.add_argument("--power_only", action="store_true", help="only the power table -> --power_out")
    ap.add_argument("--power_out", default="results/compare/power.md")
    args = ap.parse_args(argv)
    if args.power_only:
        write_lines(args.power_out, power_table(args.sims))
        return 0
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
    write_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
