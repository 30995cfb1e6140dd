"""data/prep.py deepmath --split=reference: the P²O reference code's DeepMath split (answer types
re-weighted per difficulty level, then seeded train/test cuts), on small synthetic tables fed to
the functions directly (the hub is not reached). Expected draws are replayed here from the rule:
one random.Random(42) in the documented order, numpy's default_rng(42) for the cuts."""

import random

import numpy as np
import pytest

from data import load_jsonl
from data import prep
from data.prep import _level_quota, answer_type, balance_answer_types, reference_deepmath_split, seeded_split


@pytest.mark.parametrize("answer, kind", [
    (None, "empty"), ("", "empty"), ("yes", "yes_no"), (" No ", "yes_no"), ("TRUE", "yes_no"),
    ("B", "multiple_choice"), ("(c)", "multiple_choice"), ("12", "numeric"), ("-0.5", "numeric"),
    ("3/4", "numeric"), ("12%", "percentage"), ("2.5%", "percentage"), ("5 cm", "numeric_with_unit"),
    ("2x", "numeric_with_unit"), ("√2", "mathematical_symbol"), ("π/2", "mathematical_symbol"),
    ("(0, 1]", "interval_set"), ("(1,2)", "interval_set"), ("[1, 2, 3]", "interval_set"),
    ("a b c d e f", "text_answer"), ("x^2+1", "other"), ("\\frac{1}{2}", "other"), ("\\pi", "other"),
    ("  ", "other"), ("12 %", "other"), ("yes.", "other"),
])
def test_answer_types_by_hand(answer, kind):
    assert answer_type(answer) == kind


@pytest.mark.parametrize("counts, quota", [
    # weights 8 and 4 share int(100 x 0.95) = 95: 63 and 31 (more than the 16 rows); yes/no: int(94 x 0.05 / 0.95) = 4
    ({"numeric": 64, "other": 16, "yes_no": 20}, {"numeric": 63, "other": 31, "yes_no": 4}),
    ({"numeric": 16, "other": 4, "yes_no": 5}, {"numeric": 15, "other": 7, "yes_no": 1}),  # 4:2 of int(23.75) = 23
    ({"numeric": 10}, {"numeric": 9}),  # int(10 x 0.95) = 9
    ({"yes_no": 7}, {"yes_no": 0}),  # no other type: no room for yes/no
])
def test_level_quota_by_hand(counts, quota):
    assert _level_quota(counts, 0.05, 0.5) == quota


def table(levels):
    """Rows from [(difficulty, [answer, ...]), ...] in that order; question i is 'q{i}'."""
    rows = []
    for difficulty, answers in levels:
        rows += [{"question": f"q{len(rows) + i}", "final_answer": a, "difficulty": difficulty}
                 for i, a in enumerate(answers)]
    return rows


def test_balance_samples_each_type_of_each_level_in_order():
    # level 8 comes first in the table, level 7 is balanced first; in level 7 `other` is seen first
    rows = table([(8.0, ["1", "2", "3", "4", "no"]),
                  (7.0, ["x+1", ""] + [str(n) for n in range(16)] + ["x+2", "yes", "no", "x+3", "yes", "no", "yes",
                                                                        "x+4"])])
    level7 = {kind: [i for i, r in enumerate(rows) if r["difficulty"] == 7.0 and answer_type(r["final_answer"]) == kind]
              for kind in ("other", "numeric", "yes_no")}
    assert [len(level7[k]) for k in ("other", "numeric", "yes_no")] == [4, 16, 5]  # quotas 7, 15, 1 (above)
    rng = random.Random(42)
    kept = level7["other"] + rng.sample(level7["numeric"], 15) + rng.sample(level7["yes_no"], 1)
    kept += [0, 1, 2, 3]  # level 8: numeric 4 of quota int(4.75) = 4, all; yes/no int(4 x 0.05 / 0.95) = 0
    rng.shuffle(kept)  # 1 yes/no in 24 rows: within 5 %, no second pass
    assert [r["question"] for r in balance_answer_types(rows)] == [f"q{i}" for i in kept]


