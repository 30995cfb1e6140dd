"""The reference code's GEPA variants (gepa.py): official parent selection, official budget
accounting, the official reflection prompt and its parser, guards off, and the reflector framing."""
import itertools
import random
from dataclasses import dataclass, replace
from fractions import Fraction
from types import SimpleNamespace

import pytest

import train
from gepa import (CUT_MARKER, DELIM_CLOSE, DELIM_OPEN, cut_middle, dev_cap, extract_template, guard,
                  longest_reflection_prompt, meta_prompt, official_feedback, official_fronts, parent_weights,
                  reflection_cut_chars, reflection_prompt, reflection_record, reflector_framing, reply_after_thought,
                  round_budget, run_gepa, select_parents, select_parents_official)
from rollout import EngineReflector, Sample

CFG = train.Config()
OFFICIAL_PROMPT_CFG = train.Config(reflect_prompt="official")


@dataclass
class HardItem:  # what run_gepa reads of a hard prompt (train.py passes data.Problem rows)
    id: str
    problem: str
    answer: str


def probabilities(weights):
    total = sum(weights.values())
    return {c: Fraction(w, total) for c, w in weights.items()}


class ScriptedRandom(random.Random):
    """random() returns the given values in turn: random.choices with weights picks the first
    candidate whose cumulative weight exceeds random() x total, so each draw is known by hand."""
    def __init__(self, values):
        super().__init__(0)
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


# ----------------------------------------------------------------------------- selection


def incremental_fronts(scores):
    """The reference code's update, replayed: each item starts at {0} with the seed's score; a
    later candidate with a higher score replaces the set, one with an equal score joins it."""
    best, fronts = list(scores[0]), [{0} for _ in scores[0]]
    for c, row in enumerate(scores[1:], 1):
        for j, s in enumerate(row):
            if s > best[j]:
                best[j], fronts[j] = s, {c}
            elif s == best[j]:
                fronts[j].add(c)
    return fronts


@pytest.mark.parametrize("values", [(0, 1), (0, 1, 2)])
def test_official_fronts_equal_the_reference_incremental_update(values):
    rng = random.Random(7)
    for _ in range(300):
        n_cands, n_items = rng.randint(1, 6), rng.randint(1, 8)
        S = [[rng.choice(values) for _ in range(n_items)] for _ in range(n_cands)]
        assert official_fronts(S) == incremental_fronts(S), S


def test_official_fronts_keep_zero_ties():
    S = [[0, 1, 0],
         [1, 1, 0]]
    assert official_fronts(S) == [{1}, {0, 1}, {0, 1}]  # item 2: nobody solves it, both are on its front


def documented_matrix():
    """4 candidates, 54 dev items, 6 of them solved: 0 solves items 0-1, 1 solves 1-4, 2 solves 5,
    3 solves 2 (a front it shares with 1, so ours prunes it)."""
    solves = {0: {0, 1}, 1: {1, 2, 3, 4}, 2: {5}, 3: {2}}
    return [[int(j in solves[c]) for j in range(54)] for c in range(4)]


def test_the_documented_four_candidate_example():
    S = documented_matrix()
    # ours: fronts of the 6 solved items {0} {0,1} {1,3} {1} {1} {2}; 3 is pruned (its one front
    # holds 1), 0, 1, 2 keep 2, 4, 1 fronts -> 2/7, 4/7, 1/7, 0
    assert parent_weights(S) == {0: 2, 1: 4, 2: 1}
    assert probabilities(parent_weights(S)) == {0: Fraction(2, 7), 1: Fraction(4, 7), 2: Fraction(1, 7)}
    # official: the 48 unsolved items put all four on a front, plus 2, 4, 1, 1 -> 50, 52, 49, 49 of 200
    assert parent_weights(S, "official") == {0: 50, 1: 52, 2: 49, 3: 49}
    official = probabilities(parent_weights(S, "official"))
    assert official == {0: Fraction(1, 4), 1: Fraction(13, 50), 2: Fraction(49, 200), 3: Fraction(49, 200)}
    documented = {"ours": [0.287, 0.570, 0.143, 0], "official": [0.25, 0.26, 0.245, 0.245]}
    ours = probabilities(parent_weights(S))
    assert [float(ours.get(c, 0)) for c in range(4)] == pytest.approx(documented["ours"], abs=0.002)
    assert [float(official[c]) for c in range(4)] == pytest.approx(documented["official"], abs=1e-12)


