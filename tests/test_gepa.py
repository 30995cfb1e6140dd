"""GEPA (gepa.py): Pareto selection, set cover, assignment, the guards, the budget cap and a scripted round."""
import itertools
import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

import pytest

import train
from gepa import (AUTO_CANDIDATES, accept_child, assign_templates, auto_budget, copies_problem, dev_cap,
                  greedy_set_cover, guard, number_value, numbers_in, pareto_fronts, prune_dominated,
                  read_seed_templates, reflection_record, run_gepa, select_parents, split_dev_train)

CFG = train.Config()


@dataclass
class HardItem:  # what run_gepa reads of a hard prompt (train.py passes data.Problem rows)
    id: str
    problem: str
    answer: str


def test_pareto_fronts_keep_ties_and_skip_unsolved_items():
    S = [[0, 1, 0, 0],
         [1, 1, 0, 0],
         [1, 0, 0, 1]]
    assert pareto_fronts(S) == [{1, 2}, {0, 1}, {2}]  # item 2 solved by nobody: no front


def test_a_covered_candidate_is_pruned():
    S = [[1, 1, 0],   # 0: its fronts {0,1,2} and {0,1} both also hold 1
         [1, 1, 1],   # 1: on every front
         [1, 0, 0]]   # 2: only on front of item 0, which also holds 1
    fronts = pareto_fronts(S)
    assert prune_dominated(fronts, S) == {1}
    # two candidates that each own one item both survive
    S2 = [[1, 0], [0, 1], [1, 0]]
    assert prune_dominated(pareto_fronts(S2), S2) in ({0, 1}, {1, 2})
    assert prune_dominated(pareto_fronts(S2), S2) == {0, 1}  # weakest-first removes the newest twin


def test_parents_drawn_in_proportion_to_fronts():
    S = [[1, 1, 1, 0], [0, 0, 0, 1]]  # candidate 0 on 3 fronts, candidate 1 on 1
    draws = Counter(select_parents(S, 20_000, random.Random(0)))
    assert draws[0] / 20_000 == pytest.approx(0.75, abs=0.02)
    # nothing solved yet: uniform over the pool
    zero = Counter(select_parents([[0, 0], [0, 0]], 10_000, random.Random(1)))
    assert zero[0] / 10_000 == pytest.approx(0.5, abs=0.03)


def test_greedy_set_cover_by_hand():
    S = [[0, 0, 0, 0, 0],
         [1, 1, 1, 0, 0],
         [0, 0, 1, 1, 0],
         [0, 0, 0, 1, 0]]
    assert greedy_set_cover(S) == [1, 2]  # 3 items, then 1 new; item 4 unsolvable
    assert greedy_set_cover([[0, 0]]) == []


def test_assignment_distribution():
    pool = ["", "A", "B"]
    S = [[0, 0, 0], [1, 1, 0], [0, 1, 1]]  # mean dev: A 2/3, B 2/3
    chosen = greedy_set_cover(S)
    assert chosen == [1, 2]
    rng = random.Random(0)
    out = assign_templates(pool, S, chosen, ["d0", "d1", "d2"], ["t0"], 6, rng)
    assert out["d0"] == ["A"] * 6 and out["d2"] == ["B"] * 6  # only one chosen template solves them
    many = assign_templates(pool, S, chosen, ["d0", "d1", "d2"], ["t0"], 6000, random.Random(1))
    assert Counter(many["t0"])["A"] / 6000 == pytest.approx(0.5, abs=0.03)  # equal mean scores
    same = assign_templates(pool, S, chosen, ["d0", "d1", "d2"], ["t0"], 6, rng, same_for_group=True)
    assert all(len(set(v)) == 1 and len(v) == 6 for v in same.values())
    assert assign_templates(pool, [[0, 0, 0]] * 3, [], ["d0"], [], 6, rng) == {}


def test_split_dev_train():
    dev, train = split_dev_train(range(10), dev_max=300, rng=random.Random(0))
    assert len(dev) == 5 and len(train) == 5 and set(dev) | set(train) == set(range(10))
    dev, train = split_dev_train(range(1000), dev_max=300, rng=random.Random(0))
    assert len(dev) == 300


MB = [HardItem("a", "Tom has 3 apples and buys 4 bags with 5 apples each. How many now?", "23"),
      HardItem("b", "What is 7 + 4 × 3?", "19")]


