"""experiments/compare.py's report: tables from the finished runs' result.json and per-problem
problems.jsonl, the paired statistics of experiments/stats.py, and one plot per task.

    python experiments/compare.py --report_only      # rewrite results/compare/report.md

Every arm is paired with GRPO (K) seed by seed (same seed: same prompt order and the same test
sampling seed). The primary statistic is the first scored column (columns: held-out avg@k where
a task has a held-out split, as pre-registered in docs/EVIDENCE.md, else test avg@k); the
others are reported the same way and are secondary. A seed-free arm (one whose training does
not depend on the seed, Task.seed_free) is run on two seeds to show it and its one result is
paired with every baseline seed.
"""

import json
import os
import re
import statistics
from collections import Counter
from dataclasses import dataclass

import numpy as np

from plot import read_jsonl  # the repository root is on sys.path (compare.py puts it there)
from verify import last_boxed
from stats import barnard, binomial_tail, deciding_p, fixed_sequences, gatekeep, hierarchical_bootstrap, holm, paired_test, sign_flip_p, t_interval, welch

BASELINE = "grpo_k"
MIN_SEEDS_FOR_P = 5  # the sign-flip test's smallest p is 2 / 2^n: below 5 seeds it says nothing useful
MIN_SEEDS_FOR_BOOT = 3  # the fewest seeds at which coverage.md measures the bootstrap's coverage


def read_problems(path):
    """{(checkpoint, set): {problem id: row}} of a run's problems.jsonl ({} when it has none)."""
    table = {}
    for r in read_jsonl(path):
        table.setdefault((r["checkpoint"], r["set"]), {})[r["id"]] = r
    return table


def problem_value(row, metric):
    """A per-problem score: greedy (0/1), avg (correct / k) or pass (any of the k correct)."""
    if metric == "greedy":
        return float(row["greedy"])
    if metric == "avg":
        return row["correct"] / row["k"]
    return float(row["correct"] > 0)


def metric_name(metric, k):
    return "greedy" if metric == "greedy" else f"{metric}@{k}"


def overall(run, set_name, metric, k):
    """A run's score on a set (result.json), or None when it was not scored on it."""
    sets = run.get("sets", {}).get("final") or ({"test": run["test"]["final"]} if set_name == "test" else {})
    return sets.get(set_name, {}).get("overall", {}).get(metric_name(metric, k))


def paired(arm_runs, base_runs, set_name, metric, k, seed_free=False):
    """Paired statistics of an arm against the baseline on one (set, metric), final checkpoint:
    {"seeds", "diffs" (per seed, from result.json), "mean", "t" (low, high) or None, "boot" (low,
    high) or None, "p" or None}. The t-interval needs 2 seeds; the bootstrap both arms' per-problem
    rows and MIN_SEEDS_FOR_BOOT seeds; p MIN_SEEDS_FOR_P. seed_free: the arm's first run stands
    for every baseline seed (check_seed_free says its runs agree)."""
    base = {r["seed"]: r for r in base_runs}
    if seed_free:
        first = min(arm_runs, key=lambda r: r["seed"])
        pairs = [(first, base[seed]) for seed in sorted(base)]
    else:
        pairs = [(r, base[r["seed"]]) for r in sorted(arm_runs, key=lambda r: r["seed"]) if r["seed"] in base]
    diffs, a_rows, b_rows = [], [], []
    for r, b in pairs:
        x, y = overall(r, set_name, metric, k), overall(b, set_name, metric, k)
        if x is None or y is None:
            continue
        diffs.append(x - y)
        pa, pb = r.get("problems", {}).get(("final", set_name)), b.get("problems", {}).get(("final", set_name))
        if pa and pb and pa.keys() == pb.keys():
            ids = sorted(pa)
            a_rows.append([problem_value(pa[i], metric) for i in ids])
            b_rows.append([problem_value(pb[i], metric) for i in ids])
    out = {"seeds": len(diffs), "diffs": diffs, "mean": statistics.mean(diffs) if diffs else None,
           "t": None, "boot": None, "p": None}
    if len(diffs) >= 2:
        out["t"] = t_interval(diffs)[1:]
    if len(a_rows) == len(diffs) >= MIN_SEEDS_FOR_BOOT:
        out["boot"] = hierarchical_bootstrap(np.array(a_rows), np.array(b_rows))[1:]
    if len(diffs) >= MIN_SEEDS_FOR_P:
        out["p"] = sign_flip_p(diffs)
    return out


def check_seed_free(arm, runs):
    """A seed-free arm's runs must agree on every score and per-problem row: else it is not seed-free."""
    first = min(runs, key=lambda r: r["seed"])
    for r in runs:
        if r.get("sets") != first.get("sets") or r.get("problems") != first.get("problems"):
            raise ValueError(f"{arm} is declared seed-free (Task.seed_free) but its seed {r['seed']} scored "
                             f"differently from seed {first['seed']}: run it on every seed instead")


