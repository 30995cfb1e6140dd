"""data/: the JSONL schema and validating loader (errors name file:line), and the seeded built-in task."""

import json
import re
from collections import Counter

import pytest

from data import DataError, load_jsonl, resolve_data
from data import fictional, subtract
from gepa import read_seed_templates
from data.builtin import LEVELS, make_splits
from prompts import FEWSHOT, FORMAT_INSTRUCTION, problem_messages

GOOD = {"id": "a", "problem": "What is 1 + 1?", "answer": "2"}


def write(tmp_path, lines):
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"id": "b", "problem": "p"}), "missing field 'answer'"),
    (json.dumps({"id": "b", "problem": "p", "answer": "  "}), "field 'answer' is empty"),
    (json.dumps({"id": "b", "problem": "p", "answer": 3}), "field 'answer' must be a string"),
    (json.dumps({"id": "b", "problem": "p", "answer": "3", "source": 1}), "field 'source' must be a string"),
    (json.dumps(GOOD), "duplicate id 'a'"),
])
def test_bad_row_names_file_and_line(tmp_path, bad_line, message):
    path = write(tmp_path, [json.dumps(GOOD), "", bad_line])
    with pytest.raises(DataError) as e:
        load_jsonl(path)
    assert str(e.value).startswith(f"{path}:3: ")  # blank line 2 is skipped, not miscounted
    assert message in str(e.value)


def test_skip_bad_counts_rows(tmp_path):
    path = write(tmp_path, [json.dumps(GOOD), "{oops", json.dumps(GOOD),
                            json.dumps({**GOOD, "id": "c", "solution": "s", "source": "x"})])
    problems, skipped = load_jsonl(path, skip_bad=True)
    assert [p.id for p in problems] == ["a", "c"]
    assert skipped == 2
    assert problems[1].solution == "s" and problems[1].source == "x"


@pytest.mark.parametrize("row", [{"problem": "p", "answer": "3"}, {"id": "b", "problem": "p", "answer": 3},
                                 {"id": "b", "problem": "p", "answer": "3", "solution": ["s"]}])
def test_schema_errors_point_at_prep(tmp_path, row):
    with pytest.raises(DataError) as e:
        load_jsonl(write(tmp_path, [json.dumps(row)]))
    assert str(e.value).endswith("; convert the file with data/prep.py (--problem/--answer/--id map its columns)")


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        load_jsonl(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="no valid rows"):
        load_jsonl(write(tmp_path, ["{oops"]), skip_bad=True)


def test_names_resolve():
    assert resolve_data("builtin-dev").endswith("data/builtin/dev.jsonl")
    assert resolve_data("fictional-test").endswith("data/fictional/test.jsonl")
    assert resolve_data("subtract-heldout").endswith("data/subtract/heldout.jsonl")
    assert resolve_data("aime24").endswith("data/public/aime24.jsonl")
    assert resolve_data("some/file.jsonl") == "some/file.jsonl"


def solve(problem):
    """Independent reference: compute the answer from the problem text."""
    m = re.fullmatch(r"What is (.+)\?", problem)
    if m:
        terms = m.group(1).split(" + ")
        total = 0
        for t in terms:
            f = [int(x) for x in t.split(" × ")]
            total += f[0] * (f[1] if len(f) > 1 else 1)
        return total
    m = re.fullmatch(r"How many \w+ are in (\d+) (\w+)\?", problem)
    factors = {"hours": 60, "minutes": 60, "days": 24, "weeks": 7, "meters": 100,
               "kilograms": 1000, "feet": 12, "dozens": 12}
    return int(m.group(1)) * factors[m.group(2)]


def test_shipped_builtin_splits_are_valid_disjoint_and_correct():
    splits = {s: load_jsonl(f"builtin-{s}")[0] for s in ("train", "dev", "test")}
    texts = {s: {p.problem for p in ps} for s, ps in splits.items()}
    assert not texts["train"] & texts["dev"] and not texts["train"] & texts["test"]
    assert not texts["dev"] & texts["test"]
    fewshot = {q for q, _ in FEWSHOT}
    for problems in splits.values():
        assert {p.source for p in problems} == {f"builtin/{lv}" for lv in LEVELS}
        for p in problems:
            assert p.problem not in fewshot
            assert int(p.answer) == solve(p.problem), p


