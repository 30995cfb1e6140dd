"""experiments/recompute_v4.py: its Student-t against hand values, and its recomputation of a synthetic v4 study
against the report that the repository's own code (experiments/report.py, imported here only) writes for it."""

import json
import os
import random
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import recompute_v4 as rc  # noqa: E402
from data import load_jsonl  # noqa: E402

SEEDS = (200, 201, 202)
# hard-level rate of a correct sample: grpo_k and p2o_human never solve one (on avg@16 neither arm varies, nor do
# their paired differences)
RATES = {"grpo_k": 0.0, "p2o_human": 0.0, "p2o_human_no_crm": 0.3, "rs_distill": 0.05}
GOLD = {"grpo_k": -1.0, "p2o_human": -0.9, "p2o_human_no_crm": -0.6, "rs_distill": -1.0}


def test_student_t_against_hand_values():
    assert rc.t_two_sided(4.898979, 4) == pytest.approx(0.0080499, abs=2e-7)
    assert rc.t_quantile(0.975, 4) == pytest.approx(2.776445, abs=1e-6)
    assert rc.t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-4)
    assert rc.t_quantile(0.975, 30) == pytest.approx(2.0423, abs=1e-4)
    assert rc.t_two_sided(1.0, 1) == pytest.approx(0.5, abs=1e-12)  # Cauchy: P(|T| > 1) = 1/2
    assert rc.t_two_sided(0.0, 7) == 1.0
    assert rc.t_quantile(0.975, 100_000) == pytest.approx(1.959985, abs=1e-5)


def test_welch_and_paired_by_hand():
    # 0.05 - 0.01, se 0.008165, Welch df 4.8 -> 4: [+0.017, +0.063], p 0.00805
    w = rc.welch([0.04, 0.06, 0.05], [0.0, 0.02, 0.0, 0.02])
    assert w["df"] == 4 and w["diff"] == pytest.approx(0.04)
    assert (w["low"], w["high"], w["p"]) == pytest.approx((0.01733, 0.06267, 0.0080499), abs=1e-5)
    assert rc.welch([0.0] * 3, [0.0] * 4) == {"diff": 0.0, "low": 0.0, "high": 0.0, "p": None, "df": None}
    assert rc.welch([0.0] * 3, [0.1, 0.2, 0.3])["df"] == 2  # one arm constant: the other's n - 1
    # equal variances and sizes: exactly 2 (n - 1) = 4, which float noise must not round down to 3
    assert rc.welch([13 / 720, 41 / 720, 59 / 720], [8 / 720, 36 / 720, 54 / 720])["df"] == 4
    t = rc.paired_test([1.0, 2.0, 3.0])  # mean 2, sd 1, t(0.975, 2) 4.3027
    assert (t["low"], t["high"]) == pytest.approx((2 - 4.302653 / 3 ** 0.5, 2 + 4.302653 / 3 ** 0.5), abs=1e-5)
    # differences 0.04, 0.04, 0.05: mean 0.04333, sd 0.005774, se 0.003333, t = 13 on 2 df; two-sided p (closed
    # form for 2 df) 1 - t / sqrt(t^2 + 2) = 0.005865; interval 0.04333 -/+ 4.302653 x 0.003333
    t = rc.paired_test([0.04, 0.04, 0.05])
    assert t["df"] == 2 and t["diff"] == pytest.approx(0.13 / 3)
    assert t["p"] == pytest.approx(1 - 13 / 171 ** 0.5, abs=1e-9)
    assert (t["low"], t["high"]) == pytest.approx((0.13 / 3 - 4.302653 / 300, 0.13 / 3 + 4.302653 / 300), abs=1e-7)
    # differences that do not vary: no test, the difference exact (0 when it is 0 up to rounding)
    assert rc.paired_test([0.1, 0.1, 0.11 - 0.01]) == {"diff": pytest.approx(0.1), "low": pytest.approx(0.1),
                                                       "high": pytest.approx(0.1), "p": None, "df": None}
    assert rc.paired_test([1e-17, 0.0, -1e-17])["diff"] == 0.0
    assert rc.paired_test([0.3]) is None  # one shared seed: no test