def coverage_range(path, kind="normal"):
    """(t low, t high, bootstrap low, bootstrap high) over the rows of coverage.md's tables whose
    scenario heading is of that kind (stats.SCENARIOS: "**normal: ..." or "**lopsided: ..."), or None."""
    rows, heading = [], ""
    if os.path.exists(path):
        for line in open(path):
            heading = line.strip() if line.startswith("**") else heading
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 3 and cells[0].isdigit() and heading.startswith(f"**{kind}:"):
                rows.append((float(cells[1]), float(cells[2])))
    if not rows:
        return None
    t, boot = zip(*rows)
    return min(t), max(t), min(boot), max(boot)


def fmt_interval(iv):
    """An interval's cell; one of no width says that every seed (or resample) differed alike, which
    is no claim that the mean difference is exactly that."""
    if iv is None:
        return "-"
    return "no spread" if iv[1] - iv[0] < 1e-12 else f"[{iv[0]:+.3f}, {iv[1]:+.3f}]"


def mean_sd(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.mean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


def columns(results, k, k_templated):
    """The (set, metric, k) columns of a task: those its runs were scored on."""
    scored = {s for runs in results.values() for r in runs for s in r.get("sets", {}).get("final", {"test": 0})}
    cols = []
    for set_name in ("heldout", "heldout_templated", "test"):
        if set_name in scored:
            kk = k_templated if set_name == "heldout_templated" else k
            cols += [(set_name, m, kk) for m in ("avg", "pass", "greedy")]
    return cols


def task_report(task_name, results, k, k_templated=8, seed_free=(), command="", family=None, contrasts=(),
                confirmatory=False):
    """Markdown lines for one task: {arm: [result per seed]} (results with "problems" attached);
    seed_free: the arms whose one result is paired with every baseline seed (paired); family: the
    number of arms the task compares with the baseline, finished or not, for the Bonferroni level
    (None: the arms in results), so that the level does not change as runs come in; contrasts:
    (arm, other) pairs paired with each other on the primary statistic, reported as post hoc;
    confirmatory: the task's tests are confirm_report's, these tables describe."""
    cols = columns(results, k, k_templated)
    label = lambda s, m, kk: f"{s} {metric_name(m, kk)}"  # noqa: E731
    seed_free = [arm for arm in seed_free if arm in results]
    for arm in seed_free:
        check_seed_free(arm, results[arm])
    lines = [f"## {task_name}" + (": every score, described (not the confirmatory tests)" if confirmatory else ""),
             ""] + ([f"Runs: `{command}`.", ""] if command else []) + [
             "Final checkpoint, mean ± sd over seeds; compute per run (mean)."
             + (f" Seed-free ({', '.join(seed_free)}): training that does not depend on the seed; its seeds "
                "scored alike (checked), and its one result is paired with every seed of the baseline." if seed_free
                else ""), "",
             "| arm | seeds | steps | generated tokens | TFLOPs | train + score min | "
             + " | ".join(label(*c) for c in cols) + " |", "|---|---|---|---|---|---|" + "---|" * len(cols)]
    for arm, runs in results.items():
        flops = [r["flops"] for r in runs if r.get("flops") is not None and arm != "untrained"]
        minutes = statistics.mean((r["train_seconds"] + r.get("score_seconds", 0.0)) / 60 for r in runs)
        cells = [mean_sd([overall(r, *c) for r in runs]) for c in cols]
        lines.append(f"| {arm} | {len(runs) if arm != 'untrained' else '-'} | "
                     f"{statistics.mean(r['steps'] for r in runs):.1f} | "
                     f"{statistics.mean(r['generated_tokens'] for r in runs):,.0f} | "
                     + (f"{statistics.mean(flops) / 1e12:,.0f}" if flops else "-")
                     + f" | {minutes:.1f} | " + " | ".join(cells) + " |")
    base = results.get(BASELINE)
    if not base:
        return lines + [""]
    primary = cols[0] if cols else ("test", "greedy", 0)
    prereg = ", the pre-registered primary statistic (docs/EVIDENCE.md)" if primary[0] == "heldout" and \
        not confirmatory else ""
    others = [(arm, runs) for arm, runs in results.items() if arm not in (BASELINE, "untrained")]
    primaries = [(arm, paired(runs, base, *primary, seed_free=arm in seed_free)) for arm, runs in others]
    primaries = [(arm, s) for arm, s in primaries if s["seeds"]]
    family = max(family or 0, len(primaries), 1)  # Bonferroni: every arm of the task against the one baseline
    lines += ["", f"**Paired against {BASELINE}, {label(*primary)}**{prereg}. Final checkpoint; per-seed "
                  "differences in seed order; t: Student-t 95% over seeds; Bonferroni: the t-interval at level "
                  f"1 - 0.05/{family} for the {family} arms compared with it (finished or not), together 95%"
                  + (" (not part of the pre-registration, which set no correction)" if prereg else "")
                  + f"; bootstrap: seeds then problems, nominal 95% percentile (it covers less with few seeds, "
                  f"coverage.md), shown from {MIN_SEEDS_FOR_BOOT} seeds with per-problem rows; p: exact two-sided "
                  f"sign-flip, shown from {MIN_SEEDS_FOR_P} seeds, "
                  f"whose smallest possible value is 2/2^seeds ({2 / 2 ** MIN_SEEDS_FOR_P:.4f} at {MIN_SEEDS_FOR_P}):",
              "", f"| arm | seeds | per-seed differences | mean | t 95% | t, Bonferroni over {family} | bootstrap 95% | "
                  "unpaired: Welch 95% | p |", "|---|---|---|---|---|---|---|---|---|"]
    runs_of = dict(others)
    for arm, s in primaries:
        family_t = t_interval(s["diffs"], 1 - 0.05 / family)[1:] if s["seeds"] >= 2 else None
        lines.append(paired_row(f"{arm} | {s['seeds']}{' (1 run)' if arm in seed_free else ''}", s,
                                fmt_interval(s["t"]), fmt_interval(family_t), fmt_interval(s["boot"]),
                                fmt_interval(unpaired(runs_of[arm], base, primary))))
    secondary = cols[1:]
    if secondary:
        lines += ["", f"Secondary, paired against {BASELINE}: mean [t 95%]:", "",
                  "| arm | " + " | ".join(label(*c) for c in secondary) + " |", "|---|" + "---|" * len(secondary)]
        for arm, runs in others:
            cells = []
            for c in secondary:
                s = paired(runs, base, *c, seed_free=arm in seed_free)
                cells.append("-" if not s["seeds"] else f"{s['mean']:+.3f} {fmt_interval(s['t'])}")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines + contrast_lines(results, contrasts, primary, label(*primary)) + [""]


def unpaired(arm_runs, base_runs, column):
    """Welch's 95% interval (stats.welch) of an arm's scores against the baseline's on one column,
    ignoring the seed pairing (which removes no variance when the two are uncorrelated over
    seeds), or None below two scores each."""
    a = [x for x in (overall(r, *column) for r in arm_runs) if x is not None]
    b = [x for x in (overall(r, *column) for r in base_runs) if x is not None]
    if len(a) < 2 or len(b) < 2:
        return None
    w = welch(a, b)
    return w["low"], w["high"]


def paired_row(head, s, *intervals):
    """A table row of paired(): head (arm and seeds cells), the per-seed differences, the mean,
    the given interval cells, p."""
    return (f"| {head} | " + ", ".join(f"{d:+.3f}" for d in s["diffs"]) + f" | {s['mean']:+.3f} | "
            + "".join(f"{iv} | " for iv in intervals) + ("-" if s["p"] is None else f"{s['p']:.3f}") + " |")


def contrast_lines(results, contrasts, primary, primary_label):
    """The post hoc table: each (arm, other) pair with both arms in results, paired seed by seed
    on the primary statistic (task_report)."""
    pairs = [(a, b, paired(results[a], results[b], *primary)) for a, b in contrasts if a in results and b in results]
    pairs = [(a, b, s) for a, b, s in pairs if s["seeds"]]
    if not pairs:
        return []
    return ["", f"Post hoc (chosen after the runs, not corrected for multiplicity): arms paired with each other "
                f"seed by seed, {primary_label}, as above:", "",
            "| arm - other arm | seeds | per-seed differences | mean | t 95% | p |", "|---|---|---|---|---|---|"] + \
        [paired_row(f"{a} - {b} | {s['seeds']}", s, fmt_interval(s["t"])) for a, b, s in pairs]


def probe_report(results, fact="13", question="How many snigs are in 2 plonks?"):
    """The CRM probe (compare.crm_probe) of every run: the fact's token (the last of those that spell `fact`
    first, e.g. the "3" of "13") and the whole probe response under the plain prompt, mean over seeds. A token
    is counted outside the band of its own run's settings (crm_low, crm_high; train.py's defaults where a run
    sets none)."""
    which = f"the \"{fact[-1]}\" of \"{fact}\"" if len(fact) > 1 else f"the first \"{fact}\""
    lines = [f"CRM probe (`experiments/crm_tokens.py` on each final policy; the fact's token is {which} in "
             f"the correct answer to \"{question}\"; log-probs at T = 0.6; outside band: log c "
             "outside the run's own [log crm_low, log crm_high], by default [-4.61, 2.30], [-9.21, 2.30] for "
             "crm_low 1e-4; a soft CRM down-weights such a token rather than masking it):", "",
             "| arm | runs | fact token log p(x) | its log p(x~) | its log c | outside band | "
             "response mean log p(x) |", "|---|---|---|---|---|---|---|"]
    for arm, runs in results.items():
        runs = [r for r in runs if r.get("probe")]
        if not runs:
            continue
        facts = [fact_token(r["probe"], fact) for r in runs]
        outside = sum(outside_band(f["log_c"], r.get("settings", {})) for f, r in zip(facts, runs))
        mean = lambda xs: statistics.mean(xs)  # noqa: E731
        lines.append(f"| {arm} | {len(runs)} | {mean(f['logp_plain'] for f in facts):.2f} | "
                     f"{mean(f['logp_templated'] for f in facts):.2f} | {mean(f['log_c'] for f in facts):.2f} | "
                     f"{outside} of {len(facts)} | "
                     f"{mean(mean(t['logp_plain'] for t in r['probe']) for r in runs):.2f} |")
    return lines + [""] if len(lines) > 4 else []


def outside_band(log_c, settings):
    """Whether a token's log c falls outside the CRM band of a run's settings (distill.crm_weights'
    test, so the report and the trainer agree at the edges)."""
    import torch

    from distill import crm_weights
    from train import Config

    low, high = (float(settings.get(key, getattr(Config, key))) for key in ("crm_low", "crm_high"))
    weight, _ = crm_weights(torch.tensor([float(log_c)], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                            low, high)
    return bool(weight.item() == 0.0)


def fact_token(rows, fact="13"):
    """The probe row of the last token of the first run of tokens that spell `fact` (the "3" of "13")."""
    for start in range(len(rows)):
        text = ""
        for row in rows[start:]:
            text += row["token"].strip()
            if text == fact:
                return row
            if not fact.startswith(text):
                break
    raise ValueError(f"the probe response has no {fact!r}")


def leak_lines(results):
    assigned = sum(r["templates_assigned"] for runs in results.values() for r in runs)
    leaks = [(r["arm"], r["seed"], *leak) for runs in results.values() for r in runs for leak in r["leaks"]]
    return [f"Leak audit: {assigned} (problem, template) assignments checked, **{len(leaks)} leaks**."] + \
        [f"- LEAK: {arm} seed {seed}: {pid}: {template!r}" for arm, seed, pid, template in leaks] + [""]


def plot_dev(task_name, results, out_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (arm, runs) in enumerate(results.items()):
        for j, r in enumerate(r for r in runs if r["dev"]):
            ax.plot([d["generated_tokens"] for d in r["dev"]], [d["greedy"] for d in r["dev"]], marker=".",
                    color=colors[i % len(colors)], alpha=0.7, label=arm if j == 0 else None)
    ax.set_xlabel("generated tokens (rollouts + GEPA answers + reflections)")
    ax.set_ylabel("dev greedy accuracy")
    ax.set_title(f"{task_name}: every seed of every arm")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=90)
    plt.close(fig)


def shaping_report(results):
    """What the reward-shaping arms' bonuses did (compare.shaping_summary), mean over seeds."""
    lines = ["Reward shaping (train.py's shaping_* metrics, mean over a run's steps, then over seeds): the share of "
             "groups given a bonus, of groups whose advantage order changed (a tie broken or made) or reversed, "
             "and the mean bonus over every rollout:", "",
             "| arm | runs | groups shaped | order changed | order reversed | mean bonus |", "|---|---|---|---|---|---|"]
    for arm, runs in results.items():
        runs = [r["shaping"] for r in runs if r.get("shaping")]
        if runs:
            mean = lambda key: statistics.mean(r[key] for r in runs)  # noqa: E731
            lines.append(f"| {arm} | {len(runs)} | {mean('shaping_groups'):.3f} | {mean('shaping_order_changed'):.3f} | "
                         f"{mean('shaping_order_reversed'):.3f} | {mean('shaping_bonus_mean'):+.4f} |")
    return lines + [""] if len(lines) > 4 else []


def wall_time(task_name, results):
    """"<task>: N runs, training X h, test scoring Y h" (the starting model's scoring not counted)."""
    runs = [r for arm, rs in results.items() if arm != "untrained" for r in rs]
    unscored = sum("score_seconds" not in r for r in runs)
    return (f"{task_name}: {len(runs)} runs, training {sum(r['train_seconds'] for r in runs) / 3600:.2f} h, test "
            f"scoring {sum(r.get('score_seconds', 0.0) for r in runs) / 3600:.2f} h"
            + (f" ({unscored} runs scored before scoring was timed)" if unscored else ""))


def write_report(out, all_results, k, commands, k_templated=8, seed_free=None, families=None, contrasts=None,
                 confirms=None, probes=None):
    """report.md (+ one PNG per task) and results.json (every result.json, without per-problem rows).
    commands: {task: the command its runs were made with}; seed_free: {task: arms}; families:
    {task: number of arms compared with the baseline}; contrasts: {task: (arm, other) pairs} (task_report);
    confirms: {task: (planned {arm: seeds}, pre-registration path, untrained noise rate)} (confirm_report);
    probes: {task: (the CRM probe's fact, its question)} (probe_report; default the made-up units')."""
    lines = ["# P²O against its baselines at an equal budget of generated tokens", "",
             "Runs and their wall time, summed per task: " + "; ".join(
                 wall_time(task_name, results) for task_name, results in all_results.items() if results) + ".", ""]
    coverage = coverage_range(os.path.join(out, "coverage.md"))
    lopsided = coverage_range(os.path.join(out, "coverage.md"), "lopsided")
    if coverage:
        lines += [f"Coverage of the 95% intervals on simulated comparisons ([coverage.md](coverage.md), 3 to 20 "
                  f"seeds) with normal seed and problem effects: t-interval {coverage[0]:.3f}-{coverage[1]:.3f}, "
                  f"hierarchical bootstrap {coverage[2]:.3f}-{coverage[3]:.3f} (lowest with few seeds when seed "
                  "effects dominate), so the t-interval is the one to read"
                  + (f"; when a few seeds learn and the rest do not, it covers only "
                     f"{lopsided[0]:.3f}-{lopsided[1]:.3f} over the same seed counts" if lopsided else "") + ".", ""]
    for task_name, results in all_results.items():
        confirm = (confirms or {}).get(task_name)
        if confirm:
            lines += confirm_report(task_name, results, *confirm)
        if results:
            lines += task_report(task_name, results, k, k_templated, (seed_free or {}).get(task_name, ()),
                                 commands.get(task_name, ""), (families or {}).get(task_name),
                                 (contrasts or {}).get(task_name, ()), bool(confirm)) \
                + probe_report(results, *(probes or {}).get(task_name, ())) \
                + shaping_report(results) + leak_lines(results)
            png = os.path.join(out, f"{task_name}-dev-vs-tokens.png")
            plot_dev(task_name, results, png)
            lines += [f"![dev accuracy against generated tokens]({os.path.basename(png)})", ""]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines))
    plain = {t: {arm: [{k2: v for k2, v in r.items() if k2 not in ("problems", "probe")} for r in rs]
                 for arm, rs in results.items()} for t, results in all_results.items()}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(plain, f, indent=1)