def test_ours_weights_and_draws_are_unchanged_by_the_refactor():
    S = [[1, 1, 1, 0], [0, 0, 0, 1]]  # candidate 0 on 3 fronts, candidate 1 on 1
    assert parent_weights(S) == {0: 3, 1: 1}
    assert select_parents(S, 50, random.Random(3)) == random.Random(3).choices([0, 1], weights=[3, 1], k=50)
    zero = [[0, 0], [0, 0], [0, 0]]  # nothing solved: uniform, drawn by randrange as before
    assert parent_weights(zero) == {0: 1, 1: 1, 2: 1}
    rng = random.Random(4)
    assert select_parents(zero, 5, random.Random(4)) == [rng.randrange(3) for _ in range(5)]


def test_official_takes_every_front_member_when_there_are_at_most_w():
    S = [[0, 1, 0], [1, 0, 0], [1, 1, 0]]  # the unsolved item 2 puts all three on a front
    rng = random.Random(0)
    state = rng.getstate()
    assert select_parents_official(S, 3, rng) == [0, 1, 2]
    assert select_parents_official(S, 16, rng) == [0, 1, 2]
    assert rng.getstate() == state  # nothing drawn
    assert select_parents_official([[0, 0]], 4, rng) == [0]  # the seed alone: one parent
    # candidate 2 alone has the best score on every item: the union is {2}, one parent however large W is
    assert select_parents_official([[0, 0], [0, 0], [1, 1]], 4, rng) == [2]


def test_official_parents_are_distinct_and_follow_the_weights():
    S = documented_matrix()  # weights 50, 52, 49, 49 of 200
    for seed in range(200):
        parents = select_parents_official(S, 3, random.Random(seed))
        assert len(parents) == 3 == len(set(parents))
    # by hand: 0.26 x 200 = 52 -> cumulative [50, 102, 151, 200] -> candidate 1; then among 0, 2, 3
    # (cumulative [50, 99, 148]) 0.99 x 148 = 146.5 -> candidate 3; then among 0, 2 ([50, 99]) 0.5 -> 49.5 -> 0
    assert select_parents_official(S, 3, ScriptedRandom([0.26, 0.99, 0.5])) == [1, 3, 0]
    assert select_parents_official(S, 2, ScriptedRandom([0.0, 0.0])) == [0, 1]


def test_a_candidate_that_only_ties_at_zero_is_drawn_by_official_only():
    S = [[1, 0, 0],
         [0, 1, 0],
         [0, 0, 0]]  # candidate 2 solves nothing: it is only on the front of the unsolved item 2
    assert parent_weights(S) == {0: 1, 1: 1}  # ours: never drawn
    assert parent_weights(S, "official") == {0: 2, 1: 2, 2: 1}
    # 0.9 x 5 = 4.5 -> cumulative [2, 4, 5] -> candidate 2; then among 0, 1 ([2, 4]) 0.1 x 4 -> 0
    assert select_parents_official(S, 2, ScriptedRandom([0.9, 0.1])) == [2, 0]


# ----------------------------------------------------------------------------- accounting


def items(n):
    return [HardItem(f"h{i}", f"Question {i} about zogs?", f"x{i}") for i in range(n)]


def reward(response, item):
    return float(response == f"\\boxed{{{item.answer}}}")