def test_generator_is_seeded_and_matches_shipped_files():
    sizes = {"train": 40, "dev": 10, "test": 20}
    assert make_splits(sizes, seed=0) == make_splits(sizes, seed=0)
    assert make_splits(sizes, seed=0)["dev"] != make_splits(sizes, seed=1)["dev"]
    shipped = load_jsonl("builtin-dev")[0]
    assert make_splits(sizes, seed=0)["dev"] == shipped  # the files are reproducible
    with pytest.raises(ValueError, match="problems"):
        make_splits({"train": 10_000})


def test_fictional_units_splits_share_facts_never_problems_and_facts_never_hold_an_answer():
    splits = {name: load_jsonl(f"fictional-{name}")[0] for name in ("train", "dev", "test")}
    assert {k: len(v) for k, v in splits.items()} == {"train": 40, "dev": 10, "test": 30}
    assert fictional.make_splits(seed=0) == splits  # the shipped files are reproducible
    ids = [p.id for rows in splits.values() for p in rows]
    problems = [p.problem for rows in splits.values() for p in rows]
    assert len(set(ids)) == len(set(problems)) == 80  # no problem in two splits
    for rows in splits.values():
        assert {p.source for p in rows} == {f"fictional/{big}" for big, _ in fictional.PAIRS}  # every pair
        for p in rows:  # an independent solver: 13 times the count in the text
            m = re.fullmatch(r"How many (\w+)s are in (\d+) (\w+)s\?", p.problem)
            assert int(p.answer) == int(m.group(2)) * 13 and m.group(1) in {small for _, small in fictional.PAIRS}
    path = resolve_data("fictional-train").replace("train.jsonl", "facts.txt")
    assert read_seed_templates(path, 300) == [fictional.RULE]
    numbers = {int(x) for x in re.findall(r"\d+", open(path).read())}
    assert numbers == {13}
    assert not numbers & {int(p.answer) for rows in splits.values() for p in rows}  # no answer in a template


def test_subtraction_splits_are_disjoint_correct_and_the_strategy_holds_no_number():
    splits = {name: load_jsonl(f"subtract-{name}")[0] for name in ("train", "dev", "test", "heldout")}
    assert subtract.make_splits(seed=0) == splits  # the shipped files are reproducible
    sizes = {name: Counter(p.source for p in rows) for name, rows in splits.items()}
    assert sizes == {"train": {"subtract/neg": 40, "subtract/pos": 20}, "dev": {"subtract/neg": 5, "subtract/pos": 5},
                     "test": {"subtract/neg": 20, "subtract/pos": 10},
                     "heldout": {"subtract-heldout/neg": 45, "subtract-heldout/pos": 18}}
    problems = [p.problem for rows in splits.values() for p in rows]
    assert len(set(problems)) == len(problems) == 163  # no problem in two splits
    operands = {}
    for name, rows in splits.items():
        for p in rows:  # an independent solver, and the level its sign says
            a, b = map(int, re.fullmatch(r"What is (\d+) − (\d+)\?", p.problem).groups())
            assert int(p.answer) == a - b and 0 < abs(a - b) <= 9
            assert p.source.endswith("/neg" if a < b else "/pos")
            operands.setdefault(name, set()).update((a, b))
    assert max(operands["train"] | operands["dev"] | operands["test"]) <= 20 < min(operands["heldout"])
    # as many of each answer, so no one answer is right on more than a ninth of either level
    assert Counter(p.answer for p in splits["heldout"]) == {str(-d): 5 for d in range(1, 10)} | {
        str(d): 2 for d in range(1, 10)}
    assert all(p.solution == p.problem[8:-1] + f" = {p.answer}." for rows in splits.values() for p in rows)
    path = resolve_data("subtract-train").replace("train.jsonl", "strategy.txt")
    assert read_seed_templates(path, 300) == [subtract.STRATEGY]
    assert not re.search(r"\d", subtract.STRATEGY)  # a procedure: no number, so no answer, in the template
    assert problem_messages(splits["heldout"][0])[0] == {"role": "user", "content": "What is 2 + 3?\n" + FORMAT_INSTRUCTION}
