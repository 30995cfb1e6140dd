"""The built-in task: seeded arithmetic word problems in levels from easy to impossible for the
default 135M model, written as train/dev/test JSONL under data/builtin/.

    python data/builtin.py                       # rewrite data/builtin/{train,dev,test}.jsonl
    python data/builtin.py --train=40 --seed=1   # other sizes / another draw

Each level enumerates all of its problems, drops the few-shot examples of prompts.py, shuffles
with the seed and deals them out to the splits, so no problem appears in two splits. Rows look
like {"id": "builtin-add2-00017", "problem": "What is 38 + 45?", "answer": "83",
"solution": "38 + 45 = 83.", "source": "builtin/add2"}. The measured success rate of the
default model per level is in docs/TASKS.md.
"""

import argparse
import itertools
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import DATA_DIR, Problem, write_jsonl  # noqa: E402
from prompts import FEWSHOT  # noqa: E402

UNITS = [  # (big unit, small unit, factor)
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24),
    ("weeks", "days", 7), ("meters", "centimeters", 100), ("kilograms", "grams", 1000),
    ("feet", "inches", 12), ("dozens", "eggs", 12),
]


def add1():
    for a, b in itertools.product(range(10), repeat=2):
        yield f"What is {a} + {b}?", a + b, f"{a} + {b} = {a + b}."


def mul1():
    for a, b in itertools.product(range(1, 10), repeat=2):
        yield f"What is {a} × {b}?", a * b, f"{a} × {b} = {a * b}."


def add2():
    for a, b in itertools.product(range(10, 100), repeat=2):
        yield f"What is {a} + {b}?", a + b, f"{a} + {b} = {a + b}."


def units():
    for (big, small, factor), n in itertools.product(UNITS, range(2, 13)):
        noun = "eggs are in" if small == "eggs" else f"{small} are in"
        yield (f"How many {noun} {n} {big}?", n * factor,
               f"One {big[:-1]} is {factor} {small}, so {n} × {factor} = {n * factor}.")


def add3():
    for a, b, c in itertools.product(range(1, 10), repeat=3):
        yield f"What is {a} + {b} + {c}?", a + b + c, f"{a} + {b} = {a + b}; {a + b} + {c} = {a + b + c}."


def two_step():
    for a, b, c in itertools.product(range(1, 10), range(2, 10), range(2, 10)):
        yield (f"What is {a} + {b} × {c}?", a + b * c,
               f"Multiplication first: {b} × {c} = {b * c}; then {a} + {b * c} = {a + b * c}.")


LEVELS = {  # easy -> hard for the default model (measured: docs/TASKS.md)
    "add1": add1, "mul1": mul1, "add2": add2, "units": units, "add3": add3, "two_step": two_step,
}


def make_splits(sizes, seed=0, levels=LEVELS):
    """{split: [Problem]} with sizes[split] problems of every level, disjoint across splits."""
    rng = random.Random(seed)
    fewshot = {q for q, _ in FEWSHOT}
    splits = {name: [] for name in sizes}
    for level, gen in levels.items():
        pool = [row for row in gen() if row[0] not in fewshot]
        need = sum(sizes.values())
        if need > len(pool):
            raise ValueError(f"level {level} has {len(pool)} problems, {need} were asked for")
        rng.shuffle(pool)
        start = 0
        for name, n in sizes.items():
            for i, (problem, answer, solution) in enumerate(pool[start:start + n]):
                splits[name].append(Problem(
                    id=f"builtin-{level}-{name}-{i:04d}", problem=problem, answer=str(answer),
                    solution=solution, source=f"builtin/{level}"))
            start += n
    return splits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=40, help="problems per level in train")
    ap.add_argument("--dev", type=int, default=10, help="problems per level in dev")
    ap.add_argument("--test", type=int, default=20, help="problems per level in test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(DATA_DIR, "builtin"))
    args = ap.parse_args()
    splits = make_splits({"train": args.train, "dev": args.dev, "test": args.test}, args.seed)
    for name, rows in splits.items():
        path = os.path.join(args.out, f"{name}.jsonl")
        write_jsonl(path, rows)
        print(f"wrote {len(rows)} problems to {path}")


if __name__ == "__main__":
    main()