# ----------------------------------------------------------------------------- the confirmatory study

# What docs/PREREGISTRATION.md fixed before the first run; the analysis below reads only these.
CONTRASTS = (("p2o_human_no_crm", "grpo_k"), ("p2o_human_no_crm", "p2o_human"), ("rs_distill", "grpo_k"))
OUTCOMES = (  # tested in this order, each a Holm family over CONTRASTS (serial gatekeeping)
    # (name, how a run's value is read, smallest effect of interest: an interval inside +/- it refutes)
    ("gold fact-token log-prob", lambda r: r.get("gold", {}).get("heldout", {}).get("fact_logp"), 1.0),
    ("gold answer mean log-prob", lambda r: r.get("gold", {}).get("heldout", {}).get("logp_mean"), 0.05),
    ("held-out avg@16", lambda r: overall(r, "heldout", "avg", 16), 0.02),
)
ALPHA = 0.05
LEARN_P = 0.001  # a run learnt when the untrained model would reach its held-out correct count with p <= this
GEPA_ARMS = ("p2o_human", "p2o_human_no_crm")  # the futility rule's arms


@dataclass(frozen=True)
class Registration:
    """What a pre-registration fixed before its first run; confirm_report reads only this."""
    contrasts: tuple  # (arm, other arm): each predicted > 0
    outcomes: tuple  # (name, a run's value, smallest effect of interest), tested in this order (serial gatekeeping)
    gepa_arms: tuple  # the futility rule's arms (none: no futility rule)
    learn_rate: bool = True  # the learn-rate secondary (needs the task's scoring-noise file)
    # "serial": each outcome a Holm family over the contrasts, the next only when all are confirmed (stats.gatekeep);
    # "per_contrast": each contrast its own fixed sequence over the outcomes, Bonferroni over the contrasts
    # (stats.fixed_sequences)
    multiplicity: str = "serial"
    exact_refutes: bool = False  # neither arm varies and their difference lies within +/- delta: refuted
    described: object = None  # results, planned -> markdown lines of registered descriptive secondaries
    test: str = "welch"  # "welch": unpaired, the paired interval beside; "paired": the t-test over shared seeds,
    # Welch's interval beside

    @property
    def no_spread(self):
        """What it is that does not vary when its test has no spread (the report's words)."""
        return "the paired differences do not vary" if self.test == "paired" else "neither arm varies"


