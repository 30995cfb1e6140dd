"""experiments/compare.py: arms as train.py settings, the leak audit, the statistics of the report,
and the whole harness on a tiny random model (--quick), including resumption."""

import json
import math
import os
import shutil
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import compare  # noqa: E402
import report  # noqa: E402
import stats  # noqa: E402


def test_arm_settings_are_train_py_settings_over_the_shared_ones():
    task = compare.TASKS["fictional"]
    grpo2k = compare.arm_settings("grpo_2k", task, compare.SHARED)
    assert grpo2k["algo"] == "grpo" and grpo2k["group_size"] == 2 * compare.SHARED["group_size"]
    human = compare.arm_settings("p2o_human_no_crm", task, compare.SHARED)
    assert human["seed_templates"].endswith("data/fictional/facts.txt") and os.path.isfile(human["seed_templates"])
    assert human["crm"] is False and human["train_data"] == "fictional-train"
    import train

    for arm in compare.ARMS:  # every arm is a valid train.py configuration
        train.check_config(train.Config(**compare.arm_settings(arm, task, compare.SHARED)))


def test_leak_audit_finds_a_template_holding_the_answer(tmp_path):
    archive = {"assignment": {"p1": ["1 zog = 7 blarps.", "", "1 zog = 7 blarps."],
                              "p2": ["The answer is twenty-one.", "Think."]}}
    (tmp_path / "gepa-epoch-0.json").write_text(json.dumps(archive))
    assigned, leaks = compare.leak_audit(str(tmp_path), {"p1": "35", "p2": "21"})
    assert assigned == 3  # distinct non-empty templates per problem
    assert leaks == [("p2", "The answer is twenty-one.")]


