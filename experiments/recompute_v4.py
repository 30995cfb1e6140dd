"""An independent recomputation of the v4 study's confirmatory table (docs/PREREGISTRATION-v4.md).

    python experiments/recompute_v4.py [--out=results/subtract] [--seeds=200-209]

What it checks, reading only the per-run files (OUT/subtract/<arm>/seed-<s>/{result.json,
problems.jsonl, gold.jsonl}, OUT/subtract/untrained/) and OUT/report.md:

- each run's three outcomes on the hard held-out level (subtract-heldout/neg): avg@16 and pass@16
  from result.json against the same recomputed from problems.jsonl, the gold answer mean log-prob
  against gold.jsonl (and the positive level's avg@16, which the guard table shows); any difference
  beyond 1e-9 is flagged;
- the four contrasts x three outcomes as the pre-registration words them: the paired t-test over the
  seeds both arms ran (per-seed differences a - b, df = n - 1, two-sided; fewer than two shared seeds:
  "too few runs"), adjusted p = min(1, 4p), one fixed sequence per contrast over avg@16 -> pass@16 ->
  gold, "the paired differences do not vary" (no test, counted as p = 1, the difference exact), the
  verdicts on the paired interval, "interim" until every registered run is in; each arm's mean over all
  its runs, and beside the test Welch's unpaired interval (df Welch-Satterthwaite rounded down, >= 1);
- the described guard table (positive held-out avg@16; of the 45 hard problems' greedy answers the
  most common answer's share, the share of the right size, the share right);
- then every cell of report.md's confirmatory and guard tables against these, formatted alike.

Exit status 1 on any disagreement, 0 otherwise. It shares no code with experiments/report.py,
stats.py or compare.py: the Student-t distribution is its own (a regularized incomplete beta
by continued fraction), and so is everything else but the data loader and the box finder.
"""

import argparse
import json
import math
import os
import re
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data import load_jsonl  # noqa: E402
from verify import last_boxed  # noqa: E402

PREREG = os.path.join(ROOT, "docs", "PREREGISTRATION-v4.md")
ARMS = ("grpo_k", "p2o_human", "p2o_human_no_crm", "rs_distill")
CONTRASTS = (("p2o_human", "grpo_k"), ("p2o_human_no_crm", "grpo_k"), ("rs_distill", "grpo_k"),
             ("p2o_human_no_crm", "p2o_human"))
OUTCOMES = (("held-out avg@16", 0.02), ("held-out pass@16", 0.10), ("gold answer mean log-prob", 0.05))
HARD, POS = "subtract-heldout/neg", "subtract-heldout/pos"
PREFIX = {HARD: "subtract-heldout-neg", POS: "subtract-heldout-pos"}
ALPHA, TESTS = 0.05, len(CONTRASTS)
DEFAULT_SEEDS = "200-209"
COLUMNS = ("runs", "means", "difference", "paired 95%", "p", "adjusted p", "Welch 95%", "verdict")
GUARD_COLUMNS = ("runs", "positive held-out avg@16", "most common answer's share", "right size", "right")
NUMBER = re.compile(r"[+-]?\d+(?:\.\d*)?(?:e[+-]?\d+)?")


# ----------------------------------------------------------------------------- Student's t, from scratch

def beta_fraction(a, b, x, tiny=1e-300, eps=1e-16):
    """1 + d1/(1 + d2/(1 + ...)), the continued fraction of I_x(a, b) (modified Lentz)."""
    value, c, d = 1.0, 1.0, 0.0
    for n in range(1, 10_000):
        m = n // 2
        if n % 2:
            term = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:
            term = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + term * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + term / c
        c = c if abs(c) > tiny else tiny
        value *= c * d
        if abs(c * d - 1.0) < eps:
            return value
    raise ArithmeticError("the incomplete beta's continued fraction did not converge")


def incomplete_beta(a, b, x):
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast only below this point
        return 1.0 - incomplete_beta(b, a, 1.0 - x)
    log_front = a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    return math.exp(log_front) / a / beta_fraction(a, b, x)


def t_two_sided(t, df):
    """P(|T| >= |t|) for Student's T on df degrees of freedom."""
    return incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q, df):
    """The q quantile (0.5 < q < 1) of Student's t on df degrees of freedom, by bisection."""
    target = 2.0 * (1.0 - q)
    low, high = 0.0, 1.0
    while t_two_sided(high, df) > target:
        low, high = high, 2.0 * high
    for _ in range(200):
        mid = (low + high) / 2.0
        low, high = (mid, high) if t_two_sided(mid, df) > target else (low, mid)
    return (low + high) / 2.0


