"""data/prep.py: conversion of public sets, local files and hub datasets into the JSONL schema.
Everything runs offline: hub reads are replaced by fixture rows (tests/fixtures/prep/)."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from data import load_jsonl
from data import prep
from data.prep import DAPO_WRAPPER, SOURCES, boxed_answer, convert
from verify import check

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "prep")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows(name):
    with open(os.path.join(FIXTURES, f"{name}.jsonl")) as f:
        return [json.loads(line) for line in f]


def write_jsonl_rows(path, items):
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return str(path)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_source_has_a_fixture_and_converts(name):
    problems, _ = convert(name, rows(name))
    assert problems
    assert len({p.id for p in problems}) == len(problems)
    for p in problems:
        assert p.problem and p.answer and p.source == name and p.id.startswith(name + "-")


def test_conversions_by_hand():
    ds, dropped = convert("deepscaler", rows("deepscaler"))
    assert [(p.id, p.answer) for p in ds] == [("deepscaler-09d986d9e368", "4"),
                                              ("deepscaler-264c335623ca", "\\frac{5}{6}")]
    assert dropped == {"missing answer": 1} and ds[0].solution == "Squaring gives $4$."
    dm, dropped = convert("deepmath", rows("deepmath"))  # difficulty >= 7 only
    assert [p.answer for p in dm] == ["e", "8"] and dropped == {"filtered (difficulty < 7)": 1}
    assert [p.answer for p in convert("amc23", rows("amc23"))[0]] == ["27", "36"]  # 27.0 -> 27
    assert convert("aime24", rows("aime24"))[0][0].id == "aime24-60"
    assert convert("olympiadbench", rows("olympiadbench"))[0][0].answer == "2,3"  # ["$2,3$"]
    mp = convert("math500", rows("math500"))[0][0]
    assert mp.id == "math500-test/precalculus/807.json" and mp.answer.startswith("\\left( 3")


def test_ids_without_an_id_column_hash_the_problem():
    """{set}- + 12 hex digits of the problem's SHA-256: the same in every run and row order."""
    ds = convert("deepscaler", rows("deepscaler"))[0]
    for p in ds:
        assert p.id == "deepscaler-" + hashlib.sha256(p.problem.encode()).hexdigest()[:12]
    backwards = convert("deepscaler", rows("deepscaler")[::-1])[0]
    assert {p.id: p.problem for p in backwards} == {p.id: p.problem for p in ds}


def test_duplicate_rows_dropped_and_taken_ids_resolved_deterministically():
    spec = dict(problem="q", answer="a", id="n")
    items = [{"n": 7, "q": "A", "a": "1"}, {"n": 7, "q": "A", "a": "1"},  # the same row twice
             {"n": 7, "q": "B", "a": "2"}, {"n": 7, "q": "A", "a": "2"},  # the same id, other text
             {"n": 8, "q": "A", "a": "1"},  # the same text under another id
             {"q": "B", "a": "3"}, {"q": "B", "a": "4"}]  # no id: the problem's hash, taken the 2nd time
    problems, dropped = convert("s", items, spec)
    assert [(p.id, p.problem, p.answer) for p in problems] == [
        ("s-7", "A", "1"), ("s-7-e592c7c0", "B", "2"), ("s-7-08154df4", "A", "2"),
        ("s-df7e70e50215", "B", "3"), ("s-df7e70e50215-ef671e6f", "B", "4")]
    assert dropped == {"duplicate row": 2}
    again, _ = convert("s", items, spec)
    assert again == problems


def test_olympiadbench_multi_part_answers():
    problems, dropped = convert("olympiadbench", rows("olympiadbench"))
    assert [(p.id, p.answer) for p in problems] == [
        ("olympiadbench-2231", "2,3"), ("olympiadbench-2232", "1, 2"),  # ["$1$", "$2$"], no longer '1$, $2'
        ("olympiadbench-2235", "\\frac{1}{2}"),  # a list of one part is that part
        ("olympiadbench-2236", "(1,4), (2,3)")]  # commas inside brackets are no ambiguity
    assert dropped == {"multi-part answer with a comma inside a part": 1,  # ["$x=1, y=2$", "$x=2, y=1$"]
                       "answer mixes text and $math$": 1}  # ["$3$ and $4$"]
    answers = {p.id: p.answer for p in problems}
    assert check("so \\boxed{1, 2}", answers["olympiadbench-2232"]).reward == 1.0
    assert check("\\boxed{\\frac{1}{2}}", answers["olympiadbench-2235"]).reward == 1.0
    assert check("\\boxed{(1,4), (2,3)}", answers["olympiadbench-2236"]).reward == 1.0