def test_contrast_cells_pair_the_shared_seeds_and_average_every_run():
    # grpo_k 0, 0, 0.01; p2o_human 0.04, 0.04, 0.06: differences 0.04, 0.04, 0.05 (the hand case above); the
    # unmasked arm shares no seed with grpo_k or p2o_human (2 runs each): too few runs; rs_distill has a fourth
    # seed that its mean counts and the paired difference (0.1 on every shared seed: no spread) does not
    arms = {"grpo_k": {200: 0.0, 201: 0.0, 202: 0.01}, "p2o_human": {200: 0.04, 201: 0.04, 202: 0.06},
            "p2o_human_no_crm": {203: 0.5, 204: 0.5}, "rs_distill": {200: 0.1, 201: 0.1, 202: 0.11, 205: 0.5}}
    cells = rc.contrast_cells({name: arms for name, _ in rc.OUTCOMES}, complete=True)
    shown = lambda key: " | ".join(v for v, _ in cells[key].values())  # noqa: E731
    # adjusted 4 x 0.005865 = 0.023; Welch beside it: 0.04667 - 0.00333, se sqrt(1.333e-4/3 + 3.333e-5/3) 0.007454,
    # df (5e-5)^2 / ((4.444e-5)^2 / 2 + (1.111e-5)^2 / 2) = 2.35 -> 2, t 4.3027: [+0.011, +0.075]
    assert shown(("held-out avg@16", "p2o_human - grpo_k")) == (
        "3 : 3 | +0.047 : +0.003 | +0.043 | [+0.029, +0.058] | 0.0059 | 0.023 | [+0.011, +0.075] | **confirmed**")
    assert shown(("gold answer mean log-prob", "p2o_human - grpo_k")).endswith("**confirmed**")  # its chain goes on
    assert shown(("held-out avg@16", "p2o_human_no_crm - grpo_k")) == "- | - | - | - | - | - | - | undecided (too few runs)"
    assert shown(("held-out pass@16", "p2o_human_no_crm - p2o_human")).endswith("undecided (too few runs)")
    assert shown(("held-out avg@16", "rs_distill - grpo_k")).startswith("4 : 3 | +0.203 : +0.003 | +0.100 | no spread | - | 1.0 | [")
    assert shown(("held-out avg@16", "rs_distill - grpo_k")).endswith("undecided (the paired differences do not vary)")
    assert shown(("held-out pass@16", "rs_distill - grpo_k")).endswith(
        "not tested (this contrast's earlier outcome was not confirmed)")
    assert rc.contrast_cells({name: arms for name, _ in rc.OUTCOMES}, complete=False)[
        "held-out avg@16", "p2o_human - grpo_k"]["verdict"] == ("undecided (interim)", None)


def test_boxed_answers_are_parsed_never_evaluated():
    got = [rc.boxed_integer(t) for t in ("2 − 7 = -5. The answer is \\boxed{-5}.", "\\boxed{−5}", "\\boxed{ 5 }",
                                         "\\boxed{-5.}", "\\boxed{x}", "no box", "\\boxed{2+3}", None, "\\boxed{²}")]
    assert got == [-5, -5, 5, -5, None, None, None, None, None]