def by_source(run, set_name, source, key):
    """A run's score `key` on one source of a set (result.json's by_source), or None where it has none."""
    return run.get("sets", {}).get("final", {}).get(set_name, {}).get("by_source", {}).get(source, {}).get(key)


# docs/PREREGISTRATION-v4.md (the subtraction task, issue 54): the paper's claim first
STRATEGY_CONTRASTS = (("p2o_human", "grpo_k"), ("p2o_human_no_crm", "grpo_k"), ("rs_distill", "grpo_k"),
                      ("p2o_human_no_crm", "p2o_human"))
HARD = "subtract-heldout/neg"  # the held-out split's hard level: the outcomes are read on it alone
STRATEGY_OUTCOMES = (
    ("held-out avg@16", lambda r: by_source(r, "heldout", HARD, "avg@16"), 0.02),
    ("held-out pass@16", lambda r: by_source(r, "heldout", HARD, "pass@16"), 0.1),
    ("gold answer mean log-prob",
     lambda r: r.get("gold", {}).get("heldout", {}).get("by_source", {}).get(HARD, {}).get("logp_mean"), 0.05),
)
def greedy_answer(response):
    """The integer in a response's last box ("-5", "−5", " 5 "), or None: model output, parsed, never evaluated."""
    found, _ = last_boxed(response or "")
    m = re.fullmatch(r"\s*([-−]?)\s*(\d{1,6})\s*\.?\s*", found or "")
    return None if m is None else (-1 if m.group(1) else 1) * int(m.group(2))