def test_balance_caps_yes_no_over_the_whole_set_when_quotas_overshoot():
    # quotas 29, 29 for one row each; yes/no int(58 x 0.05 / 0.95) = 3 of 60 -> 3 in 5 kept rows, over 5 %:
    # the yes/no rows go down to int(5 x 0.05) = 0
    rows = table([(9.0, ["7", "x^2"] + ["yes"] * 60)])
    rng = random.Random(42)
    kept = [0, 1] + rng.sample(list(range(2, 62)), 3)
    rng.shuffle(kept)
    others = [p for p, i in enumerate(kept) if i < 2]
    order = others + rng.sample([p for p, i in enumerate(kept) if i >= 2], 0)
    rng.shuffle(order)
    assert [r["question"] for r in balance_answer_types(rows)] == [f"q{kept[p]}" for p in order]
    assert sorted(r["final_answer"] for r in balance_answer_types(rows)) == ["7", "x^2"]


def test_seeded_split_is_datasets_train_test_split():
    rows = [{"question": f"q{i}"} for i in range(12)]
    order = np.random.default_rng(42).permutation(12).tolist()
    rest, test = seeded_split(rows, 5)
    assert test == [rows[i] for i in order[:5]] and rest == [rows[i] for i in order[5:]]
    assert seeded_split(rows, 12) == ([], rows) and seeded_split(rows, 20) == ([], rows)  # too few: all to test
    datasets = pytest.importorskip("datasets")
    cut = datasets.Dataset.from_list(rows).train_test_split(test_size=5, seed=42)
    assert (cut["test"]["question"], cut["train"]["question"]) == ([r["question"] for r in test],
                                                                   [r["question"] for r in rest])


def test_reference_split_filters_balances_then_cuts_test_then_train():
    rows = [{"question": f"q{i}", "final_answer": str(i), "difficulty": 7.0 if i % 3 else 6.5, "r1_solution_1": "long"}
            for i in range(60)]  # 40 rows of difficulty >= 7, all numeric: int(40 x 0.95) = 38 kept
    hard = [{"question": r["question"], "final_answer": r["final_answer"], "difficulty": r["difficulty"]}
            for r in rows if r["difficulty"] >= 7]
    balanced = balance_answer_types(hard)
    assert len(balanced) == 38
    first = np.random.default_rng(42).permutation(38).tolist()
    rest = [balanced[i] for i in first[5:]]
    second = np.random.default_rng(42).permutation(33).tolist()
    train, test = reference_deepmath_split(rows, test_size=5, train_size=20)
    assert test == [balanced[i] for i in first[:5]]
    assert train == [rest[i] for i in second[:20]]  # the second cut's test side
    assert set(train[0]) == {"question", "final_answer", "difficulty"}  # long columns are not held


def test_the_command_writes_the_reference_train_and_test_files(tmp_path, monkeypatch, capsys):
    rows = [{"question": f"What is {i} + 1?", "final_answer": str(i + 1), "difficulty": 7.5} for i in range(600)]
    calls = []
    monkeypatch.setattr(prep, "hub_rows", lambda repo, config, split: calls.append((repo, split)) or list(rows))
    prep.main(["deepmath", "--split=reference", "--out", str(tmp_path)])
    assert calls == [("zwhe99/DeepMath-103K", "train")]
    train, test = (load_jsonl(str(tmp_path / f"deepmath_reference_{part}.jsonl"))[0] for part in ("train", "test"))
    assert (len(train), len(test)) == (70, 500)  # int(600 x 0.95) = 570 balanced: 500 to test, the other 70 train
    assert not {p.problem for p in train} & {p.problem for p in test}
    assert all(p.id.startswith("deepmath-") and p.source == "deepmath" for p in train + test)
    assert "deepmath --split=reference (train): wrote 70 problems" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["math", "--split=reference"], "give the one input deepmath"),
    (["deepmath", "math", "--split=reference"], "give the one input deepmath"),
    (["deepmath", "--split=reference", "--limit=100"], "no --limit, and --out is a folder"),
    (["deepmath", "--split=reference", "--out=x.jsonl"], "no --limit, and --out is a folder"),
    (["deepmath", "--split=train"], "--split apply to files and hub: inputs; deepmath has its own columns"),
])
def test_reference_split_option_errors(argv, message):
    with pytest.raises(SystemExit) as e:
        prep.main(argv)
    assert message in str(e.value.code)
