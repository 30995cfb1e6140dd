"""Power of the confirmatory study (docs/PREREGISTRATION.md), simulated from the committed
five-seed runs of the exploratory comparison (results/compare/fictional); and of the v4 study
(docs/PREREGISTRATION-v4.md), from its training pilot (strategy_main, below).

    python experiments/power.py                     # -> results/confirm/power.md (and the table printed)
    python experiments/power.py --study=subtract    # -> results/subtract/power.md

Each simulated study draws every arm's per-seed outcomes from that arm's five committed seeds:
a smoothed bootstrap (a committed seed, chosen uniformly, plus normal noise of sd = bandwidth x
the arm's sd over its five seeds). It keeps what five seeds showed: a mixture of seeds that stay
at the floor and seeds that learn, in the proportion observed, each with the noise seen between
seeds; a simulated seed takes all its outcomes from the same committed seed. Each study then
tests the three pre-registered contrasts on every outcome with Welch's test (experiments/
stats.py), the outcomes in the pre-registered order with serial gatekeeping (Holm over the
three contrasts of an outcome at 0.05; the next outcome only when all three are confirmed);
the power of a contrast is the fraction of studies whose adjusted p is <= 0.05 with the
predicted sign. Also given: the same at half
the observed differences (each arm's draws shrunk halfway to the control's mean), the guard
against an exploratory effect that was partly luck.

The outcomes simulated:
- primary (gold log-prob): the committed runs have no such score (their checkpoints are gone),
  so it is stood in for by the closest committed measure, the CRM probe's per-token mean log-prob
  of one gold-form answer under the plain prompt (results/compare/fictional/<arm>/seed-*/
  crm_tokens.json: the same statistic on one problem, at T = 0.6), and, for the fact-token reading,
  the summed log-prob of its two tokens that spell "13";
- co-primary: held-out avg@16, the committed score itself.
"""

import argparse
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # report.py reads plot.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import BASELINE as CONTROL, CONTRASTS, STRATEGY_CONTRASTS, STRATEGY_OUTCOMES  # noqa: E402
# (the registered contrasts and outcomes, one definition)
from stats import deciding_p, fixed_sequences, gatekeep, paired_test, welch, write_lines  # noqa: E402

PREDICTED = (+1,) * len(CONTRASTS)  # every contrast predicts > 0: unmasked distillation learns more
FAMILIES = {  # title -> outcomes, each a family of the three contrasts, tested in this order (stats.gatekeep)
    "as pre-registered: the fact tokens' log-prob, then the whole answer's, then held-out avg@16 (serial gatekeeping)":
        ("probe fact-token log p", "probe response mean log p", "held-out avg@16"),
    "for comparison, Holm over the three contrasts of one outcome alone":
        ("probe response mean log p",),
    "(the same, held-out avg@16 alone)": ("held-out avg@16",),
}
FACT_TOKENS = (9, 10)  # the probe response's tokens that spell "13" ("1", "3"), as gold_logprob.fact_positions finds them


def committed(root="results/compare/fictional"):
    """{outcome: {arm: [per-seed value]}} of the arms the contrasts use, from the committed runs."""
    arms = sorted({a for pair in CONTRASTS for a in pair})
    out = {"probe response mean log p": {}, "probe fact-token log p": {}, "held-out avg@16": {}}
    for arm in arms:
        for d in sorted(glob.glob(os.path.join(root, arm, "seed-*"))):
            result = json.load(open(os.path.join(d, "result.json")))
            probe = json.load(open(os.path.join(d, "crm_tokens.json")))
            out["probe response mean log p"].setdefault(arm, []).append(np.mean([t["logp_plain"] for t in probe]))
            out["probe fact-token log p"].setdefault(arm, []).append(sum(probe[i]["logp_plain"] for i in FACT_TOKENS))
            out["held-out avg@16"].setdefault(arm, []).append(result["sets"]["final"]["heldout"]["overall"]["avg@16"])
    return out


