"""prompts.py: the original user text, template application T(x, z), and the few-shot turns of the built-in task."""

import pytest

from data import Problem
from prompts import FEWSHOT, FORMAT_INSTRUCTION, apply_template, build_messages, problem_messages, user_text


def test_template_application_keeps_the_answer_format_in_the_original_text():
    x = user_text("What is 7 + 4 × 3?")
    assert x == "What is 7 + 4 × 3?\n" + FORMAT_INSTRUCTION
    assert apply_template(x, "  Multiply first.  ") == "Multiply first.\n\n" + x
    assert apply_template(x, "   ") == x
    msgs = build_messages("What is 7 + 4 × 3?", template="Multiply first.", fewshot=True)
    assert len(msgs) == 7 and msgs[-1]["content"].endswith(FORMAT_INSTRUCTION)
    assert msgs[-1]["content"].startswith("Multiply first.\n\n")
    assert all("Multiply first." not in m["content"] for m in msgs[:-1])  # few-shot turns untouched



def test_fewshot_turns_come_first_and_only_for_builtin_rows():
    builtin = problem_messages(Problem("b1", "What is 3 + 5?", "8", source="builtin/add1"))
    assert [m["role"] for m in builtin] == ["user", "assistant"] * len(FEWSHOT) + ["user"]
    assert builtin[0]["content"] == FEWSHOT[0][0] + "\n" + FORMAT_INSTRUCTION
    assert builtin[1]["content"] == FEWSHOT[0][1]
    assert builtin[-1]["content"] == "What is 3 + 5?\n" + FORMAT_INSTRUCTION
    public = problem_messages(Problem("p1", "Find x.", "2", source="math500"))
    assert public == [{"role": "user", "content": "Find x.\n" + FORMAT_INSTRUCTION}]
    assert problem_messages(Problem("p2", "Find y.", "3")) == build_messages("Find y.")  # no source: no turns


def test_templated_builtin_row_changes_only_the_last_turn():
    row = Problem("b2", "What is 7 + 4 × 3?", "19", source="builtin/two_step")
    plain, templated = problem_messages(row), problem_messages(row, "Multiply first.")
    assert plain[:-1] == templated[:-1]
    assert templated[-1]["content"] == "Multiply first.\n\n" + plain[-1]["content"]


def test_official_prompt_format():
    row = Problem("b3", " What is 7 + 4 × 3? ", "19", source="builtin/two_step")
    official = problem_messages(row, fmt="official")
    text = "Let's think step by step and output the final answer within \\boxed{}.\nQuestion: What is 7 + 4 × 3?"
    assert official == [{"role": "user", "content": text}]  # no few-shot turns in the official format
    assert problem_messages(row, "Multiply first.", "official")[-1]["content"] == "Multiply first.\n\n" + text
    with pytest.raises(ValueError, match="prompt format"):
        problem_messages(row, fmt="chatml")