def write_run(run_dir, arm, seed, rate, gold_level, spread=0.03, twin=None, gold_exact=None):
    """A run's result.json, problems.jsonl and gold.jsonl, the summaries computed from the rows; spread:
    the sd of the run's gold log-prob offset; twin: the arm whose run of this seed it repeats draw for draw;
    gold_exact: every problem's gold log-prob (the same draws made, then set aside)."""
    rng = random.Random(f"{twin or arm}-{seed}")
    rows, gold = [], []
    offset = rng.gauss(0.0, spread)
    for p in load_jsonl("subtract-heldout")[0]:
        hard, answer = p.source == rc.HARD, int(p.answer)
        correct = sum(rng.random() < (rate if hard else 0.4) for _ in range(16))
        reply = rng.choice([f"The answer is \\boxed{{{answer}}}.", f"\\boxed{{{-answer}}}", "\\boxed{-1}",
                            "\\boxed{x}", "no box", "\\boxed{−3.}"])
        rows.append({"set": "heldout", "templated": False, "id": p.id, "greedy": int(str(answer) in reply),
                     "correct": correct, "k": 16, "greedy_response": reply, "checkpoint": "final"})
        rows.append({**rows[-1], "set": "heldout_templated", "correct": 8, "k": 8})  # read by neither
        logp = gold_level + offset + rng.gauss(0.0, 0.05)
        gold.append({"id": p.id, "logp_mean": logp if gold_exact is None else gold_exact, "fact_logp": None})
    by_source = {}
    for source, prefix in rc.PREFIX.items():
        mine = [r for r in rows if r["set"] == "heldout" and r["id"].startswith(prefix)]
        by_source[source] = {"avg@16": sum(r["correct"] / 16 for r in mine) / len(mine),
                             "pass@16": sum(r["correct"] > 0 for r in mine) / len(mine)}
    gold_by = {source: {"logp_mean": sum(g["logp_mean"] for g in gold if g["id"].startswith(prefix)) / 45
                        if source == rc.HARD else -2.0} for source, prefix in rc.PREFIX.items()}
    result = {"arm": arm, "seed": seed, "steps": 3, "generated_tokens": 100, "train_seconds": 60.0,
              "templates_assigned": 5, "sets": {"final": {"heldout": {"by_source": by_source}}},
              "gold": {"heldout": {"by_source": gold_by}}}
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "result.json"), "w") as f:
        json.dump(result, f)
    for name, lines in (("problems.jsonl", rows), ("gold.jsonl", gold)):
        with open(os.path.join(run_dir, name), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in lines))


def make_study(out, rates=RATES, gold=GOLD, spread=0.03, twins=None, exact=None):
    """twins {arm: the arm whose runs it repeats}; exact {arm: {seed: every problem's gold log-prob}}."""
    study = os.path.join(out, "subtract")
    write_run(os.path.join(study, "untrained"), "untrained", None, 0.01, -1.0)
    write_run(os.path.join(study, "grpo_k", "seed-0"), "grpo_k", 0, 0.9, 0.0)  # the pilot: takes no part
    for arm in rc.ARMS:
        like = (twins or {}).get(arm, arm)
        for seed in SEEDS:
            write_run(os.path.join(study, arm, f"seed-{seed}"), arm, seed, rates[like], gold[like], spread,
                      twin=like, gold_exact=(exact or {}).get(like, {}).get(seed))


def write_report(out):
    """report.md by the repository's own code, its runs loaded the way compare.load_run loads them."""
    import report

    def load(run_dir):
        with open(os.path.join(run_dir, "result.json")) as f:
            result = json.load(f)
        result["problems"] = report.read_problems(os.path.join(run_dir, "problems.jsonl"))
        return result

    study = os.path.join(out, "subtract")
    results = {arm: [load(os.path.join(study, arm, d)) for d in sorted(os.listdir(os.path.join(study, arm)))]
               for arm in rc.ARMS}
    results["untrained"] = [load(os.path.join(study, "untrained"))]
    lines = report.confirm_report("subtract", results, {arm: SEEDS for arm in rc.ARMS}, "docs/PREREGISTRATION-v4.md",
                                  None)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines))
    return "\n".join(lines)


def run(out, capsys):
    code = rc.main([f"--out={out}", "--seeds=200-202"])
    return code, capsys.readouterr().out


def edit_row(out, start, column, value):
    """Replace one cell (column index after the first) of report.md's row that starts with `start`."""
    path = os.path.join(out, "report.md")
    lines = open(path).read().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(start))
    cells = lines[i].strip("|").split("|")
    cells[column] = f" {value} "
    lines[i] = "|" + "|".join(cells) + "|"
    with open(path, "w") as f:
        f.write("\n".join(lines))


