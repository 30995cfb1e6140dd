import threading
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import verify
from verify import check, last_boxed, reward


@pytest.mark.parametrize("response, answer", [
    ("so \\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
    ("\\boxed{\\tfrac34}", "0.75"),
    ("\\boxed{\\frac12}", "1/2"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{\\sqrt{4}}", "2"),
    ("\\boxed{2\\pi}", "6.283185307"),
    ("\\boxed{\\pi r^2}", "r^2 \\pi"),
    ("\\boxed{-3}", "-3"),
    ("\\boxed{-\\frac{1}{3}}", "\\frac{-1}{3}"),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}"),
    ("\\boxed{[0, 1)}", "[0,1)"),
    ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{  42 }", "42"),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})"),
    ("The answer is $\\boxed{10}$.", "10"),
    ("\\fbox{7}", "7"),
    ("\\boxed{\\boxed{5}}", "5"),
    ("first \\boxed{4}, finally \\boxed{6}", "6"),
])
def test_equivalent_forms_score_one(response, answer):
    v = check(response, answer)
    assert v.reward == 1.0, v
    assert reward(response, answer) == 1.0


@pytest.mark.parametrize("response, answer, reason", [
    ("\\boxed{3}", "4", "not_equivalent"),
    ("\\boxed{0.3333}", "\\frac{1}{3}", "not_equivalent"),
    ("\\boxed{\\pi}", "3.14", "not_equivalent"),
    ("\\boxed{(1, 2)}", "[1,2]", "not_equivalent"),
    ("\\boxed{(1, 2)}", "(2,1)", "not_equivalent"),
    ("\\boxed{-3}", "3", "not_equivalent"),
    ("\\boxed{6} then \\boxed{4}", "6", "not_equivalent"),  # the final box counts
    ("The answer is 4.", "4", "no_box"),
    ("", "4", "no_box"),
    ("\\boxed{}", "4", "empty_box"),
    ("\\boxed{ }", "4", "empty_box"),
    ("\\boxed{4", "4", "unclosed_box"),
    ("\\boxed{" + "1" * 2000 + "}", "1", "answer_too_long"),
])
def test_wrong_or_missing_answers_score_zero(response, answer, reason):
    v = check(response, answer)
    assert (v.reward, v.reason) == (0.0, reason)


def test_extraction_details():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{2}{3}} c") == ("\\frac{2}{3}", "ok")
    assert last_boxed("\\boxed{\\{1,2\\}}") == ("\\{1,2\\}", "ok")  # escaped braces do not close
    assert last_boxed("\\boxed{a{b}c}") == ("a{b}c", "ok")
    assert last_boxed("\\boxed{1} \\boxed{2") == (None, "unclosed_box")
    assert check("x \\boxed{7} y", "7").extracted == "7"


@pytest.mark.parametrize("response", [
    "\\boxed{9^{9^{9^9}}}",
    "\\boxed{9^9^9^9}",
    "\\boxed{10^{10^{10^{10}}}!}",
    "\\boxed{" + "(" * 10_000 + "1" + ")" * 10_000 + "}",
    "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
    "\\boxed{" + "(" * 60 + "1" + ")" * 60 + "}",
    "x" * 1_000_000,
    "\\boxed{1}" * 100_000,
    "\\boxed{" * 100_000,
    "\\boxed{__import__('os').system('touch /tmp/p2o_pwned')}",
    "\\boxed{exec('import os')}",
    "\\boxed{\\x00\\xff\\u202e}",
])
def test_pathological_answers_return_zero_quickly(response, tmp_path):
    t = time.monotonic()
    v = check(response, "3")
    assert v.reward == 0.0
    assert time.monotonic() - t < verify.DEFAULT_TIMEOUT + 1.0


def test_timeout_is_enforced_in_a_worker_thread():
    """A signal-based timeout would not fire here: the call runs outside the main thread."""
    result = {}

    def run():
        t = time.monotonic()
        result["verdict"] = check("\\boxed{9^{9^{9^9}}}", "1", timeout=0.2)  # ~1 s of sympy
        result["seconds"] = time.monotonic() - t

    check("\\boxed{1/2}", "0.5")  # the child is started and warm
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert result["verdict"].reward == 0.0
    assert result["verdict"].reason == "timeout"
    assert result["seconds"] < 0.7
    assert reward("\\boxed{2}", "\\sqrt{4}") == 1.0  # the checker recovers after a kill


def test_checks_from_many_threads_agree():
    cases = [("\\boxed{\\frac{%d}{4}}" % i, str(i / 4)) for i in range(40)]
    out = [None] * len(cases)

    def run(i):
        out[i] = reward(*cases[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [1.0] * len(cases)


def test_rejects_non_strings():
    with pytest.raises(TypeError):
        reward(None, "1")


@settings(max_examples=1000, deadline=None, derandomize=True)
@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6))
def test_integers_property(a, b):
    assert reward(f"\\boxed{{{a}}}", str(b)) == float(a == b)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(1, 999), st.sampled_from([1, 2, 4, 5, 8, 10, 16, 20, 25]))
def test_fraction_equals_its_decimal(p, q):
    decimal = str(float(Fraction(p, q)))
    assert reward(f"\\boxed{{\\frac{{{p}}}{{{q}}}}}", decimal) == 1.0


LATEXISH = st.lists(st.sampled_from(list("0123456789+-*/^_()[]{}\\,.=xyπ !$ ") +
                                    ["\\frac", "\\sqrt", "\\pi", "\\infty", "\\boxed{", "\\left(", "\\cdot"]),
                    max_size=40).map("".join)


@settings(max_examples=1500, deadline=None, derandomize=True)
@given(st.one_of(st.text(max_size=200), LATEXISH.map(lambda s: "\\boxed{" + s + "}")),
       st.sampled_from(["3", "\\frac{1}{2}", "(1,2)", "x+1", "\\sqrt{2}"]))
def test_fuzz_never_crashes_or_hangs(response, answer):
    t = time.monotonic()
    v = check(response, answer)
    assert v.reward in (0.0, 1.0)
    assert time.monotonic() - t < verify.DEFAULT_TIMEOUT + 1.0