def test_drop_checkpoints_removes_checkpoints_and_both_kinds_of_pointer(tmp_path):
    for name in ("ckpt-000002", "ckpt-000004"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_text("w")
    os.symlink("ckpt-000004", tmp_path / "latest")  # a link, as train.py writes them
    (tmp_path / "best").write_text("ckpt-000002\n")  # a one-line pointer file, as older runs have
    (tmp_path / "result.json").write_text("{}")
    compare.drop_checkpoints(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["result.json"]


def test_repo_relative_paths_name_no_machine_folder():
    root = compare.ROOT
    assert compare.repo_relative(os.path.join(root, "data", "fictional", "facts.txt")) == "data/fictional/facts.txt"
    assert compare.repo_relative(root + "-elsewhere/x.txt") == root + "-elsewhere/x.txt"  # a prefix is not a parent
    assert compare.repo_relative("/tmp/x.jsonl") == "/tmp/x.jsonl"
    assert compare.repo_relative("smollm2-135m") == "smollm2-135m"
    assert compare.repo_relative(0.6) == 0.6


def fake(arm, seed, greedy, leaks=()):
    row = {"greedy": greedy, "avg@2": greedy / 2, "pass@2": greedy}
    score = {"overall": row, "by_source": {"s": row}}
    return {"arm": arm, "seed": seed, "generated_tokens": 100, "steps": 3, "test": {"final": score, "best": score},
            "templates_assigned": 2, "leaks": list(leaks), "dev": [], "train_seconds": 60.0, "flops": 2e15}


def heldout_run(arm, seed, correct, k=4):
    """A run scored on a held-out set only, with per-problem rows: correct[i] of k samples right."""
    rows = {("final", "heldout"): {f"p{i}": {"greedy": 0, "correct": c, "k": k} for i, c in enumerate(correct)}}
    return {"arm": arm, "seed": seed, "sets": {"final": {"heldout": {"overall": {f"avg@{k}": sum(correct) / k / len(correct)}}}},
            "problems": rows, "steps": 3, "generated_tokens": 100, "train_seconds": 60.0}

def test_report_pairs_seeds_and_states_the_leaks():
    results = {"grpo_k": [fake("grpo_k", 0, 0.2), fake("grpo_k", 1, 0.4)],
               "p2o_human": [fake("p2o_human", 1, 0.7), fake("p2o_human", 0, 0.3, [("q", "it is 5")])]}
    text = "\n".join(report.task_report("t", results, k=2) + report.leak_lines(results))
    assert "| grpo_k | 2 | 3.0 | 100 | 2,000 | 1.0 | 0.150 ± 0.071 | 0.300 ± 0.141 | 0.300 ± 0.141 |" in text
    # paired by seed: avg@2 differences 0.15 - 0.1 = +0.05 (seed 0), 0.35 - 0.2 = +0.15 (seed 1); mean +0.1,
    # t(1 df) 12.706 x sd 0.0707 / sqrt 2 = 0.635 -> [-0.535, +0.735]; no per-problem rows: no bootstrap; 2 seeds: no p
    # one arm against the baseline: the Bonferroni interval is the plain one. Unpaired (Welch): arm 0.15, 0.35
    # (variance 0.02), baseline 0.1, 0.2 (0.005): se sqrt(0.01 + 0.0025) = 0.1118, df 1.47 -> 1: 0.1 -/+ 1.4206
    assert "| p2o_human | 2 | +0.050, +0.150 | +0.100 | [-0.535, +0.735] | [-0.535, +0.735] | - | [-1.321, +1.521] | - |" \
        in text
    assert "**1 leaks**" in text and "p2o_human seed 0: q: 'it is 5'" in text


def test_report_with_one_seed_claims_no_spread():
    results = {"grpo_k": [fake("grpo_k", 0, 0.2)], "dapo": [fake("dapo", 0, 0.5)]}
    text = "\n".join(report.task_report("t", results, k=2))
    assert "| grpo_k | 1 | 3.0 | 100 | 2,000 | 1.0 | 0.100 | 0.200 | 0.200 |" in text
    assert "± 0" not in text  # no spread from one seed
    assert "| dapo | 1 | +0.150 | +0.150 | - | - | - | - |" in text


def test_bonferroni_interval_widens_with_the_number_of_arms():
    """Two arms, three seeds: each arm's family-wise interval is its t-interval at level 1 - 0.05/2.
    With 2 df, F(t) = 1/2 + t / (2 sqrt(t^2 + 2)), so F(t) = 0.9875 at t = sqrt(2 * 0.975^2 / (1 - 0.975^2))
    = 6.2053; arm a's differences 0.1, 0.2, 0.3: mean 0.2, se 0.1/sqrt 3 -> 0.2 -/+ 0.3583."""
    results = {"grpo_k": [fake("grpo_k", s, 0.0) for s in range(3)],
               "a": [fake("a", s, g) for s, g in enumerate((0.2, 0.4, 0.6))],
               "b": [fake("b", s, g) for s, g in enumerate((0.4, 0.4, 0.6))]}
    text = "\n".join(report.task_report("t", results, k=2))
    assert "t, Bonferroni over 2 |" in text
    # plain 95%: t(2 df, 0.975) 4.3027 x 0.0577 = 0.2484
    # unpaired: the baseline does not vary, so Welch is the one-sample interval (df 2): the plain one
    assert "| a | 3 | +0.100, +0.200, +0.300 | +0.200 | [-0.048, +0.448] | [-0.158, +0.558] | - | [-0.048, +0.448] | - |" \
        in text


def test_bonferroni_family_counts_arms_not_yet_run():
    """The level follows the arms a task compares (family), not the ones finished so far: family 3,
    two arms in the table -> level 1 - 0.05/3, two-sided tail 0.05/6. With 2 df, F(t) = 0.991667
    at t = sqrt(2 q^2 / (1 - q^2)), q = 2F - 1 = 0.983333: t = 7.6487; x 0.057735 = 0.4416."""
    results = {"grpo_k": [fake("grpo_k", s, 0.0) for s in range(3)],
               "a": [fake("a", s, g) for s, g in enumerate((0.2, 0.4, 0.6))],
               "b": [fake("b", s, g) for s, g in enumerate((0.4, 0.4, 0.6))]}
    text = "\n".join(report.task_report("t", results, k=2, family=3))
    assert "t, Bonferroni over 3 |" in text
    assert "| a | 3 | +0.100, +0.200, +0.300 | +0.200 | [-0.048, +0.448] | [-0.242, +0.642] | - | [-0.048, +0.448] | - |" \
        in text


def test_contrasts_pair_two_arms_seed_by_seed():
    """a - b per seed on the primary column (avg@2 = greedy / 2): -0.1, 0, 0; mean -0.0333,
    sd 0.0577, se 0.0333, t(2 df) 4.3027 -> [-0.177, +0.110]. A pair with an arm absent is skipped."""
    results = {"grpo_k": [fake("grpo_k", s, 0.0) for s in range(3)],
               "a": [fake("a", s, g) for s, g in enumerate((0.2, 0.4, 0.6))],
               "b": [fake("b", s, g) for s, g in enumerate((0.4, 0.4, 0.6))]}
    text = "\n".join(report.task_report("t", results, k=2, contrasts=(("a", "b"), ("a", "missing"))))
    assert "| a - b | 3 | -0.100, +0.000, +0.000 | -0.033 | [-0.177, +0.110] | - |" in text
    assert "missing" not in text


def test_probe_band_is_each_runs_own():
    """log c -7.91 (the fact token, untrained) is outside the default band [log 0.01, log 10] and
    inside crm_low=1e-4's; the band's edges belong to it, as in distill.crm_weights."""
    assert report.outside_band(-7.91, {}) and not report.outside_band(-7.91, {"crm_low": 1e-4})
    assert not report.outside_band(math.log(0.01), {}) and report.outside_band(math.log(10.0) + 1e-9, {})
    assert report.outside_band(-0.5, {"crm_low": 0.9, "crm_high": 2.0})
    probe = [{"token": t, "logp_plain": -1.0, "logp_templated": 0.0, "log_c": c, "masked": True}
             for t, c in (("1", -1.0), ("3", -7.91))]
    runs = {"p2o_human": [{"probe": probe, "settings": {}}],
            "p2o_human_crm_low": [{"probe": probe, "settings": {"crm_low": 1e-4}},
                                  {"probe": probe, "settings": {"crm_low": 1e-2}}]}
    text = "\n".join(report.probe_report(runs))
    assert "| p2o_human | 1 | -1.00 | 0.00 | -7.91 | 1 of 1 |" in text
    assert "| p2o_human_crm_low | 2 | -1.00 | 0.00 | -7.91 | 1 of 2 |" in text


def test_an_interval_without_width_is_called_so():
    assert report.fmt_interval((0.0, 0.0)) == "no spread" and report.fmt_interval(None) == "-"
    assert report.fmt_interval((-0.0381, 0.1333)) == "[-0.038, +0.133]"


def test_report_paired_statistics_use_the_per_problem_rows():
    """Five seeds with per-problem rows: the bootstrap and the sign-flip p appear (stats.py's
    functions, tested there); the per-seed differences come from result.json (here the rows' means)."""
    base = [heldout_run("grpo_k", s, [0, 0, 0, 0]) for s in range(5)]
    arm = [heldout_run("x", s, [s % 2, 4, 0, 1]) for s in range(5)]  # +5/16 or +6/16 per seed
    s = report.paired(arm, base, "heldout", "avg", 4)
    assert s["diffs"] == pytest.approx([5 / 16, 6 / 16, 5 / 16, 6 / 16, 5 / 16])
    assert s["p"] == pytest.approx(2 / 32) and s["boot"] is not None and s["t"][0] > 0


def test_quick_comparison_end_to_end_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "cmp"
    assert compare.main(["--quick", f"--out={out}", "--keep_checkpoints"]) == 0
    results = json.loads((out / "results.json").read_text())["fictional"]
    untrained = results.pop("untrained")  # the starting model's scores, once per task
    assert len(untrained) == 1 and untrained[0]["steps"] == 0 and "greedy" in untrained[0]["test"]["final"]["overall"]
    assert sorted(results) == ["grpo_k", "p2o_human", "sft_gold"] and all(len(runs) == 2 for runs in results.values())
    sizes = {"test": 30, "heldout": 40, "heldout_templated": 40}
    for runs in results.values():
        for r in runs:
            assert r["generated_tokens"] >= r["budget"] == 300  # trained until the budget was spent
            assert {"greedy", "avg@2", "pass@2"} <= set(r["test"]["final"]["overall"])
            assert len(r["test"]["final"]["by_source"]) == 10  # the ten unit pairs
            assert set(r["sets"]["final"]) == set(sizes) and r["flops"] > 0
            run_dir = out / "fictional" / r["arm"] / f"seed-{r['seed']}"
            rows = [json.loads(line) for line in (run_dir / "problems.jsonl").read_text().splitlines()]
            assert {s: sum(x["set"] == s for x in rows) for s in sizes} == sizes
            for name, size in sizes.items():  # the per-problem rows give back the aggregate scores
                mine = [x for x in rows if x["set"] == name]
                assert sum(x["correct"] / x["k"] for x in mine) / size == pytest.approx(
                    r["sets"]["final"][name]["overall"]["avg@2"])
            assert all(x["templated"] == (x["set"] == "heldout_templated") for x in rows)
            probe = json.loads((run_dir / "crm_tokens.json").read_text())
            assert "".join(t["token"] for t in probe).startswith("2 plonks")
    # the random tiny model never answers correctly: no update has a gradient, so GRPO (K) ends with
    # the starting weights and takes the untrained scores, said so; SFT on gold trains and is scored
    assert all(r["scored_as"].startswith("untrained") for r in results["grpo_k"])
    assert all(r["scored_as"] == "own" and r["counts"]["gold_tokens"] >= 300 for r in results["sft_gold"])
    human = results["p2o_human"][0]
    assert human["settings"]["seed_templates"].endswith("facts.txt")
    assert (out / "fictional" / "p2o_human" / "seed-0" / "gepa-epoch-0.json").exists()  # GEPA ran within budget
    assert human["counts"]["reflection_prefill_tokens"] > 0 and human["counts"]["gepa_dev_prefill_tokens"] > 0
    text = (out / "report.md").read_text()
    assert "| grpo_k | 2 |" in text and "Leak audit" in text and (out / "fictional-dev-vs-tokens.png").exists()
    assert "heldout avg@2" in text and "CRM probe" in text

    # a finished run is never redone; an interrupted one (no result.json) resumes from its checkpoint
    os.remove(out / "fictional" / "grpo_k" / "seed-1" / "result.json")
    calls = []
    real = compare.train_run
    monkeypatch.setattr(compare, "train_run", lambda *a: calls.append(a[0]) or real(*a))
    assert compare.main(["--quick", f"--out={out}"]) == 0
    assert calls == [str(out / "fictional" / "grpo_k" / "seed-1")]
    assert "--resume=auto" in (out / "fictional" / "grpo_k" / "seed-1" / "console.log").read_text()
    # without --keep_checkpoints a run scored now has its checkpoints deleted; the others keep theirs
    assert not list((out / "fictional" / "grpo_k" / "seed-1").glob("ckpt-*"))
    assert not os.path.lexists(out / "fictional" / "grpo_k" / "seed-1" / "latest")
    assert list((out / "fictional" / "grpo_k" / "seed-0").glob("ckpt-*"))
    again = json.loads((out / "results.json").read_text())["fictional"]
    assert again["grpo_k"][1]["generated_tokens"] == results["grpo_k"][1]["generated_tokens"]
    assert again["grpo_k"][1]["train_seconds"] > results["grpo_k"][1]["train_seconds"]  # both processes' time


def test_a_reflector_server_adds_the_teacher_arm(tmp_path, monkeypatch):
    monkeypatch.setitem(compare.ARMS, "p2o_teacher", {})  # restored after the test
    assert compare.main(["--report_only", "--tasks=fictional", "--reflector=http://127.0.0.1:9/v1",
                         "--reflector_model=big", f"--out={tmp_path}"]) == 0
    settings = compare.arm_settings("p2o_teacher", compare.TASKS["fictional"], compare.SHARED)
    assert (settings["reflector"], settings["reflector_model"], settings["algo"]) == ("http://127.0.0.1:9/v1", "big", "p2o")
    import train

    train.check_config(train.Config(**settings))  # a valid train.py configuration (the server is checked at start)


def test_sigterm_stops_the_running_train_py_at_a_checkpoint(tmp_path):
    """Stopping compare.py (e.g. `kill PID` at the end of a session) leaves no train.py behind:
    the run's train.py finishes its step, checkpoints and exits, and its time so far is kept."""
    import signal
    import subprocess
    import time

    out = tmp_path / "cmp"
    run = out / "fictional" / "grpo_k" / "seed-0"
    proc = subprocess.Popen([sys.executable, "experiments/compare.py", "--quick", f"--out={out}"],
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists():  # the first step is done (>= 3 of >= 4 to go)
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 128 + signal.SIGTERM
    assert "stopped by signal 15; checkpoint" in (run / "console.log").read_text()
    assert not (run / "result.json").exists() and os.path.exists(run / "latest")
    assert json.loads((run / "train_seconds.json").read_text())["seconds"] > 0


def test_bootstrap_needs_three_seeds():
    """Two seeds give a t-interval but no bootstrap: its seed level would have 3 distinct resamples
    and coverage.md measures it from 3 seeds."""
    base = [heldout_run("grpo_k", s, [0, 1, 0, 2]) for s in range(3)]
    arm = [heldout_run("x", s, [s, 2, 1, 0]) for s in range(3)]
    assert report.paired(arm[:2], base, "heldout", "avg", 4)["boot"] is None
    assert report.paired(arm[:2], base, "heldout", "avg", 4)["t"] is not None
    assert report.paired(arm, base, "heldout", "avg", 4)["boot"] is not None


def test_a_seed_free_arm_is_paired_with_every_baseline_seed():
    base = [heldout_run("grpo_k", s, [s, 0, 0, 0]) for s in range(5)]  # avg 0, 1/16, 2/16, 3/16, 4/16
    sft = [heldout_run("sft_gold", s, [4, 0, 0, 0]) for s in (0, 1)]  # 4/16 on both seeds
    s = report.paired(sft, base, "heldout", "avg", 4, seed_free=True)
    assert s["seeds"] == 5 and s["diffs"] == pytest.approx([4 / 16, 3 / 16, 2 / 16, 1 / 16, 0.0])
    assert s["p"] is not None and s["boot"] is not None
    assert report.paired(sft, base, "heldout", "avg", 4)["seeds"] == 2  # not declared: its own seeds only
    results = {"grpo_k": base, "sft_gold": sft}
    text = "\n".join(report.task_report("t", results, k=4, seed_free=("sft_gold",)))
    assert "| sft_gold | 5 (1 run) | +0.250, +0.188, +0.125, +0.062, +0.000 |" in text


def test_a_seed_free_arm_whose_seeds_differ_is_refused():
    base = [heldout_run("grpo_k", s, [0, 0, 0, 0]) for s in range(2)]
    sft = [heldout_run("sft_gold", 0, [4, 0, 0, 0]), heldout_run("sft_gold", 1, [4, 1, 0, 0])]
    with pytest.raises(ValueError, match=r"sft_gold is declared seed-free .* its seed 1 scored differently"):
        report.task_report("t", {"grpo_k": base, "sft_gold": sft}, k=4, seed_free=("sft_gold",))


def test_run_command_names_the_settings_every_run_shared():
    def run(arm, **extra):
        return {"arm": arm, "budget": 30_000, "settings": {**compare.SHARED, "train_data": "x", **compare.ARMS[arm], **extra}}
    runs = [run("grpo_k", engine_dtype="float32", autocast_bf16="False"),
            run("p2o_human", engine_dtype="float32", autocast_bf16="False", group_size=4)]
    assert compare.run_command("fictional", runs, compare.SHARED, 30_000) == \
        "python experiments/compare.py --tasks=fictional --set=autocast_bf16=False --set=engine_dtype=float32"
    assert compare.run_command("natural", [run("grpo_k")], compare.SHARED, 15_000) == \
        "python experiments/compare.py --tasks=natural --budget=30000"


def test_coverage_range_reads_the_tables_of_its_kind(tmp_path):
    path = tmp_path / "coverage.md"
    path.write_text("# x\n\n**normal: a**\n\n| seeds | t-interval | hierarchical bootstrap |\n|---|---|---|\n"
                    "| 3 | 0.955 | 0.938 |\n| 5 | 0.948 | 0.949 |\n\n**normal: b**\n\n| seeds | t | b |\n|---|---|---|\n"
                    "| 3 | 0.959 | 0.837 |\n\n**lopsided: c**\n\n| seeds | t | b |\n|---|---|---|\n| 5 | 0.709 | 0.650 |\n"
                    "| 20 | 0.931 | 0.900 |\n")
    assert report.coverage_range(str(path)) == (0.948, 0.959, 0.837, 0.949)
    assert report.coverage_range(str(path), "lopsided") == (0.709, 0.931, 0.650, 0.900)
    assert report.coverage_range(str(tmp_path / "none.md")) is None


def test_the_committed_report_is_what_the_committed_runs_give(tmp_path):
    """results/compare/report.md is rewritten from the committed result.json and problems.jsonl
    alone (--report_only), so no number in it is typed by hand or left stale."""
    committed = os.path.join(compare.ROOT, "results", "compare")
    out = tmp_path / "compare"
    shutil.copytree(committed, out, ignore=shutil.ignore_patterns("*.png", "rollouts.jsonl", "tb"))
    assert compare.main(["--report_only", f"--out={out}"]) == 0
    assert (out / "report.md").read_text() == open(os.path.join(committed, "report.md")).read()


def test_scorer_rows_by_hand(monkeypatch):
    """Scorer with a scripted engine: each problem's row holds its greedy verdict, its number of
    correct samples and k, templated where the set is; the aggregate avg@k is the rows' mean."""
    import rollout
    from data import Problem

    problems = [Problem(f"p{i}", f"How many snigs are in {n} plonks?", str(13 * n), source="fictional/plonk")
                for i, n in enumerate((2, 3, 4))]
    rule = "1 plonk = 13 snigs."

    class Engine:  # problem i: greedy right iff i is even; i + 1 of k samples right, all of them with the rule
        def generate(self, prompts, n=1, temperature=0.0, **_):
            out = []
            for messages, k, t in zip(prompts, n, temperature):
                text = messages[-1]["content"]
                i = next(j for j, p in enumerate(problems) if p.problem in text)
                right, wrong = f"\\boxed{{{problems[i].answer}}}", "\\boxed{7}"
                if t == 0.0:
                    out.append([rollout.Sample([1], [2], right if i % 2 == 0 else wrong, "stop")])
                else:
                    good = k if text.startswith(rule) else i + 1
                    out.append([rollout.Sample([1], [2], right if j < good else wrong, "stop") for j in range(k)])
            return out

    monkeypatch.setattr(rollout, "make_rollout", lambda *a, **kw: Engine())
    scorer = compare.Scorer("hf", 0.6, 32, dtype="float32")
    scores, rows = scorer("model", [("heldout", problems, "", 4), ("heldout_templated", problems, rule, 4)])
    mine = [(r["set"], r["id"], r["templated"], r["greedy"], r["correct"], r["k"]) for r in rows]
    assert mine == [("heldout", "p0", False, 1.0, 1, 4), ("heldout", "p1", False, 0.0, 2, 4),
                    ("heldout", "p2", False, 1.0, 3, 4), ("heldout_templated", "p0", True, 1.0, 4, 4),
                    ("heldout_templated", "p1", True, 0.0, 4, 4), ("heldout_templated", "p2", True, 1.0, 4, 4)]
    assert scores["heldout"]["overall"]["avg@4"] == pytest.approx(6 / 12)
    assert scores["heldout"]["overall"]["greedy"] == pytest.approx(2 / 3)
    assert scores["heldout_templated"]["overall"]["avg@4"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- the confirmatory analysis

def confirm_run(arm, seed, fact, whole, avg, correct=0, templates=5):
    """A finished run of the confirm task as the report reads it (gold log-probs, held-out avg@16,
    per-problem held-out rows: `correct` correct samples of 40 x 16)."""
    rows = {f"p{i}": {"greedy": 0, "correct": correct if i == 0 else 0, "k": 16} for i in range(40)}
    return {"arm": arm, "seed": seed, "gold": {"heldout": {"fact_logp": fact, "logp_mean": whole}},
            "sets": {"final": {"heldout": {"overall": {"avg@16": avg}}}}, "problems": {("final", "heldout"): rows},
            "templates_assigned": templates, "steps": 3, "generated_tokens": 100, "train_seconds": 60.0}


CONFIRM = report.REGISTRATIONS["docs/PREREGISTRATION.md"]
PLANNED = {"grpo_k": range(4), "p2o_human": range(3), "p2o_human_no_crm": range(3), "rs_distill": range(3)}


def study(fact, whole, avg, runs=None, templates=None):
    """{arm: runs} with per-arm lists of values by seed."""
    return {arm: [confirm_run(arm, s, fact[arm][i], whole[arm][i], avg[arm][i],
                              templates=(templates or {}).get(arm, 5)) for i, s in enumerate(PLANNED[arm])
                  if i < (runs or {}).get(arm, len(PLANNED[arm]))] for arm in PLANNED}


FACT = {"grpo_k": [-7.0, -8.0, -9.0, -8.0], "p2o_human": [-14.0, -15.0, -16.0], "p2o_human_no_crm": [-1.0, -2.0, -3.0],
        "rs_distill": [-2.0, -2.5, -3.0]}
WHOLE = {"grpo_k": [-1.20, -1.21, -1.19, -1.20], "p2o_human": [-1.7, -1.6, -1.8],
         "p2o_human_no_crm": [-1.10, -1.30, -1.15], "rs_distill": [-1.0, -1.1, -1.2]}
AVG = {"grpo_k": [0.01, 0.0, 0.01, 0.0], "p2o_human": [0.0, 0.0, 0.0], "p2o_human_no_crm": [0.1, 0.0, 0.0],
       "rs_distill": [0.02, 0.0, 0.01]}


def test_confirm_report_gatekeeps_the_families_and_draws_verdicts_only_when_complete():
    text = "\n".join(report.confirm_report("confirm", study(FACT, WHOLE, AVG), PLANNED, "docs/PREREGISTRATION.md",
                                           0.0046875))
    assert "**Complete**" in text
    # fact tokens: no CRM -2 vs GRPO (K) -8 -> +6; Welch variances 1/3 and (2/3)/4 = 1/6, se sqrt(1/2),
    # df (1/2)^2 / ((1/3)^2/2 + (1/6)^2/3) = 3.86 -> 3: t 3.1824 x 0.7071 = 2.250
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| gold fact-token")}
    c1 = rows["p2o_human_no_crm - grpo_k"]
    assert "| 3 : 4 | -2.000 : -8.000 | +6.000 | [+3.750, +8.250] |" in c1
    assert all(line.endswith("**confirmed** |") for line in rows.values())
    # the whole answer: C2 (+0.483 over the masked arm) is confirmed, C1 is not -> the avg@16 family is shut
    whole = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| gold answer mean")}
    assert whole["p2o_human_no_crm - p2o_human"].endswith("**confirmed** |")
    assert whole["p2o_human_no_crm - grpo_k"].endswith("| undecided |")
    avg = [line for line in text.splitlines() if line.startswith("| held-out avg@16 |")]
    assert len(avg) == 3 and all(line.endswith("not tested (an earlier outcome was not confirmed in full) |")
                                 for line in avg)
    # the learn rate: 11 of 640 at the untrained rate 0.0047; no run here has a correct held-out sample
    assert "| grpo_k | 0 of 4 | 11 of 640 samples |" in text and "Barnard p" in text


def test_confirm_report_is_interim_until_every_planned_run_is_in():
    text = "\n".join(report.confirm_report("confirm", study(FACT, WHOLE, AVG, runs={"rs_distill": 2}), PLANNED,
                                           "docs/PREREGISTRATION.md", 0.0046875))
    assert "**Interim**" in text and "rs_distill 2 of 3" in text
    verdicts = [line.rsplit(" | ", 2)[-1] for line in text.splitlines() if line.startswith("| gold ")]
    assert verdicts and all(v == "undecided (interim) |" for v in verdicts)
    assert "**confirmed**" not in text and "**refuted**" not in text


def test_an_interval_inside_the_smallest_effect_refutes_and_the_opposite_sign_refutes():
    flat = {arm: [-8.0 + 0.01 * i for i in range(len(PLANNED[arm]))] for arm in PLANNED}
    flat["p2o_human"] = [-1.0, -1.1, -0.9]  # the masked arm far above: C2 significant with the opposite sign
    text = "\n".join(report.confirm_report("confirm", study(flat, WHOLE, AVG), PLANNED, "docs/PREREGISTRATION.md",
                                           0.0046875))
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| gold fact-token")}
    assert rows["p2o_human_no_crm - grpo_k"].endswith("**refuted** (the interval lies within ±1) |")
    assert rows["p2o_human_no_crm - p2o_human"].endswith("**refuted** (the opposite sign) |")


def test_the_futility_rule_stops_a_gepa_arm_whose_first_two_runs_kept_no_template():
    runs = study(FACT, WHOLE, AVG, runs={"p2o_human": 2}, templates={"p2o_human": 0})
    assert report.futile("p2o_human", runs["p2o_human"]) and not report.futile("grpo_k", runs["grpo_k"])
    assert not report.futile("p2o_human", runs["p2o_human"][:1])  # one run decides nothing
    text = "\n".join(report.confirm_report("confirm", runs, PLANNED, "docs/PREREGISTRATION.md", 0.0046875))
    assert "Stopped by the futility rule" in text and "**Complete**" in text  # the stopped arm counts as done
    assert "| gold fact-token log-prob | p2o_human_no_crm - p2o_human | - |" in text and "stopped (futility)" in text
    # the other two contrasts form the family (Holm over 2)
    rows = [line for line in text.splitlines() if line.startswith("| gold fact-token") and "futility" not in line]
    assert len(rows) == 2 and all(line.endswith("**confirmed** |") for line in rows)


def test_learn_counts_and_barnard_per_contrast():
    runs = study(FACT, WHOLE, AVG)
    for r in runs["p2o_human_no_crm"]:
        r["problems"][("final", "heldout")]["p0"]["correct"] = 11  # all three learnt (11 >= the threshold)
    runs["grpo_k"][0]["problems"][("final", "heldout")]["p0"]["correct"] = 10  # one short of it
    text = "\n".join(report.learn_lines(runs, PLANNED, 0.0046875, []))
    assert "| p2o_human_no_crm | 3 of 3 |" in text and "| grpo_k | 0 of 4 |" in text
    p = stats.barnard(3, 3, 0, 4)[1]
    assert f"| p2o_human_no_crm - grpo_k | 3/3 vs 0/4 | {p:.3g} |" in text


def test_quick_confirm_task_scores_gold_logprobs_and_greedy_only_sets(tmp_path):
    out = tmp_path / "confirm"
    assert compare.main(["--quick", "--tasks=confirm", "--arms=grpo_k,rs_distill", "--seeds=0", f"--out={out}"]) == 0
    for run_dir in (out / "confirm" / "untrained", out / "confirm" / "rs_distill" / "seed-0"):
        result = json.loads((run_dir / "result.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "gold.jsonl").read_text().splitlines()]
        assert len(rows) == 40 and all(r["fact_logp"] is not None and r["tokens"] > 0 for r in rows)
        assert result["gold"]["heldout"]["logp_mean"] == pytest.approx(statistics.mean(r["logp_mean"] for r in rows))
        sets = result["sets"]["final"]
        assert not any(key.startswith("avg@") for key in sets["test"]["overall"])  # greedy only
        assert not any(key.startswith("avg@") for key in sets["heldout_templated"]["overall"])
        assert "avg@2" in sets["heldout"]["overall"]  # the co-primary keeps its samples
    text = (out / "report.md").read_text()
    assert "## confirm: the confirmatory study" in text and "docs/PREREGISTRATION.md" in text
    assert "**Interim**" in text  # one seed of each of two arms: far from the plan


def test_quick_subtract_task_scores_each_level_apart_and_reports_the_v4_study(tmp_path):
    out = tmp_path / "v4"
    assert compare.main(["--quick", "--tasks=subtract", "--arms=grpo_k,rs_distill", "--seeds=0", f"--out={out}"]) == 0
    for run_dir in (out / "subtract" / "untrained", out / "subtract" / "rs_distill" / "seed-0"):
        result = json.loads((run_dir / "result.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "gold.jsonl").read_text().splitlines()]
        hard = [r for r in rows if r["id"].startswith("subtract-heldout-neg")]
        assert len(rows) == 63 and len(hard) == 45
        gold = result["gold"]["heldout"]["by_source"]
        assert gold[report.HARD]["logp_mean"] == pytest.approx(statistics.mean(r["logp_mean"] for r in hard))
        assert gold["subtract-heldout/pos"]["fact_logp"] is None  # a positive answer has no minus sign
        assert set(result["sets"]["final"]["heldout"]["by_source"]) == {report.HARD, "subtract-heldout/pos"}
    text = (out / "report.md").read_text()
    assert "## subtract: the confirmatory study" in text and "docs/PREREGISTRATION-v4.md" in text
    assert "**Interim**" in text and "| most common answer's share |" in text


def test_commit_run_commits_the_run_folder_and_nothing_else(tmp_path):
    import subprocess

    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True).stdout  # noqa: E731
    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("results/**/ckpt-*/\n")
    (tmp_path / "other.txt").write_text("staged but not the run's\n")
    git("add", "other.txt", ".gitignore")
    run = tmp_path / "results" / "confirm" / "grpo_k" / "seed-100"
    (run / "ckpt-4").mkdir(parents=True)
    (run / "ckpt-4" / "model.safetensors").write_text("weights")
    (run / "result.json").write_text("{}")
    assert compare.commit_run(str(run), "done", repo=str(tmp_path))
    committed = git("show", "--name-only", "--format=%s", "HEAD").split()
    assert committed[0] == "results/confirm/grpo_k/seed-100:" and "results/confirm/grpo_k/seed-100/result.json" in committed
    assert "other.txt" not in committed and not any("ckpt-4" in c for c in committed)
    assert "A  other.txt" in git("status", "--short")  # still staged, for its own commit
    head = git("rev-parse", "HEAD")
    assert compare.commit_run(str(run), "again", repo=str(tmp_path)) and git("rev-parse", "HEAD") == head  # nothing new
    # a run folder reached through a link (a frozen checkout whose results/ links here) commits here
    elsewhere = tmp_path.parent / f"{tmp_path.name}-checkout"
    elsewhere.mkdir()
    (elsewhere / "results").symlink_to(tmp_path / "results")
    run2 = elsewhere / "results" / "confirm" / "grpo_k" / "seed-101"
    run2.mkdir(parents=True)
    (run2 / "result.json").write_text("{}")
    assert compare.commit_run(str(run2), "done")
    assert "results/confirm/grpo_k/seed-101/result.json" in git("show", "--name-only", "--format=%s", "HEAD").split()


def test_runs_of_unregistered_seeds_neither_count_nor_complete_the_study():
    runs = study(FACT, WHOLE, AVG, runs={"rs_distill": 2})
    runs["rs_distill"].append(confirm_run("rs_distill", 7, -2.0, -1.0, 0.0))  # seed 7 is not in the plan
    text = "\n".join(report.confirm_report("confirm", runs, PLANNED, "docs/PREREGISTRATION.md", 0.0046875))
    assert "rs_distill 2 of 3" in text and "**Interim**" in text
    row = next(line for line in text.splitlines() if line.startswith("| gold fact-token log-prob | rs_distill"))
    assert "| 2 : 4 |" in row
    # a registered run without its gold outcome does not complete the study either
    full = study(FACT, WHOLE, AVG)
    del full["grpo_k"][0]["gold"]
    assert "**Interim**" in "\n".join(report.confirm_report("confirm", full, PLANNED, "p", 0.0046875, CONFIRM))


def test_a_contrast_where_neither_arm_varies_gets_no_verdict():
    flat_avg = {arm: [0.0] * len(PLANNED[arm]) for arm in PLANNED}
    fact = {arm: [-3.0] * len(PLANNED[arm]) for arm in PLANNED}
    text = "\n".join(report.confirm_report("confirm", study(fact, WHOLE, flat_avg), PLANNED, "p", 0.0046875, CONFIRM))
    rows = [line for line in text.splitlines() if line.startswith("| gold fact-token")]
    assert len(rows) == 3 and all(line.endswith("undecided (neither arm varies) |") for line in rows)


def test_the_report_copies_the_recorded_deviations_beside_the_results(tmp_path):
    prereg = tmp_path / "PREREG.md"
    prereg.write_text("# Plan\n\n## Outcomes\nnot this\n\n## Deviations\n\n1. **A date, a change.** Why.\n"
                      "   More.\n\n2. Another.\n\n## Afterwards\nnot this either\n")
    assert report.deviations(str(prereg)) == ["1. **A date, a change.** Why.", "   More.", "", "2. Another."]
    text = "\n".join(report.confirm_report("confirm", study(FACT, WHOLE, AVG), PLANNED, str(prereg), 0.0046875, CONFIRM))
    assert "> 1. **A date, a change.** Why.\n>    More.\n>\n> 2. Another.\n" in text
    assert "not this" not in text
    # no section, or no file: said so, not left out
    prereg.write_text("# Plan\n\n## Outcomes\nnone moved\n")
    assert report.deviations(str(prereg)) == [] and report.deviations(str(tmp_path / "absent.md")) == []
    text = "\n".join(report.confirm_report("confirm", study(FACT, WHOLE, AVG), PLANNED, str(prereg), 0.0046875, CONFIRM))
    assert "Deviations from the pre-registration recorded there: none." in text
    # the repository's own pre-registration: its numbered deviations, in order
    numbered = [line.split(".")[0] for line in report.deviations("docs/PREREGISTRATION.md") if line[:1].isdigit()]
    assert numbered == [str(i) for i in range(1, len(numbered) + 1)] and len(numbered) >= 4


def test_p_values_keep_two_significant_digits():
    assert [report.fmt_p(p) for p in (0.5, 0.065, 1.0, 0.18, 0.00012)] == ["0.50", "0.065", "1.0", "0.18", "0.00012"]


# ----------------------------------------------------------------------------- the v4 study (docs/PREREGISTRATION-v4.md)

V4 = "docs/PREREGISTRATION-v4.md"
V4_PLANNED = {"grpo_k": range(4), "p2o_human": range(3), "p2o_human_no_crm": range(3), "rs_distill": range(3)}


def v4_study(avg, pas, whole):
    """{arm: runs} of the subtraction study as the report reads them: held-out avg@16, pass@16 and the gold
    log-prob on the hard level (by source); the positive level's scores, which no outcome reads, set apart."""
    def run(arm, s, i):
        hard = {"avg@16": avg[arm][i], "pass@16": pas[arm][i]}
        return {"arm": arm, "seed": s, "templates_assigned": 5, "steps": 3, "generated_tokens": 100,
                "train_seconds": 60.0,
                "gold": {"heldout": {"logp_mean": 9.0, "by_source": {report.HARD: {"logp_mean": whole[arm][i]},
                                                                     "subtract-heldout/pos": {"logp_mean": 9.0}}}},
                "sets": {"final": {"heldout": {"overall": {"avg@16": 9.0, "pass@16": 9.0}, "by_source": {
                    report.HARD: hard, "subtract-heldout/pos": {"avg@16": 9.0, "pass@16": 9.0}}}}}}
    return {arm: [run(arm, s, i) for i, s in enumerate(seeds)] for arm, seeds in V4_PLANNED.items()}


def v4_rows(text):
    return {(line.split(" | ")[0][2:], line.split(" | ")[1]): line for line in text.splitlines()
            if line.startswith("| held-out") or line.startswith("| gold")}


V4_AVG = {"grpo_k": [0.0, 0.02, 0.0, 0.02], "p2o_human": [0.04, 0.06, 0.05], "p2o_human_no_crm": [0.10, 0.13, 0.11],
          "rs_distill": [0.08, 0.09, 0.10]}
V4_PASS = {"grpo_k": [0.0, 0.1, 0.0, 0.1], "p2o_human": [0.5, 0.6, 0.55], "p2o_human_no_crm": [0.5, 0.55, 0.62],
           "rs_distill": [0.4, 0.5, 0.45]}
V4_WHOLE = {"grpo_k": [-1.0, -1.01, -1.02, -1.03], "p2o_human": [-0.8, -0.82, -0.81],
            "p2o_human_no_crm": [-1.2, -1.22, -1.21], "rs_distill": [-1.01, -1.0, -1.03]}


def test_v4_report_runs_each_contrast_as_its_own_fixed_sequence_over_the_outcomes():
    text = "\n".join(report.confirm_report("subtract", v4_study(V4_AVG, V4_PASS, V4_WHOLE), V4_PLANNED, V4, None))
    assert "**Complete**" in text and "Bonferroni over the four contrasts" in text and "over the twelve" in text
    assert "learn rate" not in text and "no futility rule" in text
    rows = v4_rows(text)
    assert len(rows) == 12
    # C1 on avg@16 by hand, paired over the seeds both ran (0, 1, 2): differences 0.04, 0.04, 0.05, mean 0.04333,
    # sd 0.005774, se 0.003333, t(0.975, 2) 4.3027: [+0.029, +0.058]; t = 13 on 2 df, two-sided p (closed form for
    # 2 df) 1 - t / sqrt(t^2 + 2) = 0.00587, adjusted 4p 0.0235. Beside it Welch's interval (every seed of each):
    # 0.05 - 0.01, se 0.008165, df 4.8 -> 4, t(0.975, 4) 2.7764: [+0.017, +0.063]
    assert ("| 3 : 4 | +0.050 : +0.010 | +0.043 | [+0.029, +0.058] | 0.0059 | 0.023 | [+0.017, +0.063] |"
            in rows["held-out avg@16", "p2o_human - grpo_k"])
    assert all(rows["held-out avg@16", f"{a} - {b}"].endswith("**confirmed** |") for a, b in report.STRATEGY_CONTRASTS)
    # pass@16: the mask contrast is 0 (interval +/-0.11: undecided), so only its own chain stops
    assert rows["held-out pass@16", "p2o_human_no_crm - p2o_human"].endswith("| undecided |")
    assert rows["gold answer mean log-prob", "p2o_human_no_crm - p2o_human"].endswith(
        "not tested (this contrast's earlier outcome was not confirmed) |")
    gold = {c: rows["gold answer mean log-prob", c] for c in ("p2o_human - grpo_k", "p2o_human_no_crm - grpo_k",
                                                                "rs_distill - grpo_k")}
    assert gold["p2o_human - grpo_k"].endswith("**confirmed** |")
    assert gold["p2o_human_no_crm - grpo_k"].endswith("**refuted** (the opposite sign) |")
    assert gold["rs_distill - grpo_k"].endswith("**refuted** (the interval lies within ±0.05) |")


def test_v4_arms_that_do_not_vary_are_never_confirmed_and_refute_only_inside_delta():
    avg = {**V4_AVG, "grpo_k": [0.0] * 4, "p2o_human": [0.0] * 3, "rs_distill": [0.03] * 3}
    text = "\n".join(report.confirm_report("subtract", v4_study(avg, V4_PASS, V4_WHOLE), V4_PLANNED, V4, None))
    rows = v4_rows(text)
    # both constant and equal: the difference is exactly 0, inside +/-0.02 -> refuted, and its chain stops
    assert rows["held-out avg@16", "p2o_human - grpo_k"].endswith(
        "**refuted** (the paired differences do not vary: the difference is exactly +0, within ±0.02) |")
    assert "| - | 1.0 |" in rows["held-out avg@16", "p2o_human - grpo_k"]  # no test; counted with p 1
    assert rows["held-out pass@16", "p2o_human - grpo_k"].endswith("not tested (this contrast's earlier outcome "
                                                                   "was not confirmed) |")
    # both constant, 0.03 apart: no test can confirm it (an exact p of 0 would have opened the gate)
    assert rows["held-out avg@16", "rs_distill - grpo_k"].endswith("undecided (the paired differences do not vary) |")
    assert rows["held-out pass@16", "rs_distill - grpo_k"].endswith("not tested (this contrast's earlier outcome "
                                                                    "was not confirmed) |")
    # the unmasked arm still varies: its chain goes on
    assert rows["held-out avg@16", "p2o_human_no_crm - grpo_k"].endswith("**confirmed** |")


def test_the_subtract_task_names_its_registration_and_every_arm_in_it():
    task = compare.TASKS["subtract"]
    assert task.prereg == V4 and task.prereg in report.REGISTRATIONS and not task.noise
    arms = {a for pair in report.REGISTRATIONS[V4].contrasts for a in pair}
    assert arms == set(task.arms) == set(task.seeds)
    assert not set().union(*map(set, task.seeds.values())) & {0, 1}  # the training pilot's seeds take no part


def test_greedy_answers_are_parsed_never_evaluated():
    assert [report.greedy_answer(t) for t in ("2 − 7 = -5. The answer is \\boxed{-5}.", "\\boxed{−5}", "\\boxed{ 5 }",
                                             "\\boxed{-5.}", "\\boxed{x}", "no box", "\\boxed{2+3}", None)] == \
        [-5, -5, 5, -5, None, None, None, None]


def test_the_degenerate_policy_guards_by_hand():
    from data import load_jsonl

    held = load_jsonl("subtract-heldout")[0]
    hard = [p for p in held if p.source == report.HARD]

    def run(arm, seed, reply, pos):
        rows = {p.id: {"greedy_response": reply(p), "correct": 0, "k": 16, "greedy": 0} for p in held}
        return {"arm": arm, "seed": seed, "problems": {("final", "heldout"): rows},
                "sets": {"final": {"heldout": {"by_source": {"subtract-heldout/pos": {"avg@16": pos}}}}}}

    constant = [run("grpo_k", s, lambda p: "\\boxed{-1}", 0.5) for s in (0, 1)]  # a constant -1
    flipped = [run("rs_distill", 0, lambda p: f"\\boxed{{{-int(p.answer)}}}", 0.0)]  # right size, wrong sign
    lines = report.answer_spread_lines({"grpo_k": constant, "rs_distill": flipped}, {"grpo_k": (0, 1), "rs_distill": (0,)})
    # -1 is the answer of 5 of the 45 (one difference of nine): right and right-sized 5/45 = 0.111, all one answer
    assert "| grpo_k | 2 | 0.500 | 1.000 | 0.111 | 0.111 |" in lines
    # the negated answers: every size right, none right, the most common answer one of nine values (5 each)
    assert "| rs_distill | 1 | 0.000 | 0.111 | 1.000 | 0.000 |" in lines
    assert len(hard) == 45


def test_the_probes_fact_token_is_the_last_of_the_first_tokens_that_spell_it():
    rows = [{"token": t} for t in ("24", " −", " 29", " =", " -", "5", ".", " 13", " 1", "3")]
    assert report.fact_token(rows, "-") is rows[4]  # the sign of "= -5", not the "−" of the problem
    assert report.fact_token(rows, "13") is rows[7]  # one token
    assert report.fact_token(rows[8:], "13") is rows[9]  # or two
    with pytest.raises(ValueError, match="no '7'"):
        report.fact_token(rows, "7")