def draw(rng, values, picks, bandwidth, shrink_to=None, shrink=0.0):
    """One arm's simulated outcomes: its committed values at the drawn seeds `picks` plus normal
    noise (module doc); shrink > 0 moves them that fraction of the way to shrink_to (the control's mean)."""
    v = np.asarray(values, dtype=np.float64)
    x = v[picks] + rng.normal(0.0, bandwidth * v.std(ddof=1), len(picks))
    return x if shrink_to is None else x + shrink * (shrink_to - v.mean())


def power(data, n_arm, n_control, sims=2000, bandwidth=0.5, shrink=0.0, alpha=0.05, seed=0):
    """{outcome: per-contrast fraction of simulated studies that confirm it}: every outcome of a
    simulated seed comes from the same committed seed (their correlation kept); the outcomes are
    tested in the order given, each a family of the contrasts (stats.gatekeep: Holm within, the
    next only when all of this one are confirmed)."""
    rng = np.random.default_rng(seed)
    outcomes = list(data)
    arms = list(data[outcomes[0]])
    hits = np.zeros((len(outcomes), len(CONTRASTS)))
    for _ in range(sims):
        picks = {arm: rng.integers(0, len(data[outcomes[0]][arm]), n_control if arm == CONTROL else n_arm)
                 for arm in arms}
        tests, ps = [], []
        for outcome in outcomes:
            values = data[outcome]
            base = np.mean(values[CONTROL])
            sample = {arm: draw(rng, values[arm], picks[arm], bandwidth, None if arm == CONTROL else base,
                                0.0 if arm == CONTROL else shrink) for arm in arms}
            tests += [welch(sample[a], sample[b]) for a, b in CONTRASTS]
            ps.append([t["p"] for t in tests[-len(CONTRASTS):]])
        signs = PREDICTED * len(outcomes)
        right = [[np.sign(t["mean"]) == s for t, s in zip(tests[i:i + len(CONTRASTS)], PREDICTED)]
                 for i in range(0, len(tests), len(CONTRASTS))]
        adjusted = [p for family_ps in gatekeep(ps, alpha, right) for p in family_ps]
        hits += np.reshape([p is not None and p <= alpha and np.sign(t["mean"]) == s
                            for p, t, s in zip(adjusted, tests, signs)], hits.shape)
    return {outcome: hits[i] / sims for i, outcome in enumerate(outcomes)}


def family(data, names):
    """The outcomes of one Holm family: {name: data[name]}."""
    return {name: data[name] for name in names}


# ----------------------------------------------------------------------------- the v4 study

def pilot(root="results/strategy_pilot/training/subtract"):
    """{outcome: {arm: [per-run value]}} of the v4 study's registered outcomes (report.STRATEGY_OUTCOMES)
    in the training pilot's finished runs (its seeds are not the study's). The pilot scored the 45 hard
    held-out problems alone, their gold answers in an earlier form ("29 − 24 = 5, so 24 − 29 = -5."):
    its gold log-prob is that set's."""
    arms = sorted({a for pair in STRATEGY_CONTRASTS for a in pair})
    out = {name: {arm: [] for arm in arms} for name, _, _ in STRATEGY_OUTCOMES}
    for arm in arms:
        for path in sorted(glob.glob(os.path.join(root, arm, "seed-*", "result.json"))):
            with open(path) as f:
                result = json.load(f)
            for name, value, _ in STRATEGY_OUTCOMES:
                got = value(result)
                if got is None and name == "gold answer mean log-prob":  # the pilot's held-out split was the hard
                    got = result["gold"]["heldout"]["logp_mean"]  # level alone (then gold answers "b − a = d, so ...")
                out[name][arm].append(got)
    return out


def pooled_sd(values):
    """(the within-arm sd pooled over the arms of {arm: values}, its degrees of freedom); arms with one
    value add nothing."""
    groups = [np.asarray(v, dtype=np.float64) for v in values.values() if len(v) > 1]
    df = sum(len(g) - 1 for g in groups)
    return (float(np.sqrt(sum(((g - g.mean()) ** 2).sum() for g in groups) / df)) if df else float("nan")), df


def sd_upper(sd, df, level=0.8, seed=0):
    """The one-sided `level` upper confidence limit of a normal sd estimated with df degrees of freedom:
    sd * sqrt(df / q), q the (1 - level) quantile of chi-square(df) (from 10^6 seeded draws)."""
    q = np.quantile(np.random.default_rng(seed).chisquare(df, 1_000_000), 1 - level)
    return sd * float(np.sqrt(df / q))