# ----------------------------------------------------------------------------- the tests

def mean(xs):
    return math.fsum(xs) / len(xs)


def variance(xs):
    m = mean(xs)
    return math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def constant(xs):
    return max(xs) - min(xs) <= 1e-12 * max(1.0, max(abs(x) for x in xs))


def welch(a, b):
    """{"diff", "low", "high", "p", "df"}: Welch's unpaired test of mean(a) - mean(b), 95% interval.
    Neither arm varying: no test (p and df None), the difference exact, the interval that point."""
    diff = mean(a) - mean(b)
    if constant(a) and constant(b):
        return {"diff": diff, "low": diff, "high": diff, "p": None, "df": None}
    va, vb = variance(a) / len(a), variance(b) / len(b)
    exact_df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    df = max(1, math.floor(exact_df + 1e-9))  # rounded down; float noise must not lose an integer
    se = math.sqrt(va + vb)
    half = t_quantile(0.975, df) * se
    return {"diff": diff, "low": diff - half, "high": diff + half, "p": t_two_sided(diff / se, df), "df": df}


def paired_test(diffs):
    """{"diff", "low", "high", "p", "df"}: the paired t-test of per-seed differences a - b (>= 2 of them),
    df = n - 1, two-sided p, 95% interval; None below two. Differences that do not vary (up to 1e-12
    relative): no test (p and df None), the difference exact (0 when it is 0 up to that rounding), the
    interval that point."""
    if len(diffs) < 2:
        return None
    m = mean(diffs)
    if constant(diffs):
        tiny = 1e-12 * max(1.0, max(abs(d) for d in diffs))
        return {"diff": 0.0 if abs(m) <= tiny else m, "low": m, "high": m, "p": None, "df": None}
    df, se = len(diffs) - 1, math.sqrt(variance(diffs) / len(diffs))
    half = t_quantile(0.975, df) * se
    return {"diff": m, "low": m - half, "high": m + half, "p": t_two_sided(m / se, df), "df": df}


def verdict(test, adjusted, delta, complete):
    """The pre-registration's verdict of one (contrast, outcome)."""
    if test is None:
        return "undecided (too few runs)"
    if not complete:
        return "undecided (interim)"
    if adjusted is None:
        return "not tested (this contrast's earlier outcome was not confirmed)"
    if test["df"] is None:
        if abs(test["diff"]) < delta:
            return (f"**refuted** (the paired differences do not vary: the difference is exactly "
                    f"{test['diff']:+.3g}, within ±{delta:g})")
        return "undecided (the paired differences do not vary)"
    if adjusted <= ALPHA:
        return "**confirmed**" if test["diff"] > 0 else "**refuted** (the opposite sign)"
    if -delta < test["low"] and test["high"] < delta:
        return f"**refuted** (the interval lies within ±{delta:g})"
    return "undecided"


def signed(x):
    return f"{x:+.3f}"


def p_cell(p):
    """Two significant digits, trailing zeros kept (report.md's form)."""
    return ("-", None) if p is None else (f"{p:#.2g}", (p,))


def interval_cell(iv):
    if iv is None:
        return "-", None
    if iv[1] - iv[0] < 1e-12:
        return "no spread", None
    return f"[{signed(iv[0])}, {signed(iv[1])}]", tuple(iv)


def contrast_cells(values, complete):
    """{(outcome, "a - b"): {column: (shown, its numbers or None)}}: values {outcome: {arm: {seed: value}}};
    each contrast one fixed sequence over the outcomes, in the registered order, tested paired over the
    seeds both arms ran (fewer than two: no test, and the sequence stops)."""
    table = {}
    for a, b in CONTRASTS:
        going = True
        for name, delta in OUTCOMES:
            va, vb = values[name][a], values[name][b]
            shared = sorted(va.keys() & vb.keys())
            test = paired_test([va[s] - vb[s] for s in shared])
            if test is None:
                table[name, f"{a} - {b}"] = dict.fromkeys(COLUMNS[:-1], ("-", None)) | {
                    "verdict": (verdict(None, None, delta, complete), None)}
                going = False
                continue
            adjusted = min(1.0, TESTS * (1.0 if test["p"] is None else test["p"])) if going else None
            going = adjusted is not None and adjusted <= ALPHA and test["diff"] > 0
            ma, mb = mean(list(va.values())), mean(list(vb.values()))
            unpaired = welch(list(va.values()), list(vb.values())) if len(va) >= 2 and len(vb) >= 2 else None
            table[name, f"{a} - {b}"] = {
                "runs": (f"{len(va)} : {len(vb)}", None), "means": (f"{signed(ma)} : {signed(mb)}", (ma, mb)),
                "difference": (signed(test["diff"]), (test["diff"],)),
                "paired 95%": interval_cell((test["low"], test["high"])), "p": p_cell(test["p"]),
                "adjusted p": p_cell(adjusted),
                "Welch 95%": interval_cell(unpaired and (unpaired["low"], unpaired["high"])),
                "verdict": (verdict(test, adjusted, delta, complete), None)}
    return table