def answer_spread_lines(results, planned):
    """The v4 study's registered descriptive guards against a degenerate policy, per arm (mean over its
    registered runs): avg@16 on the positive held-out problems; of the hard held-out problems' greedy
    answers, the share that are the run's most common answer, the share of the right size whatever the
    sign, and the share right."""
    from data import load_jsonl

    answers = {p.id: int(p.answer) for p in load_jsonl("subtract-heldout")[0] if p.source == HARD}
    lines = ["Described (registered, no test): guards against a degenerate policy (a constant \\boxed{-1} scores "
             "1/9 on the hard level; negating every answer scores 0 on the positive one). Means over each arm's "
             "runs; greedy answers of the 45 hard held-out problems.", "",
             "| arm | runs | positive held-out avg@16 | most common answer's share | right size | right |",
             "|---|---|---|---|---|---|"]
    for arm in ["untrained", *planned]:
        runs = [r for r in results.get(arm, []) if arm == "untrained" or r["seed"] in planned[arm]]
        rows = [r.get("problems", {}).get(("final", "heldout"), {}) for r in runs]
        got = [{pid: greedy_answer(row.get("greedy_response")) for pid, row in table.items() if pid in answers}
               for table in rows]
        got = [g for g in got if g]
        if not runs or not got:
            continue
        common = [max(Counter(v for v in g.values() if v is not None).values(), default=0) / len(g) for g in got]
        size = [sum(v is not None and abs(v) == abs(answers[pid]) for pid, v in g.items()) / len(g) for g in got]
        right = [sum(v == answers[pid] for pid, v in g.items()) / len(g) for g in got]
        pos = [by_source(r, "heldout", "subtract-heldout/pos", "avg@16") for r in runs]
        pos = [x for x in pos if x is not None]
        lines.append(f"| {arm} | {len(got)} | " + (f"{statistics.mean(pos):.3f}" if pos else "-")
                     + f" | {statistics.mean(common):.3f} | {statistics.mean(size):.3f} | {statistics.mean(right):.3f} |")
    return lines + [""]


