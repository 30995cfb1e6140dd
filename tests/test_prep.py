"""data/prep.py: conversion of public data sets into the JSONL schema."""

import json
import os

import pytest

from data.prep import SOURCES, convert

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "prep")


def rows(name):
    with open(os.path.join(FIXTURES, f"{name}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_source_has_a_fixture_and_converts(name):
    problems, _ = convert(name, rows(name))
    assert problems
    assert len({p.id for p in problems}) == len(problems)
    for p in problems:
        assert p.problem and p.answer and p.source == name and p.id.startswith(name + "-")


def test_conversions_by_hand():
    ds, dropped = convert("deepscaler", rows("deepscaler"))
    assert [(p.id, p.answer) for p in ds] == [("deepscaler-0", "4"), ("deepscaler-1", "\\frac{5}{6}")]
    assert dropped == 1 and ds[0].solution == "Squaring gives $4$."
    dm, _ = convert("deepmath", rows("deepmath"))  # difficulty >= 7 only
    assert [p.answer for p in dm] == ["e", "8"]
    assert [p.answer for p in convert("amc23", rows("amc23"))[0]] == ["27", "36"]  # 27.0 -> 27
    assert convert("aime24", rows("aime24"))[0][0].id == "aime24-60"
    assert convert("olympiadbench", rows("olympiadbench"))[0][0].answer == "2,3"  # ["$2,3$"]
    mp = convert("math500", rows("math500"))[0][0]
    assert mp.id == "math500-test/precalculus/807.json" and mp.answer.startswith("\\left( 3")