@pytest.mark.parametrize("text, finished, parent, reason", [
    ("<template>Multiply first.</template>", False, "", "truncated"),
    ("Multiply first.", True, "", "no_delimiter"),
    ("<template>Multiply first.", True, "", "no_delimiter"),
    ("<template>  </template>", True, "", "empty"),
    ("<template>" + "Think. " * 100 + "</template>", True, "", "too_long"),
    ("<template>Do the multiplication first and then the addition, always.</template>", True, "Multiply first.", "too_long"),
    ("<template>add the numbers add the numbers add the numbers</template>", True, "", "repetition"),
    ("<template>multiply   FIRST.</template>", True, "Multiply first.", "duplicate"),
    ("<template>Seed dup</template>", True, "", "duplicate"),
    ("<template>Think, then answer.<|im_end|></template>", True, "", "special_tokens"),
    ("<template>Do not use \\boxed, write the answer in words.</template>", True, "", "format_conflict"),
    ("<template>The result is 19, check it.</template>", True, "", "answer_leak"),
    ("<template>Note: tom has 3 apples and buys 4 bags with five.</template>", True, "", "problem_copy"),
])
def test_each_guard_rejects_its_case(text, finished, parent, reason):
    assert guard(text, finished, parent, ["", "seed DUP"], MB, CFG) == (None, reason)


def test_guard_accepts_a_good_template():
    out = guard("Sure! <template> Multiply before you add; then check. </template> Done.", True, "", [""], MB, CFG)
    assert out == ("Multiply before you add; then check.", "ok")
    assert guard("<template>Use 190 steps.</template>", True, "", [""], MB, CFG)[1] == "ok"  # 19 inside 190 is no leak


@pytest.mark.parametrize("text, values", [
    ("The answer is 19.", {19}),  # a full stop is not a decimal point
    ("19.0 and 2.50", {19, Fraction(5, 2)}),
    ("1,000 or 2,500,000 grams", {1000, 2500000}),
    ("1/2 and 6/4", {Fraction(1, 2), Fraction(3, 2)}),
    ("\\frac{3}{4}, \\dfrac{1}{2} and \\tfrac{ 5 }{ 10 }", {Fraction(3, 4), Fraction(1, 2)}),
    ("0.5 and .25", {Fraction(1, 2), Fraction(1, 4)}),
    ("Nineteen, seven, zero, twenty-one, ninety", {19, 7, 0, 21, 90}),
    ("190 and 3.14", {190, Fraction(314, 100)}),  # neither 19 nor 3 nor 14
    ("1,2,3 and x-4", {1, 2, 3, 4}),  # commas not in groups of three; signs are not read
    ("someone often tenth seventh", set()),  # number words only as whole words
    ("Multiply before you add.", set()),
])
def test_numbers_in_reads_values_not_spellings(text, values):
    assert numbers_in(text) == values


@pytest.mark.parametrize("answer, value", [
    ("19", 19), (" -3 ", 3), ("1,000", 1000), ("0.5", Fraction(1, 2)), ("\\frac{1}{2}", Fraction(1, 2)),
    ("$7$", 7), ("seven", 7), ("x^2+1", None), ("\\sqrt{2}", None), ("3, 4", None), ("2\\sqrt{3}", None),
])
def test_number_value_of_an_answer(answer, value):
    assert number_value(answer) == value


def one_item(answer):
    return [HardItem("q", "Find the value.", answer)]


@pytest.mark.parametrize("template, answer", [
    ("The answer is 19.", "19"),  # was passed: the old lookahead refused a following full stop
    ("Aim for 19.0 exactly.", "19"),
    ("Expect about 1,000 grams.", "1000"),
    ("Note 1000 and move on.", "1,000"),
    ("Halving gives 1/2 often.", "\\frac{1}{2}"),
    ("Expect 0.5 here.", "\\frac{1}{2}"),
    ("Expect \\dfrac{1}{2} here.", "0.5"),
    ("Count up to nineteen first.", "19"),
    ("Seven is a lucky guess.", "7"),
    ("Think of twenty-one cards.", "21"),
    ("Try x^2 + 1 first.", "x^2+1"),
    ("Try \\sqrt {2} first.", "\\sqrt{2}"),
])
def test_guard_rejects_every_spelling_of_the_answer(template, answer):
    out = guard(f"<template>{template}</template>", True, "", [""], one_item(answer), CFG)
    assert out == (None, "answer_leak")


