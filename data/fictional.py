"""The mechanism test: conversions between made-up units, whose facts no model can know.

    python data/fictional.py        # rewrite data/fictional/{train,dev,test}.jsonl and facts.txt

"How many blarps are in 5 zogs?" needs this world's one conversion rule (every big unit is 13
of its small unit), which appears in no problem and in no pretraining corpus: only a template
can carry it. So plain GRPO gets (almost) no signal here (every group fails), while P²O can
sample with the rule in context and distil the successes into the untemplated policy.
Untemplated test accuracy then measures knowledge the policy internalised, not a prompt
(docs/EVIDENCE.md).

Ten made-up unit pairs sharing the rule, n = 2..9 of the big unit: 80 problems, dealt per pair
(seeded) into 4 train, 1 dev and 3 test problems, so every pair appears in every split while no
problem repeats. Every answer 13n >= 26 differs from the rule's only number, 13, so the rule
never contains an answer. facts.txt holds the Human-Ref seed template (--seed_templates).

Measured with the default model on all 80 problems (T = 0.6, few-shot prompt): no template
0 correct of 1,280 samples (16 per problem), with the rule avg@8 0.083 (52/80 all-fail).
Why 13: the factor must be one the model never guesses, because a single lucky success is
enough for GRPO to learn a shared rule. With 12 (a dozen) the rule helps more (0.219) but
the model guesses it (avg@16 0.006 on test), and GRPO (K) alone went from dev 0.0 to 1.0 in 8
steps. Without a template, 11 was guessed 4 times in 1,280; 13, 17 and 23 never, and their
rules gave 0.083, 0.059 and 0.008. One rule, not one fact per pair, because P²O assigns the
few templates GEPA keeps to every hard prompt: with a fact per pair (factors 11-25) GEPA kept
1-3 of them and most hard prompts were sampled under another pair's fact, and several facts in
one template hurt (the model recites the list). Earlier designs and their measurements: docs/EVIDENCE.md.
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import DATA_DIR, Problem, write_task  # noqa: E402

PAIRS = [  # (big unit, small unit): made-up names
    ("zog", "blarp"), ("quib", "flen"), ("morp", "tazzle"), ("dren", "wibbet"), ("plonk", "snig"),
    ("vorn", "kliff"), ("grell", "pim"), ("yorb", "daxel"), ("frell", "nub"), ("skree", "tov"),
]
FACTOR = 13  # small units per big unit, for every pair: never guessed untemplated (above)
RULE = f"Every big unit here is {FACTOR} of its small unit: n big units = n × {FACTOR} small units."
COUNTS = range(2, 10)
SPLITS = {"train": 4, "dev": 1, "test": 3}  # problems per pair
# The held-out rule split: the same rule on unit names never seen in training and counts outside
# COUNTS, so no answer (13n, n = 10..17: 130..221) was ever a training answer or a trained token
# sequence. Only a policy that applies the rule (not one that recalls answers) can solve it.
HELDOUT_PAIRS = [("trog", "mib"), ("zundle", "pex"), ("brack", "wunt"), ("glim", "hosk"), ("fremp", "dorl")]
HELDOUT_COUNTS = range(10, 18)


def make_splits(seed=0):
    """{split: [Problem]}: every pair's 8 problems shuffled and dealt out by SPLITS."""
    rng = random.Random(seed)
    splits = {name: [] for name in SPLITS}
    for big, small in PAIRS:
        counts = list(COUNTS)
        rng.shuffle(counts)
        start = 0
        for name, size in SPLITS.items():
            for n in counts[start:start + size]:
                splits[name].append(problem(big, small, n))
            start += size
    return splits


def heldout_split():
    """[Problem]: every held-out pair with every held-out count (40 problems, no randomness)."""
    return [problem(big, small, n, "fictional-heldout") for big, small in HELDOUT_PAIRS for n in HELDOUT_COUNTS]


def problem(big, small, n, kind="fictional"):
    return Problem(id=f"{kind}-{big}-{n}", problem=f"How many {small}s are in {n} {big}s?", answer=str(n * FACTOR),
                   solution=f"1 {big} is {FACTOR} {small}s, so {n} × {FACTOR} = {n * FACTOR}.", source=f"{kind}/{big}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(DATA_DIR, "fictional"))
    args = ap.parse_args()
    write_task(args.out, {**make_splits(args.seed), "heldout": heldout_split()}, "facts.txt",
               "Human-Ref seed template of the fictional-unit task: its one conversion rule (data/fictional.py)", RULE)


if __name__ == "__main__":
    main()