COUPLED = (("p2o_human", "grpo_k"), ("p2o_human_no_crm", "grpo_k"), ("p2o_human_no_crm", "p2o_human"))
# P²O's runs are GRPO (K)'s, step for step, until GEPA first assigns a template (the same seed, the same random
# numbers): their paired differences are far tighter than the runs. Rejection sampling templates from step 1.


def paired_sds(data, upper=False):
    """{outcome: {contrast: sd of its per-seed paired differences}}: pooled over the coupled contrasts, and for
    rejection sampling (not coupled) sqrt(2) x the within-arm sd pooled over its two arms; upper: each one's
    80% upper confidence limit."""
    out = {}
    for name, values in data.items():
        diffs = {c: [x - y for x, y in zip(values[c[0]], values[c[1]])] for c in COUPLED}
        sd, df = pooled_sd(diffs)
        loose, loose_df = pooled_sd({arm: values[arm] for arm in ("rs_distill", CONTROL)})
        sd, loose = (sd_upper(sd, df), sd_upper(loose, loose_df)) if upper else (sd, loose)
        out[name] = {c: sd if c in COUPLED else np.sqrt(2) * loose for c in STRATEGY_CONTRASTS}
    return out


def strategy_power(means, sds, n, sims=2000, alpha=0.05, seed=0):
    """{outcome: per-contrast fraction of simulated studies that confirm it} under the v4 analysis: n seeds,
    each contrast's per-seed paired differences ~ normal(means[outcome][contrast], sds[outcome][contrast]); the
    paired t-test; each contrast a fixed sequence over the outcomes in order, Bonferroni over the contrasts
    (stats.fixed_sequences). A seed's outcomes, and its contrasts, are drawn independently (two pilot seeds
    cannot measure their correlations)."""
    rng = np.random.default_rng(seed)
    names = [name for name, _, _ in STRATEGY_OUTCOMES]
    hits = np.zeros((len(names), len(STRATEGY_CONTRASTS)))
    for _ in range(sims):
        ps, signs = [], []
        for name in names:
            tests = [paired_test(rng.normal(means[name][c], sds[name][c], n)) for c in STRATEGY_CONTRASTS]
            ps.append([deciding_p(t) for t in tests])
            signs.append([t["mean"] > 0 for t in tests])
        chains = fixed_sequences([list(c) for c in zip(*ps)], alpha, [list(c) for c in zip(*signs)])
        hits += np.array([[a is not None and a <= alpha and good for a, good in zip(chain, chain_signs)]
                          for chain, chain_signs in zip(chains, zip(*signs))]).T
    return {name: hits[i] / sims for i, name in enumerate(names)}


def scenarios(data):
    """{label: (means, sds)}: each contrast's mean paired difference as in the pilot, or at its smallest effect
    of interest; each with the pooled sds (paired_sds) or their 80% upper limits."""
    out = {}
    for effect in ("as in the pilot", "at delta"):
        means = {name: {c: (float(np.mean(np.subtract(data[name][c[0]], data[name][c[1]])))
                            if effect == "as in the pilot" else delta) for c in STRATEGY_CONTRASTS}
                 for name, _, delta in STRATEGY_OUTCOMES}
        for spread, upper in (("pooled sd", False), ("its 80% upper limit", True)):
            out[f"{effect}, {spread}"] = (means, paired_sds(data, upper))
    return out