@pytest.mark.parametrize("template, answer", [
    ("Use 190 steps.", "19"),
    ("Keep 3.14 in mind.", "3"),
    ("Keep 3.14 in mind.", "14"),
    ("Add 1/20 of it.", "\\frac{1}{2}"),
    ("Try x^2+10 first.", "x^2+1"),
    ("Be someone who checks often.", "1"),
])
def test_guard_passes_a_number_that_only_contains_the_answer(template, answer):
    assert guard(f"<template>{template}</template>", True, "", [""], one_item(answer), CFG) == (template, "ok")


@pytest.mark.parametrize("answer", ["19", "\\frac{1}{2}", "x^2+1"])
def test_a_template_echoing_the_reflection_record_is_rejected(answer):
    item = HardItem("q", "Find the value.", answer)
    record = reflection_record(item, "I think it is 33.", CFG.reflect_answer_chars)
    assert record.endswith(f"the correct answer is {answer}.")  # the reflector is told the answer, on purpose
    echo = record[record.index("the correct answer is"):]
    assert guard(f"<template>Remember: {echo}</template>", True, "", [""], [item], CFG) == (None, "answer_leak")


def test_copies_problem_whole_words_and_short_problems():
    short = "What is 7 + 4 × 3?"  # 7 words, fewer than guard_copy_words = 8
    assert copies_problem("Solve what is 7 + 4 × 3 carefully.", short, 8)  # '3?' matches '3'
    assert not copies_problem("Ask what is 7 + 4 first.", short, 8)  # 5 of its 7 words
    assert not copies_problem("somewhat is 7 + 4 × 3", short, 8)  # 'what' only inside a longer word
    long = MB[0].problem  # 15 words: 8 consecutive ones are a copy
    assert copies_problem("So tom has 3 apples and buys 4 bags!", long, 8)
    assert not copies_problem("So tom has 3 apples and buys 4", long, 8)


def test_guard_rejects_a_copied_short_problem():
    assert guard("<template>First ask: what is 7 + 4 × 3? Then multiply.</template>", True, "", [""], MB,
                 CFG) == (None, "problem_copy")
    assert guard("<template>Ask what is 7 + 4 first.</template>", True, "", [""], MB, CFG)[1] == "ok"


def make_hard(n):
    return [HardItem(f"h{i}", f"What is {i % 9 + 1} + {i % 7 + 2} × {i % 5 + 2}?",
                     str(i % 9 + 1 + (i % 7 + 2) * (i % 5 + 2))) for i in range(n)]


def scripted_answer(pairs, kind):
    """A 'policy' that solves a + b × c only when told to multiply first."""
    assert kind in ("gepa_dev", "gepa_minibatch")
    out = []
    for template, item in pairs:
        problem = item.problem
        a, b, c = [int(x) for x in problem.replace("What is ", "").replace("?", "").replace("×", "+").split("+")]
        value = a + b * c if "multiply first" in template.lower() else (a + b) * c
        out.append(f"The answer is \\boxed{{{value}}}.")
    return out


def test_run_gepa_end_to_end_with_scripted_models():
    calls = []

    def reflect(prompts):
        calls.append(len(prompts))
        return scripted_reflect(prompts)

    hard = make_hard(12)
    cfg = train.Config(gepa_budget=60, gepa_parents=2, gepa_minibatch=3, group_size=4)
    res = run_gepa(hard, scripted_answer, reflect, cfg, random.Random(0))
    assert res.pool[0] == "" and "Multiply first, then add." in res.pool
    child = res.pool.index("Multiply first, then add.")
    assert res.parents[child] == 0 and sum(res.scores[child]) == len(res.dev_ids) == 6
    assert sum(res.scores[0]) < 6
    assert res.chosen[0] == child
    assert set(res.assignment) == {h.id for h in hard}
    assert all(v == ["Multiply first, then add."] * 4 for k, v in res.assignment.items() if k in res.dev_ids[:1])
    assert res.rejections["no_delimiter"] >= 1 and res.reflection_calls == sum(calls)
    # accounting: seed on dev (6) + per iteration 2 parents x 3, + 3 for a tested child, + 6 for an accepted one
    accepted = sum(e["outcome"] == "accepted" for e in res.log)
    tested = sum(e.get("reason") == "not_better" for e in res.log) + accepted
    parents_answered = sum(1 for e in res.log) - 0  # every proposal or skip came from one parent minibatch
    assert res.metric_calls == 6 + 3 * parents_answered + 3 * tested + 6 * accepted
    # the budget was used up to less than one more proposal's reservation (2b + |dev| = 12)
    assert res.metric_calls <= cfg.gepa_budget < res.metric_calls + 2 * 3 + 6
    js = res.to_json()
    assert js["best_dev_score"] == 1.0 and js["rejections"]["no_delimiter"] >= 1
    assert js["budget"] == 60 and js["metric_calls"] == res.metric_calls