# ----------------------------------------------------------------------------- the runs

def read_json(path):
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_jsonl(path):
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def dig(tree, *keys):
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def load_run(run_dir):
    """{"result", "heldout": {id: row} of the final checkpoint or None, "gold": rows or None}, or None."""
    result = read_json(os.path.join(run_dir, "result.json"))
    if result is None:
        return None
    rows = read_jsonl(os.path.join(run_dir, "problems.jsonl"))
    final = [r for r in rows or [] if (r["set"], r["checkpoint"]) == ("heldout", "final")]
    heldout = None if rows is None else {r["id"]: r for r in final}
    return {"result": result, "heldout": heldout, "gold": read_jsonl(os.path.join(run_dir, "gold.jsonl"))}


def stored(run, source, key):
    """A score of one level as result.json gives it."""
    if key == "logp_mean":
        return dig(run["result"], "gold", "heldout", "by_source", source, "logp_mean")
    return dig(run["result"], "sets", "final", "heldout", "by_source", source, key)


def outcomes(run):
    keys = ("avg@16", "pass@16", "logp_mean")  # in the order of OUTCOMES
    return {name: stored(run, HARD, key) for (name, _), key in zip(OUTCOMES, keys)}


def level_rows(run, source):
    return [r for pid, r in sorted((run["heldout"] or {}).items()) if pid.startswith(PREFIX[source])]


def recomputed(run, source):
    """{"avg@16", "pass@16", "logp_mean"} of one level from problems.jsonl and gold.jsonl (None where absent)."""
    rows = level_rows(run, source)
    ok = rows and all(r["k"] for r in rows)
    gold = [r["logp_mean"] for r in run["gold"] or [] if r["id"].startswith(PREFIX[source])]
    return {"avg@16": mean([r["correct"] / r["k"] for r in rows]) if ok else None,
            "pass@16": mean([float(r["correct"] > 0) for r in rows]) if ok else None,
            "logp_mean": mean(gold) if gold else None}


def row_issues(name, run):
    """Where a run's result.json and its per-problem rows disagree (beyond 1e-9), or one lacks a number."""
    issues = []
    checks = [(HARD, "avg@16"), (HARD, "pass@16"), (HARD, "logp_mean"), (POS, "avg@16")]
    for source, key in checks:
        given, again = stored(run, source, key), recomputed(run, source)[key]
        if given is None and again is None:
            continue
        if given is None or again is None or abs(given - again) > 1e-9:
            issues.append(f"{name}: {source} {key}: result.json {given!r}, per-problem rows {again!r}")
    hard = len(level_rows(run, HARD))
    if run["heldout"] is not None and hard != 45:
        issues.append(f"{name}: {hard} hard held-out problems in problems.jsonl, not 45")
    return issues


# ----------------------------------------------------------------------------- the guard table

def boxed_integer(response):
    """The integer in a response's last box ("-5", "−5", " 5 ", "-5."), or None; parsed, never evaluated."""
    found, _ = last_boxed(response or "")
    text = (found or "").strip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    negative = text[:1] in ("-", "\u2212")
    digits = text[1:].lstrip() if negative else text
    if not digits or any(c not in "0123456789" for c in digits):
        return None
    return -int(digits) if negative else int(digits)


def greedy_shares(run, answers):
    """(most common answer's share, right size, right) over a run's hard greedy answers, or None."""
    got = {pid: boxed_integer(row.get("greedy_response")) for pid, row in (run["heldout"] or {}).items()
           if pid in answers}
    if not got:
        return None
    counts = Counter(v for v in got.values() if v is not None)
    common = max(counts.values(), default=0)
    size = sum(v is not None and abs(v) == abs(answers[pid]) for pid, v in got.items())
    right = sum(v == answers[pid] for pid, v in got.items())
    return common / len(got), size / len(got), right / len(got)


