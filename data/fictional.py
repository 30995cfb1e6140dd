"""The mechanism test: conversions between made-up units, whose facts no model can know.

    python data/fictional.py        # rewrite data/fictional/{train,dev,test}.jsonl and facts.txt

"How many blarps are in 5 zogs?" needs the fact "1 zog = 11 blarps", which appears in no
problem and in no pretraining corpus: only a template can carry it. So plain GRPO gets no
signal here (every group fails), while P²O can sample with the fact in context and distil the
successes into the untemplated policy. Untemplated test accuracy then measures knowledge the
policy internalised, not a prompt (README, "Evidence").

Ten unit pairs with two-digit factors (11, 12, 15, 20, 25, each twice), n = 2..9 of the big
unit: 80 problems, dealt per pair (seeded) into 4 train, 1 dev and 3 test problems, so every
pair appears in every split and the facts are shared while no problem repeats. Every answer
n x f >= 22 differs from every number in the facts (1 and the factors), so a template of facts
never contains an answer. facts.txt holds the Human-Ref seed templates (--seed_templates), one
per pair, in the worked form. Measured with the default model on all 80 problems (8 samples at
T = 0.6, few-shot prompt): no template avg@8 0.002 (79/80 prompts all-fail: the model cannot
guess a two-digit factor), the problem's own fact 0.153 (33/80 all-fail). One-digit factors
(5-9) were guessable: 0.019 without a template, and plain GRPO learned them from the lucky
guesses (README, "Evidence"). Several facts in one template hurt (2 facts 0.053, 3 facts 0.015:
the model recites the list), so the model needs its own pair's single fact, and GEPA assigns
templates to the hard prompts that it did not score without knowing their pair.
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import DATA_DIR, Problem, write_jsonl  # noqa: E402

PAIRS = [  # (big unit, small unit, small units per big unit)
    ("zog", "blarp", 11), ("quib", "flen", 12), ("morp", "tazzle", 15), ("dren", "wibbet", 20), ("plonk", "snig", 25),
    ("vorn", "kliff", 11), ("grell", "pim", 12), ("yorb", "daxel", 15), ("frell", "nub", 20), ("skree", "tov", 25),
]
COUNTS = range(2, 10)
SPLITS = {"train": 4, "dev": 1, "test": 3}  # problems per pair


def fact(big, small, factor):
    """The Human-Ref seed template of one pair."""
    return f"1 {big} = {factor} {small}s, so n {big}s = n × {factor} {small}s."


def make_splits(seed=0):
    """{split: [Problem]}: every pair's 8 problems shuffled and dealt out by SPLITS."""
    rng = random.Random(seed)
    splits = {name: [] for name in SPLITS}
    for big, small, factor in PAIRS:
        counts = list(COUNTS)
        rng.shuffle(counts)
        start = 0
        for name, size in SPLITS.items():
            for n in counts[start:start + size]:
                splits[name].append(Problem(
                    id=f"fictional-{big}-{n}", problem=f"How many {small}s are in {n} {big}s?", answer=str(n * factor),
                    solution=f"1 {big} is {factor} {small}s, so {n} × {factor} = {n * factor}.",
                    source=f"fictional/{big}"))
            start += size
    return splits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(DATA_DIR, "fictional"))
    args = ap.parse_args()
    for name, rows in make_splits(args.seed).items():
        path = os.path.join(args.out, f"{name}.jsonl")
        write_jsonl(path, rows)
        print(f"wrote {len(rows)} problems to {path}")
    path = os.path.join(args.out, "facts.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("# Human-Ref seed templates of the fictional-unit task, one per pair (data/fictional.py)\n")
        f.writelines(fact(*p) + "\n" for p in PAIRS)
    print(f"wrote {len(PAIRS)} seed templates to {path}")


if __name__ == "__main__":
    main()
