"""verify.py's "official" rule (the reference P2O DeepMath reward): exactly one `\\boxed`, then
`check`, then the numeric path (relative 1e-4, percentage readings). Expected values by hand."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import verify
from verify import check, numeric_close, official_check, official_reward, plain_number, reward


# (response, answer, ours, official)
@pytest.mark.parametrize("response, answer, ours, official", [
    ("First guess \\boxed{3}; no, it is \\boxed{4}.", "4", 1.0, 0.0),  # two boxes
    ("So the answer is \\boxed{4}.", "4", 1.0, 1.0),  # one correct box
    ("\\boxed{0.5}", "50", 0.0, 1.0),  # gold/100
    ("\\boxed{50}", "0.5", 0.0, 1.0),  # gold*100
    ("\\boxed{3.14159}", "3.1416", 0.0, 1.0),  # |diff| 1e-5 <= 1e-4 * 3.1416
    ("\\boxed{100.005}", "100", 0.0, 1.0),  # relative 5e-5
    ("\\boxed{100.02}", "100", 0.0, 0.0),  # relative 2e-4
    ("\\boxed{1,000}", "1000", 1.0, 1.0),
    ("\\boxed{1000}", "1,000", 1.0, 1.0),
    ("\\boxed{$7$}", "7", 1.0, 1.0),
    ("\\boxed{-3}", "-3", 1.0, 1.0),
    ("\\boxed{-0.5}", "-50", 0.0, 1.0),  # the percentage reading keeps the sign
    ("\\boxed{-3}", "3", 0.0, 0.0),
    ("\\boxed{-50}", "0.5", 0.0, 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),  # decided by math-verify, not the numeric path
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0, 0.0),
    ("Put it in \\boxed form: \\boxed{4}", "4", 1.0, 0.0),  # `\boxed` without braces counts
    ("\\boxed{\\boxed{5}}", "5", 1.0, 0.0),  # a box inside a box counts
    ("The answer is 4.", "4", 0.0, 0.0),
])
def test_ours_and_official(response, answer, ours, official):
    assert reward(response, answer) == ours
    assert official_reward(response, answer) == official


@pytest.mark.parametrize("response, answer, reason, extracted", [
    ("The answer is 4.", "4", "not_one_box", None),
    ("a \\boxed{4} b \\boxed{4}", "4", "not_one_box", None),
    ("\\boxed{0.5}", "50", "numeric_close", "0.5"),
    ("\\boxed{100.02}", "100", "not_equivalent", "100.02"),  # check's verdict stands
    ("\\boxed{4}", "4", "exact_match", "4"),  # check's verdict stands
    ("\\boxed 5", "5", "no_box", None),  # one `\boxed`, but no box for check to read
    ("\\boxed{}", "0", "empty_box", ""),
])
def test_official_reasons(response, answer, reason, extracted):
    v = official_check(response, answer)
    assert (v.reason, v.extracted) == (reason, extracted)
    assert v.reward == (1.0 if reason in ("numeric_close", "exact_match") else 0.0)


def test_official_agrees_with_check_when_check_says_one():
    for response, answer in [("\\boxed{\\dfrac{3}{4}}", "0.75"), ("\\boxed{(1, 2)}", "(1,2)")]:
        assert official_check(response, answer) == check(response, answer)


@pytest.mark.parametrize("text, value", [
    ("7", 7.0), ("-7", -7.0), ("+7", 7.0), ("0.25", 0.25), (".5", 0.5), ("-1.5", -1.5),
    ("1,000", 1000.0), ("12,345,678.9", 12345678.9), ("1{,}000", 1000.0), ("-1,234.5", -1234.5),
    ("$7$", 7.0), ("\\$7", 7.0), ("$5", 5.0), ("50%", 50.0), ("50\\%", 50.0), ("$50\\%$", 50.0),
    (" 3 ", 3.0),
])
def test_plain_number_reads(text, value):
    assert plain_number(text) == value


@pytest.mark.parametrize("text", [
    "", "-", ".", "1.", "1,2", "1,0000", "12,34", ",100", "1e5", "inf", "nan", "1_000", "0x10",
    "1 000", "\\frac{1}{2}", "x", "5$", "%", "1" * 400,  # 400 digits overflow float to inf
])
def test_plain_number_refuses(text):
    assert plain_number(text) is None


def test_numeric_close_tolerance_and_percentages():
    assert numeric_close("100.005", "100") and not numeric_close("100.02", "100")
    assert numeric_close("0.5", "50") and numeric_close("50", "0.5")
    assert numeric_close("0", "0") and not numeric_close("0.00001", "0")  # relative, not absolute
    assert numeric_close("5000", "50")  # gold*100, both ways round
    assert not numeric_close("x", "1") and not numeric_close("1", "x")


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**12, 10**12))
def test_thousands_groups_read_as_the_integer(n):
    assert plain_number(f"{n:,}") == n
    assert plain_number(f"{n:,}".replace(",", "{,}")) == n


def test_rewards_maps_both_names():
    assert verify.REWARDS == {"ours": reward, "official": official_reward}


def test_official_rejects_non_strings():
    with pytest.raises(TypeError):
        official_check(None, "1")
    with pytest.raises(TypeError):
        official_check("\\boxed{1}", 1)