def guard_cells(runs, untrained, answers):
    """{arm: {column: (shown, numbers)}}: means over each arm's registered runs (the untrained model first)."""
    table = {}
    arms = [("untrained", [untrained] if untrained else [])] + [(arm, list(runs[arm].values())) for arm in ARMS]
    for arm, arm_runs in arms:
        shares = [s for s in (greedy_shares(run, answers) for run in arm_runs) if s]
        if not shares:
            continue
        pos = [v for v in (stored(run, POS, "avg@16") for run in arm_runs) if v is not None]
        common, size, right = (mean(column) for column in zip(*shares))
        table[arm] = {"runs": (str(len(arm_runs)), None),
                      "positive held-out avg@16": (f"{mean(pos):.3f}", (mean(pos),)) if pos else ("-", None),
                      "most common answer's share": (f"{common:.3f}", (common,)),
                      "right size": (f"{size:.3f}", (size,)), "right": (f"{right:.3f}", (right,))}
    return table


def hard_answers():
    return {p.id: int(p.answer) for p in load_jsonl("subtract-heldout")[0] if p.source == HARD}


# ----------------------------------------------------------------------------- report.md against these

def read_report(path):
    """report.md's {"header": ..., "confirm": {(outcome, contrast): cells}, "guard": {arm: cells}} ({} if absent)."""
    tables = {"header": {}, "confirm": {}, "guard": {}}
    if not os.path.isfile(path):
        return tables
    names, in_guard, inside = {name for name, _ in OUTCOMES}, False, False
    with open(path) as f:
        for line in f.read().splitlines():
            if line.startswith("## "):  # only the subtract task's confirmatory section
                inside = line.strip() == "## subtract: the confirmatory study"
            if not inside:
                continue
            found = re.search(r"Runs finished: (.*?)\. \*\*(Complete|Interim)\*\*", line)
            if found:
                tables["header"]["study"] = {"runs finished": found.group(1), "status": found.group(2)}
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
            if cells and cells[0] in names and len(cells) == 2 + len(COLUMNS):
                tables["confirm"][cells[0], cells[1]] = dict(zip(COLUMNS, cells[2:]))
            if line.startswith("| arm | runs | positive held-out avg@16 |"):
                in_guard = True
            elif in_guard and not cells:
                in_guard = False
            elif in_guard and not cells[0].startswith("---"):
                tables["guard"][cells[0]] = dict(zip(GUARD_COLUMNS, cells[1:]))
    return tables


def half_unit(token):
    """Half the last shown digit's unit of a number as printed ("0.0080": 0.00005; "1.2e-05": 5e-07)."""
    mantissa, _, exponent = token.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def agrees(theirs, shown, numbers):
    """A cell agrees when it reads the same, or (numbers given) differs only in the rounding of numbers
    that lie within half a shown unit (+ 1e-9) of the recomputed ones."""
    if theirs == shown:
        return True
    if numbers is None or NUMBER.sub("#", theirs) != NUMBER.sub("#", shown):
        return False
    tokens = NUMBER.findall(theirs)
    return len(tokens) == len(numbers) and all(
        abs(float(t) - x) <= half_unit(t) + 1e-9 * max(1.0, abs(x)) for t, x in zip(tokens, numbers))


def disagreements(what, mine, theirs):
    """One line per cell of a table that report.md shows otherwise (or a row only one side has)."""
    out = []
    for key in sorted(mine.keys() | theirs.keys(), key=str):
        row = " / ".join(key) if isinstance(key, tuple) else key
        if key not in theirs or key not in mine:
            out.append(f"{what} {row}: " + ("missing from report.md" if key not in theirs else "in report.md only"))
            continue
        for column, (shown, numbers) in mine[key].items():
            if not agrees(theirs[key].get(column, "<absent>"), shown, numbers):
                out.append(f"{what} {row} | {column}: report.md {theirs[key].get(column, '<absent>')!r}, "
                           f"recomputed {shown!r}")
    return out


# ----------------------------------------------------------------------------- the command

def parse_seeds(spec):
    """ "200-209" or "200,203,205-207" (an en dash works too) -> sorted seeds."""
    seeds = set()
    for part in spec.replace("\u2013", "-").replace(" ", "").split(","):
        first, _, last = part.partition("-")
        seeds.update(range(int(first), int(last or first) + 1))
    return sorted(seeds)