REGISTRATIONS = {  # pre-registration file -> what it fixed
    "docs/PREREGISTRATION.md": Registration(CONTRASTS, OUTCOMES, GEPA_ARMS),
    "docs/PREREGISTRATION-v4.md": Registration(STRATEGY_CONTRASTS, STRATEGY_OUTCOMES, (), learn_rate=False,
                                               multiplicity="per_contrast", exact_refutes=True,
                                               described=answer_spread_lines, test="paired"),
}
COUNT_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 9: "nine", 12: "twelve"}


def learn_threshold(untrained_rate, samples):
    """The fewest correct held-out samples (of `samples`) that the untrained model, correct at rate
    untrained_rate, reaches with probability <= LEARN_P (stats.binomial_tail)."""
    c = 0
    while binomial_tail(c, samples, untrained_rate) > LEARN_P:
        c += 1
    return c


def held_out_correct(run):
    """(correct samples, samples) of a run on the held-out set, from its per-problem rows."""
    rows = run.get("problems", {}).get(("final", "heldout"), {})
    return sum(r["correct"] for r in rows.values()), sum(r["k"] for r in rows.values())


def futile(arm, runs, seeds=None, gepa_arms=GEPA_ARMS):
    """The futility rule: a GEPA arm whose first two registered runs (by seed; seeds: the registered
    ones, None = any) kept no template is stopped."""
    first = sorted((r for r in runs if seeds is None or r["seed"] in seeds), key=lambda r: r["seed"])[:2]
    return arm in gepa_arms and len(first) == 2 and all(r["templates_assigned"] == 0 for r in first)


def verdict(test, adjusted, delta, sign, complete, reg=None):
    """confirmed / refuted / undecided / not tested (the pre-registration's rules, reg's where they differ)."""
    per_contrast = reg is not None and reg.multiplicity == "per_contrast"
    if adjusted is None:
        shut = "this contrast's earlier outcome was not confirmed" if per_contrast else \
            "an earlier outcome was not confirmed in full"
        return f"not tested ({shut})" if complete else "undecided (interim)"
    if not complete:
        return "undecided (interim)"
    if test["df"] is None:
        still = reg.no_spread if reg is not None else "neither arm varies"
        if reg is not None and reg.exact_refutes and abs(test["mean"]) < delta:
            return f"**refuted** ({still}: the difference is exactly {test['mean']:+.3g}, within ±{delta:g})"
        return f"undecided ({still})"
    if adjusted <= ALPHA:
        return "**confirmed**" if test["mean"] * sign > 0 else "**refuted** (the opposite sign)"
    if -delta < test["low"] and test["high"] < delta:
        return f"**refuted** (the interval lies within ±{delta:g})"
    return "undecided"