def test_math_answer_is_the_last_box_of_the_solution():
    problems, dropped = convert("math", rows("math"))
    assert [(p.id, p.answer) for p in problems] == [("math-6f5fceb2cde7", "\\frac{5}{6}"),
                                                    ("math-de725cc6fa72", "\\{1, 2\\}")]
    assert problems[0].solution.endswith("\\boxed{\\frac{5}{6}}$.")
    assert dropped == {"no \\boxed{} answer in solution": 1}
    assert SOURCES["math"]["hub"] == "DigitalLearningGmbH/MATH-lighteval" and SOURCES["math"]["split"] == "train"


@pytest.mark.parametrize("solution, answer", [
    ("so $\\boxed{\\frac{a}{b}}$.", "\\frac{a}{b}"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\boxed{3} + 1}", "\\boxed{3} + 1"),  # a nested box stays part of the outer one
    ("\\boxed{\\{x \\mid x > 0\\}}", "\\{x \\mid x > 0\\}"),  # escaped braces do not count
    ("\\fbox{5}", "5"),
    ("no box here", None),
    ("\\boxed{4} and \\boxed{5", None),  # an unclosed box: no answer to trust
])
def test_boxed_answer(solution, answer):
    assert boxed_answer(solution) == answer


def test_dapo_problem_loses_its_instruction_and_repeats_are_dropped():
    problems, dropped = convert("dapo17k", rows("dapo17k"))
    assert [(p.id, p.problem, p.answer) for p in problems] == [
        ("dapo17k-5f0c3d9e-1b7a-4c2e-9f1d-0a6b8e2c4d11", "Find the remainder when $2^{10}$ is divided by $7$.", "2"),
        ("dapo17k-c81e728d-9d4c-4f63-8e7b-2a1f5d3c6b22", "If $x + y = 10$ and $x - y = 4$, what is $xy$?", "21")]
    assert dropped == {"duplicate row": 1, "missing answer": 1}
    assert all(p.source == "dapo17k" for p in problems)


def test_jsonl_file_numbers_and_drop_reasons(tmp_path, capsys):
    path = write_jsonl_rows(tmp_path / "nums.jsonl", [
        {"q": "What is 6 times 7?", "a": 42}, {"q": "What is 84 / 2?", "a": 42.0},
        {"q": "What is 5 / 2?", "a": 2.5}, {"q": "Write $7$ as a numeral.", "a": "$7$"},
        {"q": "  ", "a": 1}, {"q": "Who?", "a": None}, {"q": "Who?"}, {"q": "Pick a truth value.", "a": True}])
    out = str(tmp_path / "out.jsonl")
    prep.main([path, "--problem=q", "--answer=a", "--out", out])
    problems, _ = load_jsonl(out)
    assert [(p.id, p.answer, p.source) for p in problems] == [
        ("nums-388ba6637d7c", "42", "nums"), ("nums-38dc46698984", "42", "nums"),
        ("nums-1f7d59c22009", "2.5", "nums"), ("nums-5b72a637d088", "7", "nums")]
    assert capsys.readouterr().out == (
        f"{path}: wrote 4 problems to {out}; dropped 4 rows "
        "(empty problem: 1, missing answer: 2, answer is not text or a number: 1)\n")