def acceptance_models(every, fence=False):
    """(answer_fn, reflect_fn) under which every `every`-th proposal (reflection) is accepted and
    no other: a proposal marked 'win' answers the first item of its minibatch on its first test (as
    a child: 1 > the parent's 0); on dev, and as a later parent, every template answers nothing.
    So no parent is ever skipped as all correct and every proposal passes the guards."""
    tested, counter = set(), itertools.count(1)

    def answer(pairs, kind):  # a call may hold several templates' minibatches (gepa.propose batches them)
        firsts = {}  # template -> its first item in this call: the first of its minibatch
        for t, item in pairs:
            firsts.setdefault(t, item)
        out = [f"\\boxed{{{item.answer}}}" if kind == "gepa_minibatch" and "win" in t and t not in tested
               and item is firsts[t] else "\\boxed{no}" for t, item in pairs]
        if kind == "gepa_minibatch":
            tested.update(t for t, _ in pairs)
        return out

    def reflect(prompts):
        out = []
        for _ in prompts:
            i = next(counter)
            tag = "".join(chr(97 + i // 26 ** k % 26) for k in range(3))
            text = f"Plan {tag}{' win' if i % every == 0 else ''}."
            out.append((f"```\n{text}\n```" if fence else f"{DELIM_OPEN}{text}{DELIM_CLOSE}", True))
        return out
    return answer, reflect


def run_scripted(every=3, hard=12, seed=0, **over):
    settings = dict(gepa_dev_max=4, gepa_parents=2, gepa_minibatch=3, group_size=4, gepa_max_iterations=1000)
    cfg = train.Config(**{**settings, **over})
    answer, reflect = acceptance_models(every, fence=cfg.reflect_prompt == "official")
    res = run_gepa(items(hard), answer, reflect, cfg, random.Random(seed), reward_fn=reward)
    iterations = 1 + max((e["iteration"] for e in res.log), default=-1)
    accepted = sum(e["outcome"] == "accepted" for e in res.log)
    return res, iterations, len(res.log), accepted


# |dev| 4, W 2, b 3, proposals 3, 6, 9, ... accepted; a proposal costs 3 + 3 calls, + 4 if accepted.
@pytest.mark.parametrize("over, iterations, proposals, accepted, made, charged", [
    # ours: seed 4; reservations of 2b + |dev| = 10: budget 20 -> 1 parent (16 left), 1 (10), then 0
    (dict(gepa_budget=20), 2, 2, 0, 4 + 6 + 6, 16),
    # budget 40: 2 parents (36 left: 3 reservations), 2 (24: 2; p3 accepted: 6 + 4), then 8 left: 0
    (dict(gepa_budget=40), 2, 4, 1, 4 + 12 + 16, 32),
    # official: iterations 0-1 free (12 + 16 made); then 6 per iteration + 4 per accept:
    # it2 p5 p6* 10 (rem 10), it3 6 (rem 4), it4 p9* 10 (rem -6): stop. Made 4 + 12 + 16 + 16 + 12 + 16
    (dict(gepa_budget=20, gepa_accounting="official"), 5, 10, 3, 76, 26),
    # budget 40: it4 leaves 14, it5 p12* 10 (4), it6 6 (-2): stop; made 76 + 16 + 12
    (dict(gepa_budget=40, gepa_accounting="official"), 7, 14, 4, 104, 42),
    # official selection too: the union of the fronts is the pool (nothing is solved on dev):
    # parents 1, 1, 1 (p3* -> pool 2), 2, 2 (p6*); made 4 + 6 + 6 + 10 + 12 + 16;
    # charged it2 3 + 4, it3 6, it4 6 + 4 = 23
    (dict(gepa_budget=20, gepa_accounting="official", gepa_selection="official"), 5, 7, 2, 54, 23),
])
def test_metric_calls_made_and_charged_by_hand(over, iterations, proposals, accepted, made, charged):
    res, n_iter, n_prop, n_acc = run_scripted(**over)
    assert len(res.dev_ids) == 4
    assert (n_iter, n_prop, n_acc, res.metric_calls, res.charged) == (iterations, proposals, accepted, made, charged)
    assert res.summary()["charged"] == res.to_json()["charged"] == charged
    assert res.summary()["metric_calls"] == made and len(res.pool) == 1 + accepted


def test_official_parents_per_iteration_and_no_trimming():
    res, *_ = run_scripted(gepa_budget=20, gepa_accounting="official", gepa_selection="official")
    per_iteration = [sum(e["iteration"] == i for e in res.log) for i in range(5)]
    assert per_iteration == [1, 1, 1, 2, 2]
    assert [e["parent"] for e in res.log if e["iteration"] == 4] == [0, 1]  # distinct, sorted: the whole union
    # ours selection under official accounting: W = 2 every iteration, even when 4 < 2b + |dev| remain
    res, *_ = run_scripted(gepa_budget=20, gepa_accounting="official")
    assert [sum(e["iteration"] == i for e in res.log) for i in range(5)] == [2] * 5
    assert res.metric_calls > res.budget == 20  # the rule, not a bug


def test_max_iterations_still_bounds_an_official_round():
    _, iterations, proposals, _ = run_scripted(gepa_budget=10 ** 6, gepa_accounting="official", gepa_max_iterations=3)
    assert (iterations, proposals) == (3, 6)


def test_official_accounting_does_not_size_dev_by_the_budget():
    cfg = train.Config(gepa_budget=7, gepa_minibatch=3, gepa_dev_max=300, gepa_accounting="official")
    assert dev_cap(cfg) == 300 and dev_cap(cfg, n_seeds=3) == 300
    assert round_budget(cfg, 300, 3) == 7  # the seeds' 4 x 300 dev answers are not charged
    with pytest.raises(ValueError):
        dev_cap(replace(cfg, gepa_accounting="ours"))  # ours: 7 cannot hold 2b + 2 calls
    res, iterations, proposals, _ = run_scripted(every=100, gepa_budget=7, gepa_dev_max=300,
                                                 gepa_accounting="official")
    assert len(res.dev_ids) == 6  # half of the 12 hard items
    # iterations 0 and 1 are free, iteration 2 charges 2 x 3 = 6 (< 7), iteration 3 reaches 12: stop after it
    assert (iterations, proposals, res.charged) == (4, 8, 12)


def loop_model(budget, V, W, b, every, official_accounting, official_selection):
    """The two budget rules with nothing else (no guards, no skips, nothing solved on dev):
    -> (proposals, calls made, charged, iterations). An independent statement of what run_gepa must do."""
    made, charged, proposals, pool, iteration = V, 0, 0, 1, 0
    while True:
        if official_accounting:
            n = W if iteration < 2 or charged < budget else 0
        else:
            n = min(W, (budget - made) // (2 * b + V))
        if official_selection:
            n = min(n, pool)  # the union of the fronts is the whole pool
        if n < 1:
            return proposals, made, (charged if official_accounting else made), iteration
        wins = sum((proposals + k) % every == 0 for k in range(1, n + 1))
        proposals, made, pool = proposals + n, made + 2 * b * n + V * wins, pool + wins
        charged += 0 if iteration < 2 else b * n + V * wins
        iteration += 1


@pytest.mark.parametrize("accounting, selection, expected", [
    # ours: 500 proposals (parents trimmed to the reservations of 306 that fit once fewer than 16
    # remain, hence 61 iterations); 300 + 500 x 6 + 25 x 300; then 240 left < 306
    ("ours", "ours", (500, 300 + 500 * 6 + 25 * 300, 10_800, 61)),
    # official: 40 iterations of 16; made 300 + 640 x 6 + 32 x 300; charged from iteration 2:
    # 38 x 48 + 31 accepted x 300 = 11,124 (10,776 before the last: still below 11,040)
    ("official", "ours", (640, 300 + 640 * 6 + 32 * 300, 38 * 48 + 31 * 300, 40)),
    # official selection as well: min(W, pool) parents (1, 1, 1, 2, ... while the pool grows by one
    # child in 20 proposals), so more iterations; figures from loop_model
    ("official", "official", (621, 13_326, 11_157, 87)),
])
def test_simulated_heavy_4_round(accounting, selection, expected):
    """heavy_4 (V = 300, W = 16, b = 3: budget 11,040), every 20th proposal accepted (5 %). The
    official prompt only because ours verifies each answer in its records (25 ms a sympy call)."""
    cfg = train.Config(gepa_auto="heavy_4", gepa_dev_max=300, gepa_parents=16, gepa_minibatch=3,
                       gepa_max_iterations=1000, gepa_accounting=accounting, gepa_selection=selection,
                       reflect_prompt="official")
    answer, reflect = acceptance_models(20, fence=True)
    res = run_gepa(items(600), answer, reflect, cfg, random.Random(0), reward_fn=reward)
    assert res.budget == 11_040 and len(res.dev_ids) == 300
    got = (len(res.log), res.metric_calls, res.charged, 1 + res.log[-1]["iteration"])
    assert got == loop_model(11_040, 300, 16, 3, 20, accounting == "official", selection == "official")
    assert got == expected


# ----------------------------------------------------------------------------- the official prompt


MB = [HardItem("a", "Tom has 3 apples and buys 4 bags with 5 apples each. How many now?", "23"),
      HardItem("b", "What is 7 + 4 × 3?", "19"),
      HardItem("c", "What is 2 + 2?", "4"),
      HardItem("d", "What is 9 - 2?", "7")]


def test_official_feedback_cases():
    fmt = official_feedback("no box here", "23", 0.0)
    assert fmt.startswith("The final answer has to be given once") and "The correct answer is '23'." in fmt
    assert fmt.endswith("\n\nReward: 0.00")
    assert official_feedback("\\boxed{3} then \\boxed{4}", "4", 1.0).startswith("The final answer has to be given")
    assert official_feedback("so \\boxed{4}", "4", 1.0) == \
        "The final answer is correct. The correct answer is '4'.\n\nReward: 1.00"
    assert official_feedback("so \\boxed{5}", "4", 0.0) == \
        "The final answer is wrong. The correct answer is '4'.\n\nReward: 0.00"
    assert len(fmt) > len(official_feedback("\\boxed{x}", "23", 0.0))  # the longest: longest_reflection_prompt


def test_the_official_prompt_shows_template_examples_and_asks_for_domain_facts():
    cfg = replace(OFFICIAL_PROMPT_CFG, reflect_answer_chars=20)
    responses = ["I count " + "and count " * 10 + "\\boxed{23}", "7 + 12 = \\boxed{19}", "\\boxed{5}", "seven"]
    prompt = reflection_prompt(cfg, "Multiply first.", MB, responses, [1.0, 1.0, 0.0, 0.0])
    assert prompt.startswith("An assistant was given the instruction below for a task I want done:\n"
                             "```\nMultiply first.\n```\n")
    first = ("# Example 1\n## Input\nTom has 3 apples and buys 4 bags with 5 apples each. How many now?\n"
             "Put the final answer in \\boxed{}.\n\n"  # the user message as the policy saw it (default format)
             "## Response\nI count and count an\n\n"  # 20 characters leave no room for the marker: the start
             "## Feedback\nThe final answer is correct. The correct answer is '23'.\n\nReward: 1.00")
    assert "```\n" + first + "\n\n# Example 2\n" in prompt
    third = ("# Example 3\n## Input\nWhat is 2 + 2?\nPut the final answer in \\boxed{}.\n\n## Response\n\\boxed{5}\n\n"
             "## Feedback\nThe final answer is wrong")
    assert third in prompt
    assert "## Response\nseven\n\n## Feedback\nThe final answer has to be given once" in prompt  # no \boxed
    assert "niche, domain-specific facts" in prompt and "infer a detailed description" in prompt
    assert "strategy that would also work" in prompt
    assert prompt.endswith("Give the new instruction inside ``` blocks.")
    assert DELIM_OPEN not in prompt
    # the seed's empty template is an empty block
    assert reflection_prompt(cfg, "", MB[:1], ["x"], [0.0]).startswith("An assistant was given the instruction "
                                                                       "below for a task I want done:\n```\n\n```\n")


def test_the_official_prompt_shows_the_official_user_message_and_the_end_of_a_long_answer():
    cfg = replace(OFFICIAL_PROMPT_CFG, prompt_format="official", reflect_answer_chars=73)
    response = "Step " + "x" * 200 + " so the answer is \\boxed{4}"
    prompt = reflection_prompt(cfg, "", MB[2:3], [response], [1.0])
    shown = "Step xxxxx" + CUT_MARKER + "\\boxed{4}"  # 10 + 53 + 10 characters (" \\boxed{4}", trimmed): the box stays
    assert ("# Example 1\n## Input\nLet's think step by step and output the final answer within \\boxed{}.\n"
            f"Question: What is 2 + 2?\n\n## Response\n{shown}\n\n## Feedback\nThe final answer is correct.") in prompt


@pytest.mark.parametrize("text, limit, cut", [
    ("0123456789" * 10, 73, "0123456789" + CUT_MARKER + "0123456789"),
    ("0123456789" * 10, 74, "0123456789" + CUT_MARKER + "90123456789"),  # an odd room: the end gets the extra one
    ("0123456789" * 10, 100, "0123456789" * 10),  # fits: whole
    ("start" + " " * 7 + "z" * 100 + " " * 3 + "\\boxed{7}", 77, "start" + CUT_MARKER + "\\boxed{7}"),  # 12 + 12,
    # the spaces at the cut trimmed
    ("0123456789" * 10, 54, "0123456789" * 5 + "0123"),  # no room for one character each side: the start
])
def test_cut_middle_keeps_start_and_end(text, limit, cut):
    assert cut_middle(text, limit) == cut and len(cut) <= limit


def test_our_prompt_is_unchanged_by_default():
    responses = ["\\boxed{23}", "\\boxed{3}"]
    records = [reflection_record(it, r, CFG.reflect_answer_chars) for it, r in zip(MB, responses)]
    ours = reflection_prompt(CFG, "Multiply first.", MB[:2], responses, [1.0, 0.0])
    assert ours == meta_prompt("Multiply first.", records)
    assert f"{DELIM_OPEN}Multiply first.{DELIM_CLOSE}" in meta_prompt("Multiply first.", records)


@pytest.mark.parametrize("text, template", [
    ("Here it is:\n```\nMultiply first.\n```\nGood luck.", "Multiply first."),
    ("```markdown\nMultiply first.\nThen add.\n```", "Multiply first.\nThen add."),
    ("```\nA\n```\nand\n```\nB\n```", "A\n```\nand\n```\nB"),  # first to last fence
    ("Multiply first.", "Multiply first."),  # no fence: the whole reply
    ("`Multiply first.`", "Multiply first."),
    ("```Multiply first.", "Multiply first."),  # one fence: the whole reply, backticks trimmed
    ("Markdown tables help.", "Markdown tables help."),  # a word, not a language tag
    ("```\n\n```", ""),
    ("```\n`x` first, then `y`\n```", "`x` first, then `y`"),  # inline code inside the fences is kept
    ("```\nUse `sum`\n```", "Use `sum`"),
    ("<think>Try ```\nX\n``` maybe.</think>\n\n```\nMultiply first.\n```", "Multiply first."),  # after the thought
    ("<think>Maybe ```\nAdd first.\n``` or not", "Add first."),  # an unfinished thought is the reply
    ("<think>Multiply first.</think>", "Multiply first."),  # nothing after the thought: the thought
    ("<think>Plan.</think>\n\n", ""),  # only whitespace after it: an empty template, as the reference
])
def test_the_official_parser(text, template):
    assert extract_template(text, OFFICIAL_PROMPT_CFG) == template


@pytest.mark.parametrize("text, after", [
    ("<think>\nPlan.\n</think>\n\nReply.", "\n\nReply."),
    ("<think>\nPlan, cut short", "\nPlan, cut short"),
    ("<think>Plan.</think>", "Plan."),
    ("Plan.</think>Reply.", "Reply."),  # a template that opened the thought itself: no <think> in the reply
    ("Reply without a thought.", "Reply without a thought."),
    ("Reply.</think>", "Reply."),
])
def test_reply_after_thought(text, after):
    assert reply_after_thought(text) == after


def test_our_parser_does_not_read_past_a_thought():
    assert extract_template("<think>x</think><template>A</template>", CFG) == "A"
    assert extract_template("<think><template>A</template></think>", CFG) == "A"  # ours: unchanged


def test_the_official_prompt_with_guards_on_keeps_them():
    cfg = OFFICIAL_PROMPT_CFG
    assert guard("```\nMultiply before you add.\n```", True, "", [""], MB, cfg) == ("Multiply before you add.", "ok")
    assert guard("```\nThe result is 19, check it.\n```", True, "", [""], MB, cfg) == (None, "answer_leak")
    assert guard("```\nMultiply first.", False, "", [""], MB, cfg) == (None, "truncated")
    assert guard("```\n```", True, "", [""], MB, cfg) == (None, "empty")
    assert guard("Multiply before you add.", True, "", [""], MB, cfg)[1] == "ok"  # no delimiter needed


@pytest.mark.parametrize("text, finished, parent, reason_with_guards", [
    ("<template>Multiply first.</template>", False, "", "truncated"),
    ("<template>" + "Think. " * 100 + "</template>", True, "", "too_long"),
    ("<template>add the numbers add the numbers add the numbers</template>", True, "", "repetition"),
    ("<template>multiply   FIRST.</template>", True, "Multiply first.", "duplicate"),
    ("<template>Think, then answer.<|im_end|></template>", True, "", "special_tokens"),
    ("<template>Do not use \\boxed, write the answer in words.</template>", True, "", "format_conflict"),
    ("<template>The result is 19, check it.</template>", True, "", "answer_leak"),
    ("<template>Note: tom has 3 apples and buys 4 bags with five.</template>", True, "", "problem_copy"),
])
def test_guards_off_keep_only_the_parse(text, finished, parent, reason_with_guards):
    assert guard(text, finished, parent, [""], MB, CFG) == (None, reason_with_guards)
    off = replace(CFG, reflect_guards=False)
    tpl = text[len(DELIM_OPEN):-len(DELIM_CLOSE)].strip()
    assert guard(text, finished, parent, [""], MB, off) == (tpl, "ok")


def test_guards_off_still_reject_a_failed_parse_or_an_empty_template():
    off = replace(CFG, reflect_guards=False)
    assert guard("Multiply first.", True, "", [""], MB, off) == (None, "no_delimiter")
    assert guard("<template>Multiply first.", False, "", [""], MB, off) == (None, "no_delimiter")
    assert guard("<template> </template>", True, "", [""], MB, off) == (None, "empty")
    official_off = replace(OFFICIAL_PROMPT_CFG, reflect_guards=False)
    assert guard("```\n```", True, "", [""], MB, official_off) == (None, "empty")
    assert guard("```\nThe answer is 19" + " x" * 400, False, "", [""], MB, official_off)[1] == "ok"


def test_a_round_with_the_official_prompt():
    prompts = []
    answer, reflect = acceptance_models(2, fence=True)
    cfg = train.Config(reflect_prompt="official", gepa_budget=60, gepa_dev_max=4, gepa_parents=2, gepa_minibatch=3)
    res = run_gepa(items(12), answer, lambda p: prompts.extend(p) or reflect(p), cfg, random.Random(0),
                   reward_fn=reward)
    assert prompts and all(p.startswith("An assistant was given") and "# Example 3\n## Input\nQuestion " in p
                           and DELIM_OPEN not in p for p in prompts)
    assert any(e["outcome"] == "accepted" for e in res.log)
    assert all(t == "" or t.startswith("Plan ") for t in res.pool)  # parsed out of the fences
    assert not res.rejections.get("no_delimiter")


# ----------------------------------------------------------------------------- framing and context length


def test_reflector_framing():
    assert reflector_framing(CFG) == {"prefill": DELIM_OPEN, "stop": [DELIM_CLOSE]}
    assert reflector_framing(OFFICIAL_PROMPT_CFG) == {"prefill": "", "stop": []}


class FakeEngine:
    """Records what the reflector sends; answers each prompt with a scripted text and finish reason."""
    def __init__(self, text, finish):
        self.text, self.finish, self.calls = text, finish, []

    def generate(self, prompts, **kw):
        self.calls.append((prompts, kw))
        return [[Sample([1], [2, 3], self.text, self.finish)] for _ in prompts]


def test_engine_reflector_framing_default_and_official():
    engine = FakeEngine("Multiply first.</template>", "stop")
    assert EngineReflector(engine, seed=3).reflect(["p"]) == [("<template>Multiply first.</template>", True)]
    prompts, kw = engine.calls[-1]
    assert prompts == [[{"role": "user", "content": "p"}, {"role": "assistant", "content": "<template>"}]]
    assert kw["stop"] == ["</template>"] and kw["seed"] == 3
    engine = FakeEngine("New instruction:\n```\nMultiply first.\n```", "length")
    reflector = EngineReflector(engine, **reflector_framing(OFFICIAL_PROMPT_CFG))
    assert reflector.reflect(["p", "q"]) == [("New instruction:\n```\nMultiply first.\n```", False)] * 2
    prompts, kw = engine.calls[-1]
    assert prompts == [[{"role": "user", "content": "p"}], [{"role": "user", "content": "q"}]]
    assert kw["stop"] is None and reflector.counts["reflection_tokens"] == 4


def test_reflection_cut_chars_by_hand():
    cfg = train.Config(max_template_chars=40, reflect_answer_chars=60, reflect_max_tokens=30, gepa_minibatch=2)
    assert reflection_cut_chars(cfg) == 40 + 2 * 60 * 2  # ours: the answer and the extracted answer
    assert reflection_cut_chars(replace(cfg, reflect_prompt="official")) == 40 + 60 * 2  # the answer only
    # guards off: a child is as long as the reflector's reply, reflect_max_tokens (a seed: max_template_chars)
    assert reflection_cut_chars(replace(cfg, reflect_guards=False, reflect_max_tokens=500)) == 500 + 2 * 60 * 2
    assert reflection_cut_chars(replace(cfg, reflect_guards=False)) == 40 + 2 * 60 * 2


def test_longest_reflection_prompt_ours_is_what_context_length_built():
    cfg = train.Config(reflect_answer_chars=60, gepa_minibatch=2)
    longest = [MB[1], MB[0]]  # by len(problem) + len(answer), shortest of the two first
    records = [reflection_record(p, "", 60) for p in longest]
    assert longest_reflection_prompt(cfg, MB) == [{"role": "user", "content": meta_prompt("", records)},
                                                  {"role": "assistant", "content": DELIM_OPEN}]


@pytest.mark.parametrize("prompt, fmt, chars", [("ours", "default", 30), ("official", "default", 30),
                                               ("official", "official", 30), ("official", "official", 80)])
def test_no_reflection_prompt_outgrows_the_longest_plus_the_cut(prompt, fmt, chars):
    """In characters (context_length counts one token a character for the cut parts): any
    parent of max_template_chars and any answers, cut to reflect_answer_chars (80: start and end
    around the marker), on any b of the problems, shown in either prompt format."""
    cfg = train.Config(reflect_prompt=prompt, prompt_format=fmt, max_template_chars=40, reflect_answer_chars=chars,
                       gepa_minibatch=2)
    bound = len(longest_reflection_prompt(cfg, MB)[0]["content"]) + reflection_cut_chars(cfg)
    answers = ["x" * chars, "y" * 20 + "\\boxed{19}", "\\boxed{1}\\boxed{2}" + "z" * 12, "w " * chars + "\\boxed{4}"]
    for mb in itertools.combinations(MB, 2):
        for responses in itertools.product(answers, repeat=2):
            for rewards in itertools.product([0.0, 1.0], repeat=2):
                text = reflection_prompt(cfg, "t" * 40, list(mb), list(responses), list(rewards))
                assert len(text) <= bound


def test_a_config_without_the_switches_runs_ours():
    fields = {k: v for k, v in vars(train.Config(gepa_budget=60, gepa_parents=2, gepa_minibatch=3)).items()
              if k not in ("reflect_prompt", "reflect_guards", "gepa_selection", "gepa_accounting")}
    old = SimpleNamespace(**fields)
    runs = []
    for cfg in (old, train.Config(gepa_budget=60, gepa_parents=2, gepa_minibatch=3)):
        answer, reflect = acceptance_models(3)
        runs.append(run_gepa(items(12), answer, reflect, cfg, random.Random(0), reward_fn=reward).to_json())
    assert runs[0] == runs[1] and runs[0]["charged"] == runs[0]["metric_calls"]
    assert reflector_framing(old)["prefill"] == DELIM_OPEN and reflection_cut_chars(old) == reflection_cut_chars(
        train.Config())


def test_an_unknown_switch_value_is_an_error():
    with pytest.raises(ValueError, match="gepa_selection must be one of"):
        run_scripted(gepa_budget=20, gepa_selection="offical")