def scripted_reflect(prompts):
    """One helpful proposal per call; the others have no delimiter."""
    assert all("the correct answer is" in p and "<template>" in p for p in prompts)
    return [("<template>Multiply first, then add.</template>", True)] + \
           [("no delimiter here", True)] * (len(prompts) - 1)


def varied_reflect():
    """A reflector whose proposals are all new: two helpful ('multiply first') to one unhelpful, so
    several children can be accepted in one iteration (each then scored on dev) and some are not better."""
    counter = itertools.count()

    def reflect(prompts):
        out = []
        for _ in prompts:
            i = next(counter)
            tag = chr(97 + i % 26) + chr(97 + i // 26 % 26)
            out.append((f"<template>{'Add' if i % 3 == 2 else 'Multiply'} first, tag {tag}.</template>", True))
        return out
    return reflect


def test_an_iteration_answers_in_at_most_three_calls():
    """Issue 25: gepa.propose answers every parent's minibatch in one call, every child's in one,
    every accepted child's dev set in one (the seed pool's dev answers: one call). That the batched
    round is the one-at-a-time round: the hand-counted rounds of tests/test_gepa_official.py."""
    calls = []

    def counting(pairs, kind):
        calls.append((kind, len({t for t, _ in pairs})))
        return scripted_answer(pairs, kind)

    cfg = train.Config(gepa_budget=120, gepa_parents=4, gepa_minibatch=3, group_size=4)
    batched = run_gepa(make_hard(40), counting, varied_reflect(), cfg, random.Random(1))
    iterations = sorted({e["iteration"] for e in batched.log})
    tested = {e["iteration"] for e in batched.log if "minibatch" in e}
    accepted = {e["iteration"] for e in batched.log if e["outcome"] == "accepted"}
    assert len(calls) == 1 + len(iterations) + len(tested) + len(accepted)
    assert max(n for kind, n in calls if kind == "gepa_minibatch") > 1  # several templates in one call
    assert sum(e["outcome"] == "accepted" for e in batched.log) > len(accepted)  # some iteration accepted two


def test_dev_cap():
    assert dev_cap(train.Config(gepa_budget=200, gepa_minibatch=3, gepa_dev_max=300)) == 97  # (200 - 6) // 2
    assert dev_cap(train.Config(gepa_budget=30, gepa_minibatch=3)) == 12
    assert dev_cap(train.Config(gepa_budget=200, gepa_minibatch=3, gepa_dev_max=5)) == 5
    assert dev_cap(train.Config(gepa_budget=8, gepa_minibatch=3)) == 1  # seed 1 + one proposal 3 + 3 + 1
    with pytest.raises(ValueError, match="budget 7 .* b=3"):
        dev_cap(train.Config(gepa_budget=7, gepa_minibatch=3))


def test_accept_child_needs_a_strictly_higher_minibatch_score():
    assert accept_child(1, 2)
    assert not accept_child(2, 2)  # a tie is rejected
    assert not accept_child(2, 1)


def test_budget_is_a_hard_cap():
    b = 3
    for budget in range(20, 81):
        runs = [(0, scripted_reflect, 12), (1, varied_reflect(), 40), (2, varied_reflect(), 12)]
        for seed, reflect, n_hard in runs:
            cfg = train.Config(gepa_budget=budget, gepa_parents=4, gepa_minibatch=b)
            res = run_gepa(make_hard(n_hard), scripted_answer, reflect, cfg, random.Random(seed))
            n_dev = len(res.dev_ids)
            assert n_dev == min(n_hard // 2, (budget - 2 * b) // 2)
            assert res.metric_calls <= budget, (budget, seed, res.metric_calls)
            # the round ends only when the next proposal's reservation no longer fits
            assert budget - res.metric_calls < 2 * b + n_dev, (budget, seed, res.metric_calls)
            outcomes = Counter(e.get("reason", e["outcome"]) for e in res.log)
            spent = n_dev + b * len(res.log) + b * (outcomes["not_better"] + outcomes["accepted"]) \
                + n_dev * outcomes["accepted"]
            assert res.metric_calls == spent and res.to_json()["budget"] == budget


def test_budget_30_round_stays_within_30():
    cfg = train.Config(gepa_budget=30, gepa_parents=4, gepa_minibatch=3)
    res = run_gepa(make_hard(12), scripted_answer, scripted_reflect, cfg, random.Random(0))
    assert res.metric_calls <= 30 and res.reflection_calls >= 1


def test_a_large_hard_set_caps_dev_and_still_proposes():
    cfg = train.Config(gepa_budget=200, gepa_minibatch=3, gepa_dev_max=300)
    hard = make_hard(500)
    res = run_gepa(hard, scripted_answer, scripted_reflect, cfg, random.Random(0))
    assert len(res.dev_ids) == 97  # not 250: the seed (97) plus one proposal (3 + 3 + 97) is 200
    assert res.metric_calls <= 200 and res.reflection_calls >= 1
    assert any(e["outcome"] == "accepted" for e in res.log)
    assert set(res.assignment) == {h.id for h in hard}


def test_a_budget_too_small_for_one_proposal_raises():
    with pytest.raises(ValueError, match="budget 7"):
        run_gepa(make_hard(12), scripted_answer, scripted_reflect, train.Config(gepa_budget=7, gepa_minibatch=3),
                 random.Random(0))


def test_auto_budget_matches_the_reference_presets_by_hand():
    # heavy_4 on 300 dev items, the figure docs/GPU.md quotes: C 72 -> N = max(4 log2 72, 108) = 108
    assert auto_budget("heavy_4", 300) == 300 + 72 * 5 + 108 * 35 + ((108 + 1) // 5 + 1) * 300 == 11040
    # light: C 6 -> N = int(max(4 log2 6 = 10.34, 9)) = 10 -> V + 30 + 350 + (11 // 5 + 1) V = 4 V + 380
    assert auto_budget("light", 50) == 4 * 50 + 380
    # medium: C 12 -> N = int(max(14.34, 18)) = 18 -> V + 60 + 630 + (19 // 5 + 1) V
    assert auto_budget("medium", 10) == 10 + 60 + 630 + 4 * 10
    assert set(AUTO_CANDIDATES) == {"light", "medium", "heavy", "heavy_2", "heavy_3", "heavy_4", "heavy_16"}


def test_a_preset_sizes_the_budget_from_the_dev_set():
    cfg = train.Config(gepa_auto="light", gepa_dev_max=4, gepa_budget=1, gepa_parents=2, gepa_minibatch=3,
                       gepa_max_iterations=1000)
    res = run_gepa(make_hard(12), scripted_answer, varied_reflect(), cfg, random.Random(0))
    assert len(res.dev_ids) == 4 and res.budget == 4 * 4 + 380  # gepa_budget=1 is ignored
    assert res.metric_calls <= res.budget < res.metric_calls + 2 * 3 + 4  # spent up to the last reservation


def test_human_seed_templates_join_the_pool_and_are_scored_and_assigned(tmp_path):
    path = tmp_path / "seeds.txt"
    path.write_text("# human-written\nMultiply first, then add.\n\nRead the problem twice.\nMultiply first, then add.\n")
    seeds = read_seed_templates(str(path), 300)
    assert seeds == ["Multiply first, then add.", "Read the problem twice."]  # comments, blanks, repeats dropped
    cfg = train.Config(gepa_budget=40, gepa_parents=2, gepa_minibatch=3, group_size=4)
    calls = []
    res = run_gepa(make_hard(12), scripted_answer, lambda p: calls.append(p) or scripted_reflect(p), cfg,
                   random.Random(0), seeds=seeds)
    n_dev = len(res.dev_ids)
    assert n_dev == min(6, (40 - 6) // (2 + 2)) == 6
    assert res.pool[:3] == ["", *seeds] and res.parents[:3] == [-1, -1, -1]
    assert sum(res.scores[1]) == n_dev and sum(res.scores[2]) < n_dev  # the helpful seed solves every dev item
    assert res.chosen == [1]  # set cover picks the seed: nothing else adds an item
    assert all(set(v) == {"Multiply first, then add."} for v in res.assignment.values())
    # the seeds' dev evaluations are metric calls like any candidate's: 3 x |dev| before any proposal
    outcomes = Counter(e.get("reason", e["outcome"]) for e in res.log)
    assert res.metric_calls == 3 * n_dev + 3 * len(res.log) + 3 * (outcomes["not_better"] + outcomes["accepted"]) \
        + n_dev * outcomes["accepted"]
    assert res.metric_calls <= 40


def test_bad_seed_template_files_are_clear_errors(tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("ok\n" + "x" * 301 + "\n")
    with pytest.raises(ValueError, match="long.txt:2: template of 301 characters"):
        read_seed_templates(str(long), 300)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no template"):
        read_seed_templates(str(empty), 300)
    with pytest.raises(ValueError, match="3 seed templates"):  # budget 20, b 3: (20 - 6) // 5 = 2 dev items ok...
        dev_cap(train.Config(gepa_budget=10, gepa_minibatch=3), n_seeds=3)  # ... 10: (10 - 6) // 5 = 0


def test_bare_rollout_leaves_the_first_of_k_without_a_template():
    pool, scores = ["", "A", "B"], [[0, 0], [1, 0], [0, 1]]
    out = assign_templates(pool, scores, [1, 2], ["d0", "d1"], ["t0"], 6, random.Random(0), bare=True)
    assert out["d0"] == [""] + ["A"] * 5 and out["d1"] == [""] + ["B"] * 5  # K - 1 drawn from the solvers
    assert out["t0"][0] == "" and len(out["t0"]) == 6 and "" not in out["t0"][1:]
    same = assign_templates(pool, scores, [1, 2], ["d0", "d1"], ["t0"], 4, random.Random(0), same_for_group=True,
                            bare=True)
    assert same["d1"] == ["", "B", "B", "B"] and len(set(same["t0"][1:])) == 1


def test_one_gepa_round_with_the_real_default_model(vllm_engine, hf_model, model_path):
    """The real wiring of train.py: the default model answers greedily and, as the frozen initial
    policy swapped into the engine ("init", the default), reflects. At 135M most proposals fail
    the guards; the test checks the round runs, accounts and archives, not that it succeeds."""
    import json
    from collections import Counter as C

    import train
    from data import load_jsonl

    hard = [p for p in load_jsonl("builtin-train")[0] if p.source == "builtin/two_step"][:6]
    cfg = train.Config(gepa_budget=12, gepa_parents=2, gepa_minibatch=2, max_tokens=48, reflect_max_tokens=96,
                       group_size=4)
    counts = C()
    from verify import reward
    reflector = train.make_reflector(cfg, vllm_engine, model_path, hf_model.state_dict(), counts)
    result = train.gepa_round(cfg, 0, hard, vllm_engine, reflector, counts,
                              lambda text, problem: reward(text, problem.answer))
    assert result.pool[0] == "" and len(result.scores) == len(result.pool)
    assert len(result.dev_ids) == 3 and len(result.train_ids) == 3
    assert result.metric_calls <= cfg.gepa_budget and result.reflection_calls > 0
    assert counts["gepa_dev_rollouts"] + counts["gepa_minibatch_rollouts"] == result.metric_calls
    assert counts["reflection_calls"] == result.reflection_calls and counts["reflection_tokens"] > 0
    allowed = {"truncated", "no_delimiter", "empty", "too_long", "repetition", "duplicate", "special_tokens",
               "format_conflict", "answer_leak", "problem_copy", "not_better"}
    assert set(result.rejections) <= allowed
    outcomes = C(e["outcome"] for e in result.log)
    assert sum(outcomes.values()) == len(result.log) and set(outcomes) <= {"accepted", "rejected", "skipped_all_correct"}
    json.dumps(result.to_json())  # the archive is plain JSON
    # the engine is back on the policy weights after the reflector swap
    greedy = vllm_engine.generate([[{"role": "user", "content": "What is 2 + 2?"}]], n=1, temperature=0, max_tokens=8)
    from rollout import HFRollout
    hf_ids = HFRollout(None, model=hf_model, tokenizer=vllm_engine.tokenizer).generate(
        [[{"role": "user", "content": "What is 2 + 2?"}]], n=1, temperature=0, max_tokens=8)
    assert greedy[0][0].response_ids == hf_ids[0][0].response_ids
