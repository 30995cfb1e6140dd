"""The mechanism test: conversions between made-up units, whose facts no model can know.

    python data/fictional.py        # rewrite data/fictional/{train,dev,test}.jsonl and facts.txt

"How many blarps are in 5 zogs?" needs the fact "1 zog = 7 blarps", which appears in no
problem and in no pretraining corpus: only a template can carry it. So plain GRPO gets no
signal here (every group fails), while P²O can sample with the fact in context and distil the
successes into the untemplated policy. Untemplated test accuracy then measures knowledge the
policy internalised, not a prompt (README, "Evidence").

Ten unit pairs with factors 5-9 (each factor twice), n = 2..9 of the big unit: 80 problems,
dealt per pair (seeded) into 4 train, 1 dev and 3 test problems, so every pair appears in
every split and the facts are shared while no problem repeats. Every answer n x f >= 10 is
larger than every number in the facts (1 and the factors), so a template of facts never
contains an answer. facts.txt holds the Human-Ref seed templates (--seed_templates), one per
pair, in the worked form that helped most. Measured on the train split with the default model
(8 samples at T = 0.6, few-shot prompt): no template avg@8 0.019 (35/40 prompts all-fail); the
problem's own pair as "1 zog = 7 blarps." 0.081 (20/40), as the worked line below 0.138
(14/40); all ten facts in one template 0.016 (35/40; the model recites the list) -- the model
uses one fact in context, not a table of ten, and GEPA assigns templates to the hard prompts
that it did not score without knowing their pair (README, "Evidence").
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import DATA_DIR, Problem, write_jsonl  # noqa: E402

PAIRS = [  # (big unit, small unit, small units per big unit)
    ("zog", "blarp", 7), ("quib", "flen", 5), ("morp", "tazzle", 6), ("dren", "wibbet", 8), ("plonk", "snig", 9),
    ("vorn", "kliff", 7), ("grell", "pim", 5), ("yorb", "daxel", 6), ("frell", "nub", 8), ("skree", "tov", 9),
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
