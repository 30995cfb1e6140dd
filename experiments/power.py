"""Power of the confirmatory study (docs/PREREGISTRATION.md), simulated from the committed
five-seed runs of the exploratory comparison (results/compare/fictional); and of the v4 study
(docs/PREREGISTRATION-v4.md), from its training pilot (results/strategy_pilot/training).

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
from stats import gatekeep, welch, write_lines  # noqa: E402

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


def pilot(root="results/strategy_pilot/training/subtract"):
    """{outcome: {arm: [per-seed value]}} of the v4 study's registered outcomes (report.STRATEGY_OUTCOMES),
    read from the training pilot's finished runs (seeds outside the study's)."""
    arms = sorted({a for pair in STRATEGY_CONTRASTS for a in pair})
    out = {name: {} for name, _, _ in STRATEGY_OUTCOMES}
    for arm in arms:
        for d in sorted(glob.glob(os.path.join(root, arm, "seed-*", "result.json"))):
            result = json.load(open(d))
            for name, value, _ in STRATEGY_OUTCOMES:
                out[name].setdefault(arm, []).append(value(result))
    return out


def draw(rng, values, picks, bandwidth, shrink_to=None, shrink=0.0, sd=None):
    """One arm's simulated outcomes: its committed values at the drawn seeds `picks` plus normal
    noise (module doc; sd: the noise's scale, default the arm's own sd); shrink > 0 moves them that
    fraction of the way to shrink_to (the control's mean)."""
    v = np.asarray(values, dtype=np.float64)
    x = v[picks] + rng.normal(0.0, bandwidth * (v.std(ddof=1) if sd is None else sd), len(picks))
    return x if shrink_to is None else x + shrink * (shrink_to - v.mean())


def pooled_sd(values):
    """The within-arm sd pooled over the arms ({arm: values}; arms with one value add nothing)."""
    groups = [np.asarray(v, dtype=np.float64) for v in values.values() if len(v) > 1]
    df = sum(len(g) - 1 for g in groups)
    return float(np.sqrt(sum(((g - g.mean()) ** 2).sum() for g in groups) / df))


def power(data, n_arm, n_control, sims=2000, bandwidth=0.5, shrink=0.0, alpha=0.05, seed=0, contrasts=CONTRASTS,
          pooled=False):
    """{outcome: per-contrast fraction of simulated studies that confirm it}: every outcome of a
    simulated seed comes from the same committed seed (their correlation kept); the outcomes are
    tested in the order given, each a family of the contrasts (stats.gatekeep: Holm within, the
    next only when all of this one are confirmed); every contrast predicted > 0. pooled: the noise's
    scale is the sd pooled over the arms (pooled_sd), for pilots with too few seeds an arm."""
    rng = np.random.default_rng(seed)
    outcomes = list(data)
    arms = list(data[outcomes[0]])
    hits = np.zeros((len(outcomes), len(contrasts)))
    predicted = (+1,) * len(contrasts)
    for _ in range(sims):
        picks = {arm: rng.integers(0, len(data[outcomes[0]][arm]), n_control if arm == CONTROL else n_arm)
                 for arm in arms}
        tests, ps = [], []
        for outcome in outcomes:
            values = data[outcome]
            base = np.mean(values[CONTROL])
            sd = pooled_sd(values) if pooled else None
            sample = {arm: draw(rng, values[arm], picks[arm], bandwidth, None if arm == CONTROL else base,
                                0.0 if arm == CONTROL else shrink, sd) for arm in arms}
            tests += [welch(sample[a], sample[b]) for a, b in contrasts]
            ps.append([t["p"] for t in tests[-len(contrasts):]])
        signs = predicted * len(outcomes)
        right = [[np.sign(t["mean"]) == s for t, s in zip(tests[i:i + len(contrasts)], predicted)]
                 for i in range(0, len(tests), len(contrasts))]
        adjusted = [p for family_ps in gatekeep(ps, alpha, right) for p in family_ps]
        hits += np.reshape([p is not None and p <= alpha and np.sign(t["mean"]) == s
                            for p, t, s in zip(adjusted, tests, signs)], hits.shape)
    return {outcome: hits[i] / sims for i, outcome in enumerate(outcomes)}


def family(data, names):
    """The outcomes of one Holm family: {name: data[name]}."""
    return {name: data[name] for name in names}


def strategy_main(args):
    """--study=subtract: the v4 study's power (docs/PREREGISTRATION-v4.md) from its training pilot."""
    data = pilot()
    designs = [tuple(int(x) for x in d.split(":")) for d in args.designs.split(",")]
    contrasts = [f"{a} - {b}" for a, b in STRATEGY_CONTRASTS]
    seeds = {arm: len(v) for arm, v in data[next(iter(data))].items()}
    lines = ["# Power of the v4 study (simulated from its training pilot)", "",
             f"`python experiments/power.py --study=subtract --sims={args.sims}`: Welch per contrast; Holm over the "
             "four contrasts of an outcome at 0.05, the outcomes in the registered order, each only when all four of "
             "the one before are confirmed with their predicted sign (stats.gatekeep). Each simulated run: one "
             "pilot run of its arm at random plus normal noise; the pilot has " + ", ".join(
                 f"{arm} {n}" for arm, n in seeds.items()) + " runs (seeds 0, 1), too few for an arm's own sd, so the "
             "noise's sd is the within-arm sd pooled over the four arms, times the bandwidth (0.5: the smoothed "
             "bootstrap of the earlier study; 1: twice that spread). Effect: as in the pilot, or every arm shrunk "
             "halfway to the control. An assumption, said here: two seeds an arm measure neither an arm's mean nor "
             "its spread well.", ""]
    for outcome, values in data.items():
        lines.append(f"- {outcome}: pilot runs, per arm: " + ", ".join(
            f"{arm} " + " / ".join(f"{x:+.4f}" for x in v) for arm, v in values.items())
            + f"; pooled within-arm sd {pooled_sd(values):.4f}")
    lines += ["", "| runs per arm : control | bandwidth | effect | outcome | " + " | ".join(contrasts) + " |",
              "|---|---|---|---|" + "---|" * len(contrasts)]
    for n_arm, n_control in designs:
        for bandwidth in (0.5, 1.0):
            for shrink, label in ((0.0, "as in the pilot"), (0.5, "half")):
                got = power(data, n_arm, n_control, args.sims, bandwidth, shrink, contrasts=STRATEGY_CONTRASTS,
                            pooled=True)
                for outcome, p in got.items():
                    lines.append(f"| {n_arm} : {n_control} | {bandwidth:g} | {label} | {outcome} | "
                                 + " | ".join(f"{x:.2f}" for x in p) + " |")
                    print(lines[-1], flush=True)
    write_lines(args.out or "results/subtract/power.md", lines + [""])
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", default="confirm", choices=("confirm", "subtract"),
                    help="confirm: docs/PREREGISTRATION.md; subtract: docs/PREREGISTRATION-v4.md")
    ap.add_argument("--sims", type=int, default=2000)
    ap.add_argument("--designs", default=None, help="seeds per arm:seeds of the control, ... (default: the study's)")
    ap.add_argument("--out", default=None, help="default: results/<study>/power.md")
    args = ap.parse_args(argv)
    if args.study == "subtract":
        args.designs = args.designs or "6:6,8:8,10:10,12:12"
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