def confirm_report(task_name, results, planned, prereg, noise_rate, reg=None):
    """The confirmatory analysis of a task with a pre-registration (reg, default REGISTRATIONS[prereg]):
    {arm: [runs]} against the planned {arm: seeds}; noise_rate: the untrained model's highest held-out
    avg@16 over scoring seeds (the learn threshold's base; None without a learn-rate secondary).
    Markdown lines."""
    reg = reg or REGISTRATIONS[prereg]
    untrained = results.get("untrained", [])
    results = {arm: [r for r in results.get(arm, []) if r["seed"] in seeds] for arm, seeds in planned.items()}
    scored = {arm: {r["seed"] for r in runs if all(value(r) is not None for _, value, _ in reg.outcomes)}
              for arm, runs in results.items()}
    done = {arm: len(runs) for arm, runs in results.items()}
    stopped = [arm for arm in planned if futile(arm, results[arm], planned[arm], reg.gepa_arms)]
    complete = all(set(seeds) <= scored[arm] or arm in stopped for arm, seeds in planned.items())
    lines = [f"## {task_name}: the confirmatory study", "",
             f"Pre-registration: [{prereg}](../../{prereg}), committed before the first run (its git history shows "
             "when). Runs finished: " + ", ".join(f"{arm} {done[arm]} of {len(s)}" for arm, s in planned.items())
             + (". **Complete**: the verdicts below are the study's." if complete else
                ". **Interim**: until every planned run is in, no verdict is drawn (every one reads undecided)."),
             "", "Runs of other seeds in the folder take no part.", ""]
    recorded = deviations(prereg)
    lines += ["Deviations from the pre-registration, as recorded there (its section \"Deviations\", copied):", ""] \
        + ["> " + line if line else ">" for line in recorded] + [""] if recorded else \
        ["Deviations from the pre-registration recorded there: none.", ""]
    lines += registered_lines(reg, stopped)
    rows = contrast_rows(reg, results, stopped)
    for (name, a, b, test, data, delta), adj in zip(rows, adjust(reg, rows)):
        if test is None:
            lines.append(f"| {name} | {a} - {b} | - | - | - | - | - | - | - | "
                         + ("stopped (futility)" if a in stopped or b in stopped else "undecided (too few runs)") + " |")
            continue
        va, vb, pair = data
        lines.append(f"| {name} | {a} - {b} | {len(va)} : {len(vb)} | {statistics.mean(va.values()):+.3f} : "
                     f"{statistics.mean(vb.values()):+.3f} | {test['mean']:+.3f} | "
                     f"{fmt_interval((test['low'], test['high']))} | "
                     + ("-" if test["df"] is None else fmt_p(test["p"])) + " | "
                     + ("-" if adj is None else fmt_p(adj)) + f" | {fmt_interval(pair)} | "
                     + verdict(test, adj, delta, +1, complete, reg) + " |")
    lines += [""] + (reg.described(results | {"untrained": untrained}, planned) if reg.described else [])
    if not reg.learn_rate:
        return lines
    return lines + learn_lines(results | {"untrained": untrained}, planned, noise_rate, stopped, complete,
                                      reg.contrasts)