def strategy_main(args):
    """--study=subtract: the v4 study's power (docs/PREREGISTRATION-v4.md) from its training pilot."""
    data = pilot()
    designs = [int(d.split(":")[0]) for d in args.designs.split(",")]
    contrasts = [f"{a} - {b}" for a, b in STRATEGY_CONTRASTS]
    lines = ["# Power of the v4 study (simulated from its training pilot)", "",
             f"`python experiments/power.py --study=subtract --sims={args.sims}`: the registered analysis "
             "(`strategy_power`): per seed, each contrast's paired difference drawn normal around its mean; the "
             "paired t-test; each contrast a fixed sequence over the outcomes in order, every test at 0.05 / 4. "
             "The pilot has two seeds, so the sds are pooled: over the three contrasts whose arms share each "
             "seed's run until GEPA's first template (P²O's runs are GRPO (K)'s step for step until then), and "
             "for rejection sampling, which templates from step 1, sqrt(2) x the within-arm sd of its two arms; "
             "or, the guard against a pilot that saw too little spread, their one-sided 80% upper confidence "
             "limits. Means: each contrast as in the pilot, or at its smallest effect of interest. A seed's "
             "outcomes and contrasts are drawn independently. Two seeds measure neither a mean nor a spread "
             "well: the table is a guide, stated in advance, not a promise.", ""]
    for name, values in data.items():
        lines.append(f"- {name}: pilot runs (seeds 0, 1) " + ", ".join(
            f"{arm} " + " / ".join(f"{x:+.4f}" for x in v) for arm, v in values.items()) + "; paired sds "
            + ", ".join(f"{a} - {b} {paired_sds(data)[name][(a, b)]:.4f}" for a, b in STRATEGY_CONTRASTS))
    lines += ["", "| seeds (every arm) | means, sd | outcome | " + " | ".join(contrasts) + " |",
              "|---|---|---|" + "---|" * len(contrasts)]
    for n in designs:
        for label, (means, sds) in scenarios(data).items():
            for outcome, p in strategy_power(means, sds, n, args.sims).items():
                lines.append(f"| {n} | {label} | {outcome} | " + " | ".join(f"{x:.2f}" for x in p) + " |")
                print(lines[-1], flush=True)
    write_lines(args.out or "results/subtract/power.md", lines + [""])
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", default="confirm", choices=("confirm", "subtract"),
                    help="confirm: docs/PREREGISTRATION.md; subtract: docs/PREREGISTRATION-v4.md")
    ap.add_argument("--sims", type=int, default=2000)
    ap.add_argument("--designs", default=None, help="seeds per arm:seeds of the control, ... (subtract: seeds, "
                    "every arm; default: the study's)")
    ap.add_argument("--out", default=None, help="default: results/<study>/power.md")
    args = ap.parse_args(argv)
    if args.study == "subtract":
        args.designs = args.designs or "8,10,12,14"
        return strategy_main(args)
    args.designs, args.out = args.designs or "10:14,12:16,14:18,16:20", args.out or "results/confirm/power.md"
    data = committed()
    designs = [tuple(int(x) for x in d.split(":")) for d in args.designs.split(",")]
    contrasts = [f"{a} - {b}" for a, b in CONTRASTS]
    lines = ["# Power of the confirmatory study (simulated)", "",
             f"`python experiments/power.py --sims={args.sims}`: Welch per contrast; Holm over the three contrasts of "
             "an outcome at 0.05, the outcomes in order, each only when all three of the one before are confirmed "
             "with their predicted sign (stats.gatekeep); smoothed bootstrap of the committed five seeds "
             "(bandwidth 0.5 sd); effect: as observed in the five seeds, or each arm shrunk halfway to the control; "
             "see the script's doc.", ""]
    for outcome, values in data.items():
        lines.append(f"- {outcome}: five committed seeds per arm, mean (sd): "
                     + ", ".join(f"{arm} {np.mean(v):+.3f} ({np.std(v, ddof=1):.3f})" for arm, v in values.items()))
    lines.append("")
    for title, names in FAMILIES.items():
        lines += [f"**{title}**", "", "| seeds per arm : control | effect | outcome | " + " | ".join(contrasts)
                  + " |", "|---|---|---|" + "---|" * len(contrasts)]
        for n_arm, n_control in designs:
            for shrink, label in ((0.0, "as observed"), (0.5, "half")):
                got = power(family(data, names), n_arm, n_control, args.sims, shrink=shrink)
                for outcome, p in got.items():
                    lines.append(f"| {n_arm} : {n_control} | {label} | {outcome} | "
                                 + " | ".join(f"{x:.2f}" for x in p) + " |")
                    print(lines[-1], flush=True)
        lines.append("")
    write_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
