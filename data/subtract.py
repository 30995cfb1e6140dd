"""The strategy task: one-step subtractions, half of whose results are below zero.

    python data/subtract.py        # rewrite data/subtract/{train,dev,test,heldout}.jsonl and strategy.txt

"What is 13 − 17?" The shipped 135M model answers subtractions whose result is positive but
almost never one whose result is negative: it writes "13 − 17 = 4" or "= 0" (measured:
results/strategy_pilot/). A short template that carries a procedure, not a fact, lifts it: work
out the bigger number minus the smaller, then put a minus sign on the difference (strategy.txt,
the Human-Ref seed template). The template holds no number and no answer; the model still has
to compute every difference itself. This is the task on which P²O's claim can be tested: the
hard prompts (negative results) are all-fail for GRPO, and a template unlocks them
(docs/EVIDENCE.md). The positive problems keep GRPO learning, so the control is a trained
policy, not the untrained model.

Problems: a − b with a ≠ b, both in 1..20 and |a − b| <= 9; 135 with a negative result (level
`neg`) and 135 with a positive one (`pos`), dealt out seeded: train 40 neg + 20 pos, dev 5 + 5,
test 20 + 10. The held-out split: operands 21..40, so no held-out problem shares an operand with
a problem of another split; 45 negative problems (the hard level the study scores, five for each
difference 1..9, so no one answer is right on more than a ninth of them) and 18 positive ones
(two per difference: a policy that negates every answer fails them). The answers, -9..9, are
those of training: the procedure is what transfers, not an answer. Every solution has the
few-shot answers' form, "24 − 29 = -5.", which no arm's training favours.
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import DATA_DIR, Problem, write_task  # noqa: E402

STRATEGY = ("When the second number is bigger, the result is below zero: work out (bigger) − (smaller) = "
            "(difference), and the answer is \\boxed{-difference}.")
SPLITS = {"train": {"neg": 40, "pos": 20}, "dev": {"neg": 5, "pos": 5}, "test": {"neg": 20, "pos": 10}}
HELDOUT_PER_DIFF = {"neg": 5, "pos": 2}  # held-out problems (operands 21..40) of each level for each difference 1..9
MAX_DIFF = 9


def pairs(low, high, sign):
    """(a, b) with low <= a, b <= high, 1 <= |a - b| <= MAX_DIFF and the sign of a - b, in a fixed order."""
    return [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)
            if 0 < abs(a - b) <= MAX_DIFF and (a - b > 0) == (sign > 0)]


def problem(a, b, split, i):
    level = "neg" if a < b else "pos"
    kind = "subtract-heldout" if split == "heldout" else "subtract"
    solution = f"{a} − {b} = {a - b}."  # the few-shot answers' form: no arm's training shapes it (the gold outcome)
    return Problem(id=f"subtract-{split}-{level}-{i:04d}", problem=f"What is {a} − {b}?", answer=str(a - b),
                   solution=solution, source=f"{kind}/{level}")


def make_splits(seed=0):
    """{split: [Problem]}: each level's pool shuffled and dealt out by SPLITS, plus the held-out split."""
    rng = random.Random(seed)
    pools = {"neg": pairs(1, 20, -1), "pos": pairs(1, 20, +1)}
    for pool in pools.values():
        rng.shuffle(pool)
    taken = {level: 0 for level in pools}
    splits = {}
    for name, sizes in SPLITS.items():
        rows = []
        for level, n in sizes.items():
            rows += [problem(a, b, name, j)
                     for j, (a, b) in enumerate(pools[level][taken[level]:taken[level] + n])]
            taken[level] += n
        splits[name] = rows
    splits["heldout"] = []
    for level, sign in (("neg", -1), ("pos", +1)):  # as many of each difference: no one answer scores above 1/9
        far = []
        for d in range(1, MAX_DIFF + 1):
            far += rng.sample([(a, b) for a, b in pairs(21, 40, sign) if abs(a - b) == d], HELDOUT_PER_DIFF[level])
        splits["heldout"] += [problem(a, b, "heldout", i) for i, (a, b) in enumerate(far)]
    return splits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(DATA_DIR, "subtract"))
    args = ap.parse_args()
    write_task(args.out, make_splits(args.seed), "strategy.txt",
               "Human-Ref seed template of the subtraction task: a procedure, no number (data/subtract.py)", STRATEGY)


if __name__ == "__main__":
    main()