def registered_lines(reg, stopped):
    """What the registration fixed, the futility rule's outcome, and the analysis in words, then the table's head."""
    n, tests = COUNT_WORDS[len(reg.contrasts)], COUNT_WORDS[len(reg.contrasts) * len(reg.outcomes)]
    lines = ["Registered: the outcomes in this order, " + "; ".join(
        f"{name} (smallest effect of interest ±{delta:g})" for name, _, delta in reg.outcomes)
        + "; the contrasts " + ", ".join(f"{a} - {b}" for a, b in reg.contrasts) + ", each predicted > 0; "
        + (f"the futility rule on {', '.join(reg.gepa_arms)}" if reg.gepa_arms else "no futility rule")
        + (f"; the learn rate's threshold at p <= {LEARN_P} under the untrained rate." if reg.learn_rate else "."), ""]
    if stopped:
        lines += [f"Stopped by the futility rule (their first two runs kept no template; reported as GRPO (K)): "
                  f"{', '.join(stopped)}. Their contrasts are not tested and count as not confirmed, so no later "
                  "outcome is tested.", ""]
    if reg.multiplicity == "per_contrast":
        test = ("the paired t-test over the seeds both arms ran (the arms share each seed's random numbers)"
                if reg.test == "paired" else "Welch's unpaired test (df rounded down)")
        how = (f"{test}, each contrast a fixed sequence over the outcomes in order "
               f"(the next only when this one is confirmed with its predicted sign), every test at 0.05 / "
               f"{len(reg.contrasts)} (Bonferroni over the {n} contrasts; adjusted p = {len(reg.contrasts)} p)")
    else:
        how = (f"each outcome a family of the {n} contrasts, Welch's unpaired test (df rounded down), Holm within the "
               f"family at 0.05, the families in order (serial gatekeeping: the next only when all {n} of this one "
               "are confirmed with their predicted sign)")
    exact = (f" Where {reg.no_spread} there is no test (p shown as -, never confirmed); the difference is then "
             "exact, and refutes when it lies inside ± the smallest effect of interest.") if reg.exact_refutes else ""
    if reg.test == "paired":
        return lines + [f"Primary analysis: {how}. Refuted by the interval: the unadjusted paired 95% interval "
                        "inside ± the smallest effect of interest (only false confirmations are held to 0.05 over the "
                        f"{tests}).{exact} Beside it, for reference: Welch's unpaired interval.", "",
                        "| outcome | contrast (predicted > 0) | runs | means | difference | paired 95% | p | adjusted p "
                        "| Welch 95% | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    return lines + [f"Primary analysis: {how}. Refuted by the interval: the "
                    "unadjusted Welch 95% interval inside ± the smallest effect of interest (only false confirmations "
                    f"are held to 0.05 over the {tests}).{exact} Paired: the t-interval over the seeds both arms ran.",
                    "", "| outcome | contrast (predicted > 0) | runs | means | difference | Welch 95% | p | adjusted p | "
                    "paired 95% | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]


def contrast_rows(reg, results, stopped):
    """[(outcome, arm, other arm, the registered test or None, (values by seed, other's values, the other test's
    interval shown beside it), delta)] in outcome-major order."""
    rows = []
    for name, value, delta in reg.outcomes:
        for a, b in reg.contrasts:
            if a in stopped or b in stopped:
                rows.append((name, a, b, None, None, delta))
                continue
            va = {r["seed"]: value(r) for r in results.get(a, []) if value(r) is not None}
            vb = {r["seed"]: value(r) for r in results.get(b, []) if value(r) is not None}
            unpaired = welch(list(va.values()), list(vb.values())) if len(va) >= 2 and len(vb) >= 2 else None
            common = sorted(va.keys() & vb.keys())
            if reg.test == "paired":
                test = paired_test([va[s] - vb[s] for s in common]) if len(common) >= 2 else None
                beside = (unpaired["low"], unpaired["high"]) if unpaired else None
            else:
                test = unpaired
                beside = t_interval([va[s] - vb[s] for s in common])[1:] if len(common) >= 2 else None
            rows.append((name, a, b, test, (va, vb, beside), delta))
    return rows


def adjust(reg, rows):
    """The adjusted p of every row (None: not tested) under the registration's multiplicity rule. A row without
    spread (no test) enters with p 1 (stats.deciding_p): it is counted, and can never be confirmed or open a gate."""
    m = len(reg.contrasts)
    ps = [None if test is None else deciding_p(test) for _, _, _, test, _, _ in rows]
    good = [test is not None and test["mean"] > 0 for _, _, _, test, _, _ in rows]
    families = [ps[i:i + m] for i in range(0, len(ps), m)]
    signs = [good[i:i + m] for i in range(0, len(good), m)]
    if reg.multiplicity == "per_contrast":  # chains are the columns of the outcome-major families
        chains = fixed_sequences([list(c) for c in zip(*families)], ALPHA, [list(c) for c in zip(*signs)])
        return [chains[c][o] for o in range(len(families)) for c in range(m)]
    return [p for family in gatekeep(families, ALPHA, signs) for p in family]


def fmt_p(p):
    """Two significant digits, trailing zeros kept (0.50, not 0.5)."""
    return f"{p:#.2g}"


def deviations(prereg):
    """The lines of the pre-registration's "## Deviations" section (blank edges dropped), read from
    the repository; [] when the file or the section is absent."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), prereg)
    if not prereg or not os.path.isfile(path):
        return []
    section, inside = [], False
    with open(path) as f:
        for line in f.read().splitlines():
            if line.startswith("## "):
                inside = line.strip() == "## Deviations"
            elif inside:
                section.append(line.rstrip())
    while section and not section[0]:
        section.pop(0)
    while section and not section[-1]:
        section.pop()
    return section


def learn_lines(results, planned, noise_rate, stopped, complete=True, contrasts=CONTRASTS):
    """The learn-rate secondary: runs whose held-out correct count the untrained model would reach
    with p <= LEARN_P, per arm, and Barnard's test per contrast (Holm over the three); labelled
    interim until the study is complete."""
    counts = {}
    for arm in planned:
        got = [held_out_correct(r) for r in results.get(arm, [])]
        got = [(c, n) for c, n in got if n]
        if got:
            threshold = learn_threshold(noise_rate, got[0][1])
            counts[arm] = (sum(c >= threshold for c, _ in got), len(got), threshold, got[0][1])
    if not counts:
        return []
    lines = ["Secondary, the learn rate: a run learnt the held-out rule when its held-out correct samples reach a "
             f"count the untrained model (rate {noise_rate:.4f}, its highest over the committed scoring-noise seeds, "
             f"fixed in advance) reaches with "
             f"p <= {LEARN_P}; Barnard's exact test (two-sided, pooled), Holm over the contrasts:", "",
             "| arm | learnt | threshold |", "|---|---|---|"]
    lines += [f"| {arm} | {x} of {n} | {c} of {m} samples |" for arm, (x, n, c, m) in counts.items()]
    if results.get("untrained"):
        c, m = held_out_correct(results["untrained"][0])
        lines.append(f"| untrained (this scoring's draw) | {c} correct of {m} samples | - |")
    tests = [(a, b, barnard(counts[a][0], counts[a][1], counts[b][0], counts[b][1]))
             for a, b in contrasts if a in counts and b in counts and a not in stopped and b not in stopped]
    adjusted = holm([p for _, _, (_, p) in tests])
    lines += ["", "Interim (not every registered run is in):" if not complete else "Complete:", "",
              "| contrast | learnt | Barnard p | Holm-adjusted p |", "|---|---|---|---|"]
    lines += [f"| {a} - {b} | {counts[a][0]}/{counts[a][1]} vs {counts[b][0]}/{counts[b][1]} | {p:.3g} | {adj:.3g} |"
              for (a, b, (_, p)), adj in zip(tests, adjusted)]
    return lines + [""]