def test_the_recomputation_agrees_with_the_report_and_names_a_corrupted_cell(tmp_path, capsys):
    make_study(str(tmp_path))
    text = write_report(str(tmp_path))
    assert "**Complete**" in text
    code, printed = run(tmp_path, capsys)
    assert code == 0, printed
    assert "0 cells of" in printed and "0 per-run mismatches" in printed
    # grpo_k and p2o_human all 0 on avg@16: the paired differences do not vary (nor does either arm, so Welch's
    # interval has no spread either): no test, p counted as 1, refuted exactly; the chain stops
    assert ("| held-out avg@16 | p2o_human - grpo_k | 3 : 3 | +0.000 : +0.000 | +0.000 | no spread | - | 1.0 | "
            "no spread | **refuted** (the paired differences do not vary: the difference is exactly +0, "
            "within ±0.02) |") in printed
    assert "| held-out pass@16 | p2o_human - grpo_k |" in printed and "not tested (this contrast's" in printed
    assert "| untrained | 1 |" in printed and "| rs_distill | 3 |" in printed  # the guard table
    edit_row(str(tmp_path), "| held-out avg@16 | rs_distill - grpo_k |", 6, "0.50")  # the p column
    code, printed = run(tmp_path, capsys)
    assert code == 1 and "DISAGREE confirm held-out avg@16 / rs_distill - grpo_k | p: report.md '0.50'" in printed
    assert printed.count("DISAGREE") == 1
    write_report(str(tmp_path))
    edit_row(str(tmp_path), "| p2o_human_no_crm | 3 |", 4, "0.999")  # right size
    code, printed = run(tmp_path, capsys)
    assert code == 1 and "DISAGREE guard p2o_human_no_crm | right size: report.md '0.999'" in printed


def test_rounding_alone_is_no_disagreement():
    assert rc.agrees("0.0081", "0.0080", (0.00805,))
    assert rc.agrees("[+0.017, +0.064]", "[+0.017, +0.063]", (0.017, 0.0635))
    assert not rc.agrees("0.0082", "0.0080", (0.00805,)) and not rc.agrees("-", "0.0080", (0.00805,))
    assert not rc.agrees("undecided", "**confirmed**", None)


def test_a_result_that_its_rows_contradict_is_flagged(tmp_path, capsys):
    make_study(str(tmp_path))
    path = os.path.join(tmp_path, "subtract", "rs_distill", "seed-201", "result.json")
    result = json.load(open(path))
    result["sets"]["final"]["heldout"]["by_source"][rc.HARD]["avg@16"] += 0.001
    json.dump(result, open(path, "w"))
    write_report(str(tmp_path))
    code, printed = run(tmp_path, capsys)
    assert code == 1 and "ROWS rs_distill seed 201: subtract-heldout/neg avg@16" in printed
    assert "0 cells of" in printed  # the report itself still agrees


def test_an_interim_study_agrees_and_draws_no_verdict(tmp_path, capsys):
    make_study(str(tmp_path))
    shutil.rmtree(os.path.join(tmp_path, "subtract", "rs_distill", "seed-202"))
    assert "**Interim**" in write_report(str(tmp_path))
    code, printed = run(tmp_path, capsys)
    assert code == 0, printed
    assert "rs_distill 2 of 3. Interim." in printed and "**confirmed**" not in printed


def test_chains_that_reach_the_gold_outcome_agree_too(tmp_path, capsys):
    # the unmasked arm and distillation solve 10%: avg@16 and pass@16 confirmed against grpo_k; on the gold
    # log-prob the unmasked arm is worse (the opposite sign) and distillation within +/-0.05 of grpo_k
    rates = {**RATES, "p2o_human_no_crm": 0.1, "rs_distill": 0.1}
    make_study(str(tmp_path), rates, {**GOLD, "p2o_human_no_crm": -1.3}, spread=0.005)
    write_report(str(tmp_path))
    code, printed = run(tmp_path, capsys)
    assert code == 0, printed
    rows = {line.split(" | ")[0][2:] + " / " + line.split(" | ")[1]: line for line in printed.splitlines()
            if line.startswith("| gold")}
    assert rows["gold answer mean log-prob / p2o_human_no_crm - grpo_k"].endswith("**refuted** (the opposite sign) |")
    assert rows["gold answer mean log-prob / rs_distill - grpo_k"].endswith(
        "**refuted** (the interval lies within ±0.05) |")