def verl_table():
    import pyarrow as pa

    prefix, suffix = DAPO_WRAPPER
    return pa.table({
        "data_source": ["openai/gsm8k"] * 3,
        "prompt": [[{"role": "system", "content": "Think."}, {"role": "user", "content": "What is 7 squared?"}],
                   [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                   [{"role": "user", "content": prefix + "What is 6 times 7?" + suffix}]],
        "ability": ["math"] * 3,
        "reward_model": [{"ground_truth": "49", "style": "rule"}, {"ground_truth": "1", "style": "rule"},
                         {"ground_truth": "42", "style": "rule"}],
        "extra_info": [{"index": 0, "split": "train"}, {"index": 1, "split": "train"}, {"index": 2, "split": "train"}],
    })


def test_verl_parquet_is_recognised_without_column_options(tmp_path, capsys):
    import pyarrow.parquet as pq

    path = str(tmp_path / "gsm8k_verl.parquet")
    pq.write_table(verl_table(), path)
    prep.main([path, "--out", str(tmp_path)])
    problems, _ = load_jsonl(str(tmp_path / "gsm8k_verl.jsonl"))
    assert [(p.id, p.problem, p.answer, p.source) for p in problems] == [
        ("gsm8k_verl-0", "What is 7 squared?", "49", "openai/gsm8k"),
        ("gsm8k_verl-2", "What is 6 times 7?", "42", "openai/gsm8k")]
    assert "dropped 1 row (several user turns in prompt: 1)" in capsys.readouterr().out
    prep.main([path, "--source=mine", "--out", str(tmp_path / "mine.jsonl")])  # --source names the set
    assert [(p.id, p.source) for p in load_jsonl(str(tmp_path / "mine.jsonl"))[0]] == [("mine-0", "mine"),
                                                                                       ("mine-2", "mine")]


def test_parquet_columns_by_option_and_dotted_path(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "nested.parquet")
    pq.write_table(pa.table({"question": ["What is 8 times 9?", "What is 9 / 3?"],
                             "meta": [{"gold": 72, "key": "k1"}, {"gold": 3, "key": "k2"}]}), path)
    out = str(tmp_path / "nested.jsonl")
    prep.main([path, "--problem=question", "--answer=meta.gold", "--id=meta.key", "--out", out])
    assert [(p.id, p.answer) for p in load_jsonl(out)[0]] == [("nested-k1", "72"), ("nested-k2", "3")]


def test_csv_cells_stay_text(tmp_path, capsys):
    path = tmp_path / "exam.csv"
    path.write_text("uid,question,final,notes\n"
                    "q1,What is 3 + 4?,7,easy\n"
                    "q2,Write seven with two leading zeros.,007,\n"
                    "q3,What is missing?,,\n")
    prep.main([str(path), "--problem=question", "--answer=final", "--id=uid", "--solution=notes",
               "--source=mycsv", "--out", str(tmp_path)])
    problems, _ = load_jsonl(str(tmp_path / "mycsv.jsonl"))
    assert [(p.id, p.answer, p.solution, p.source) for p in problems] == [
        ("mycsv-q1", "7", "easy", "mycsv"), ("mycsv-q2", "007", None, "mycsv")]
    assert "dropped 1 row (missing answer: 1)" in capsys.readouterr().out


def fake_hub(monkeypatch, items):
    calls = []

    def hub_rows(repo, config, split):
        calls.append((repo, config, split))
        return list(items)
    monkeypatch.setattr(prep, "hub_rows", hub_rows)
    return calls


def test_hub_input_maps_columns(tmp_path, monkeypatch):
    calls = fake_hub(monkeypatch, [{"qid": 5, "question": "What is 7 squared?", "gold": 49}])
    out = str(tmp_path / "t.jsonl")
    prep.main(["hub:someone/tiny-set", "--config=main", "--split=test", "--problem=question",
               "--answer=gold", "--id=qid", "--out", out])
    assert calls == [("someone/tiny-set", "main", "test")]
    assert [(p.id, p.answer, p.source) for p in load_jsonl(out)[0]] == [("tiny-set-5", "49", "tiny-set")]
    calls = fake_hub(monkeypatch, [{"id": "x", "problem": "What is 7 squared?", "answer": "49"}])
    prep.main(["hub:someone/plain", "--out", out])  # problem/answer/id columns need no options
    assert calls == [("someone/plain", None, "train")]
    assert [(p.id, p.answer) for p in load_jsonl(out)[0]] == [("plain-x", "49")]


def test_named_set_reads_its_hub_table(tmp_path, monkeypatch, capsys):
    calls = fake_hub(monkeypatch, rows("math"))
    prep.main(["math", "--out", str(tmp_path)])
    assert calls == [("DigitalLearningGmbH/MATH-lighteval", "default", "train")]
    assert [p.answer for p in load_jsonl(str(tmp_path / "math.jsonl"))[0]] == ["\\frac{5}{6}", "\\{1, 2\\}"]
    assert capsys.readouterr().out == (f"math: wrote 2 problems to {tmp_path / 'math.jsonl'}; "
                                       "dropped 1 row (no \\boxed{} answer in solution: 1)\n")


@pytest.mark.parametrize("argv, message", [
    (["math", "--problem=q"], "--problem apply to files and hub: inputs; math has its own columns"),
    (["FILE", "--problem=q"], "--problem and --answer go together"),
    (["FILE", "--problem=q", "--answer=nope"], "no column 'nope' for --answer (columns: q, a)"),
    (["FILE"], "give --problem=COL --answer=COL (columns: q, a)"),
    (["notes.txt"], "unknown input 'notes.txt'"),
    (["FILE", "FILE", "--out=x.jsonl"], "--out=FILE.jsonl takes one input"),
    (["FILE", "--problem=q", "--answer=a", "--out=DIR"], "the output would overwrite the input"),
])
def test_option_errors(tmp_path, argv, message):
    path = write_jsonl_rows(tmp_path / "f.jsonl", [{"q": "What is 1 + 1?", "a": 2}])
    with pytest.raises(SystemExit) as e:
        prep.main([{"FILE": path, "--out=DIR": f"--out={tmp_path}"}.get(a, a) for a in argv])
    assert message in str(e.value.code)


def test_empty_result_writes_nothing_and_fails(tmp_path, capsys):
    path = write_jsonl_rows(tmp_path / "f.jsonl", [{"q": "What is 1 + 1?", "a": None}])
    with pytest.raises(SystemExit) as e:
        prep.main([path, "--problem=q", "--answer=a", "--out", str(tmp_path / "out")])
    assert e.value.code == 1 and not os.path.exists(tmp_path / "out")
    assert "no rows kept, nothing written; dropped 1 row (missing answer: 1)" in capsys.readouterr().out


def test_conversion_imports_neither_datasets_nor_pyarrow():
    code = "import sys, data.prep; assert not {'datasets', 'pyarrow'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