def registered_seeds(spec, prereg=PREREG):
    """(seeds of every arm, where they came from): --seeds, else the pre-registration's "Seeds" line when its
    first sentence is a plain list or range, alone or "for every arm" (a remark may follow), else the
    default 200-209."""
    if spec:
        return parse_seeds(spec), "--seeds"
    line = ""
    if os.path.isfile(prereg):
        with open(prereg) as f:
            line = next((x for x in f if x.lstrip("- ").startswith("**Seeds**")), "")
    first = line.partition(":")[2].partition(".")[0].strip()
    plain = re.fullmatch(r"(\d+(?:\s*[-\u2013,]\s*\d+)*)(?:\s*|\s+for every arm(?:\W.*)?)", first)
    if plain:
        return parse_seeds(plain.group(1)), "the pre-registration's Seeds line"
    return parse_seeds(DEFAULT_SEEDS), f"the default (the pre-registration's Seeds line reads {first!r})"


def show(table, head):
    """Markdown rows of a table of (shown, numbers) cells, keyed as report.md keys them."""
    label = lambda key: " | ".join(key) if isinstance(key, tuple) else key  # noqa: E731
    return [head] + [f"| {label(key)} | " + " | ".join(shown for shown, _ in cells.values()) + " |"
                     for key, cells in table.items()]


def recompute(study, seeds):
    """(my tables {"header", "confirm", "guard"} as report.md keys them, per-run row mismatches)."""
    runs = {arm: {} for arm in ARMS}
    for arm in ARMS:
        for seed in seeds:
            run = load_run(os.path.join(study, arm, f"seed-{seed}"))
            if run is not None:
                runs[arm][seed] = run
    untrained = load_run(os.path.join(study, "untrained"))
    issues = [i for arm in ARMS for seed, run in runs[arm].items() for i in row_issues(f"{arm} seed {seed}", run)]
    issues += row_issues("untrained", untrained) if untrained else []
    values = {name: {arm: {seed: v for seed, run in runs[arm].items() if (v := outcomes(run)[name]) is not None}
                     for arm in ARMS} for name, _ in OUTCOMES}
    complete = all(len(values[name][arm]) == len(seeds) for name, _ in OUTCOMES for arm in ARMS)
    finished = ", ".join(f"{arm} {len(runs[arm])} of {len(seeds)}" for arm in ARMS)
    cells = contrast_cells(values, complete)
    return {"header": {"study": {"runs finished": (finished, None),
                                 "status": ("Complete" if complete else "Interim", None)}},
            "confirm": {(name, f"{a} - {b}"): cells[name, f"{a} - {b}"] for name, _ in OUTCOMES for a, b in CONTRASTS},
            "guard": guard_cells(runs, untrained, hard_answers())}, issues


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/subtract", help="the study folder (runs under OUT/subtract/)")
    ap.add_argument("--seeds", default="", help="registered seeds of every arm, e.g. 200-209 or 200,202-205")
    args = ap.parse_args(argv)
    seeds, origin = registered_seeds(args.seeds)
    study = os.path.join(args.out, "subtract")
    mine, issues = recompute(study, seeds)
    header = mine["header"]["study"]
    print(f"Registered seeds ({origin}): {seeds[0]}..{seeds[-1]} ({len(seeds)}) for every arm; runs in {study}")
    print(f"Runs finished: {header['runs finished'][0]}. {header['status'][0]}.\n")
    print("\n".join(show(mine["confirm"], "| outcome | contrast | " + " | ".join(COLUMNS) + " |")) + "\n")
    print("\n".join(show(mine["guard"], "| arm | " + " | ".join(GUARD_COLUMNS) + " |")) + "\n")
    path = os.path.join(args.out, "report.md")
    theirs = read_report(path)
    found = [] if os.path.isfile(path) else [f"DISAGREE {path}: no such file"]
    found += [f"DISAGREE {line}" for what in ("header", "confirm", "guard")
              for line in disagreements(what, mine[what], theirs[what])]
    for line in [f"ROWS {i}" for i in issues] + found:
        print(line)
    print(f"{len(issues)} per-run mismatches between result.json and the per-problem rows; "
          f"{len(found)} cells of {path} disagree")
    return 1 if issues or found else 0


if __name__ == "__main__":
    sys.exit(main())