def test_paired_differences_that_vary_and_do_not_agree_with_the_report(tmp_path, capsys):
    # grpo_k never solves one and its gold log-prob is -1.0 on every seed; the unmasked arm solves 10% and its gold
    # log-prob is -0.96, -0.96, -0.95: differences 0.04, 0.04, 0.05 (the hand case) once avg@16 and pass@16 are
    # confirmed. p2o_human repeats the unmasked arm's runs draw for draw (the mask changed nothing): the arms vary,
    # their paired differences are all 0. rs_distill solves every sample: 1 - 0 on every seed, no spread, >= delta.
    rates = {**RATES, "p2o_human_no_crm": 0.1, "rs_distill": 1.0}
    exact = {"grpo_k": dict.fromkeys(SEEDS, -1.0), "p2o_human_no_crm": {200: -0.96, 201: -0.96, 202: -0.95}}
    make_study(str(tmp_path), rates, twins={"p2o_human": "p2o_human_no_crm"}, exact=exact)
    write_report(str(tmp_path))
    code, printed = run(tmp_path, capsys)
    assert code == 0, printed
    rows = {tuple(line.split(" | ")[:2]): line for line in printed.splitlines()
            if line.startswith("| held-out") or line.startswith("| gold")}
    gold = "| gold answer mean log-prob"
    # b constant: Welch's df is n_a - 1 = 2 and its interval the paired one
    for a in ("p2o_human_no_crm", "p2o_human"):
        assert rows[gold, f"{a} - grpo_k"] == (
            f"{gold} | {a} - grpo_k | 3 : 3 | -0.957 : -1.000 | +0.043 | [+0.029, +0.058] | 0.0059 | 0.023 | "
            "[+0.029, +0.058] | **confirmed** |")
    mask = rows["| held-out avg@16", "p2o_human_no_crm - p2o_human"]
    assert "| +0.000 | no spread | - | 1.0 | [-" in mask and mask.endswith(
        "**refuted** (the paired differences do not vary: the difference is exactly +0, within ±0.02) |")
    assert rows["| held-out pass@16", "p2o_human_no_crm - p2o_human"].endswith(
        "not tested (this contrast's earlier outcome was not confirmed) |")
    assert rows["| held-out avg@16", "rs_distill - grpo_k"].endswith(
        "| +1.000 : +0.000 | +1.000 | no spread | - | 1.0 | no spread | "
        "undecided (the paired differences do not vary) |")


def test_registered_seeds_come_from_the_flag_the_prereg_line_or_the_default(tmp_path):
    assert rc.registered_seeds("200-202,205")[0] == [200, 201, 202, 205]
    prereg = tmp_path / "prereg.md"
    prereg.write_text("- **Seeds**: 200–211 for every arm. New seeds: 0 and 1 were the pilot.\n")
    assert rc.registered_seeds("", str(prereg))[0] == list(range(200, 212))
    prereg.write_text("- **Seeds**: 200–211 for every arm (12 runs an arm, 48 runs), each seed run by all four "
                      "arms (the paired test below needs it). New seeds: 0 and 1 were the training pilot.\n")
    assert rc.registered_seeds("", str(prereg))[0] == list(range(200, 212))  # the v4 file's own line
    prereg.write_text("- **Seeds**: SEEDS. New seeds: 0 and 1 were the pilot.\n")  # not filled in: the default
    assert rc.registered_seeds("", str(prereg))[0] == list(range(200, 210))
    prereg.write_text("- **Seeds**: 200–204 for grpo_k, 200–209 for the others.\n")  # per arm: use --seeds
    assert rc.registered_seeds("", str(prereg))[0] == list(range(200, 210))
