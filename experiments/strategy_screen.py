"""Issue 54's screening before pilot round 5: which one-step task has a procedure that a short template
can hand the 135M default model? Candidate levels generated here (none is shipped), each answered with no
template and with two candidate templates (a procedure in words, or one shown on a problem outside the
level), k samples at each temperature, few-shot prompt as the built-in task's.

    python experiments/strategy_screen.py                       # round A: templates in words, T = 1
    python experiments/strategy_screen.py --round=B             # round B: answer-shaped templates, T = 0.6 and 1

Writes results/strategy_pilot/screen-<round>.md (and .json): avg@k, pass@k and greedy per level and template.
Descriptive, tests nothing: it picked the level that data/subtract.py then made a task of.
"""

import argparse
import itertools
import json
import os
import random
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from data import Problem  # noqa: E402

OUT = os.path.join(ROOT, "results", "strategy_pilot")


def levels():
    """{level: [(question, answer)]}: candidate one-step tasks (two_step is the built-in level's generator)."""
    return {
        "two_step": [(f"What is {a} + {b} × {c}?", a + b * c)
                     for a, b, c in itertools.product(range(1, 10), range(2, 10), range(2, 10))],
        "repeat": [("What is " + " + ".join([str(x)] * n) + "?", n * x)
                   for x, n in itertools.product(range(2, 10), range(3, 8))],
        "neg": [(f"What is {a} − {b}?", a - b) for a in range(1, 9) for b in range(a + 1, 10)],
        "tens": [(f"What is {a}0 × {b}?", 10 * a * b) for a, b in itertools.product(range(2, 10), repeat=2)],
        "less_than": [(f"What is {a} less than {b + 10}?", b + 10 - a) for a in range(1, 9) for b in range(a + 1, 10)],
    }


# round -> level -> two templates; round A in words, round B shaped like the few-shot answers. Every number in a
# round B template lies outside its level's answers (a worked example is no problem's answer).
TEMPLATES = {
    "A": {
        "repeat": ["When one number is added to itself several times, count the copies and multiply: the number × "
                   "the count.",
                   "Worked example: 10 + 10 + 10 + 10 is 4 copies of 10, so 4 × 10 = 40. Do the same: count the "
                   "copies, then multiply."],
        "neg": ["If the second number is bigger, the result is below zero: subtract the smaller from the bigger and "
                "put a minus sign in front.",
                "Worked example: 10 − 13. 13 is bigger, 13 − 10 = 3, so 10 − 13 = -3. Do the same."],
        "tens": ["To multiply a multiple of ten, multiply its tens digit by the other number, then write a 0 after "
                 "the result.",
                 "Worked example: 50 × 11. 5 × 11 = 55, then add a 0: 550. Do the same."],
        "less_than": ["'a less than b' means b − a: start from the second number and take away the first.",
                      "Worked example: 2 less than 30 means 30 − 2 = 28. Do the same."],
    },
    "B": {
        "two_step": ["Example: What is 200 + 3 × 300?\n3 × 300 = 900. 200 + 900 = 1100. The answer is \\boxed{1100}.",
                     "Answer like this: first write b × c = (product). Then write a + (product) = (sum). The answer "
                     "is \\boxed{sum}."],
        "neg": ["Example: What is 20 − 31?\n31 − 20 = 11, so 20 − 31 = -11. The answer is \\boxed{-11}.",
                "Answer like this: (bigger) − (smaller) = (difference), so the answer is \\boxed{-difference}."],
        "repeat": ["Example: What is 100 + 100 + 100?\nThree copies of 100: 3 × 100 = 300. The answer is "
                   "\\boxed{300}.",
                   "Answer like this: (count) copies of (number): (count) × (number) = (product). The answer is "
                   "\\boxed{product}."],
        "less_than": ["Example: What is 2 less than 30?\n30 − 2 = 28. The answer is \\boxed{28}.",
                      "Answer like this: 'a less than b' is b − a = (difference). The answer is "
                      "\\boxed{difference}."],
    },
}
ROUNDS = {"A": {"temperatures": (1.0,), "per_level": 0}, "B": {"temperatures": (0.6, 1.0), "per_level": 40}}


def problems(level, per_level, seed=0):
    """The level's problems as rows with a built-in source (so the few-shot turns come first); per_level > 0:
    that many, drawn seeded."""
    rows = [Problem(id=f"screen-{level}-{i:03d}", problem=q, answer=str(a), source=f"builtin/{level}")
            for i, (q, a) in enumerate(levels()[level])]
    if per_level:
        random.Random(seed).shuffle(rows)
        rows = rows[:per_level]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--round", default="A", choices=sorted(TEMPLATES))
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max_tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from config import Config, cpu_precision
    from model import resolve_model
    from rollout import make_rollout
    from scoring import answer_sets

    cfg = Config()
    cfg.engine_dtype, cfg.autocast_bf16, _ = cpu_precision(cfg, "cpu")
    engine = make_rollout("vllm", resolve_model(cfg.model), dtype=cfg.engine_dtype, seed=args.seed,
                          max_model_len=2048, kv_cache_gib=2)
    rnd = ROUNDS[args.round]
    sets = [(level, i, template, problems(level, rnd["per_level"], args.seed))
            for level, templates in TEMPLATES[args.round].items() for i, template in enumerate([""] + templates)]
    rows = []
    for temperature in rnd["temperatures"]:
        answered = answer_sets(engine, [(ps, t, args.k) for _, _, t, ps in sets], temperature=temperature,
                               max_tokens=args.max_tokens, seed=args.seed, reward=cfg.reward)
        for (level, i, template, ps), records in zip(sets, answered):
            solved = [sum(r > 0 for r in rec["sampled"]["rewards"]) for rec in records]
            rows.append({"T": temperature, "level": level, "template": template, "problems": len(ps),
                         "avg": statistics.mean(s / args.k for s in solved),
                         "pass": statistics.mean(s > 0 for s in solved),
                         "greedy": statistics.mean(rec["rewards"][0] > 0 for rec in records)})
    stem = os.path.join(OUT, f"screen-{args.round}")
    with open(stem + ".json", "w") as f:
        json.dump(rows, f, indent=1, ensure_ascii=False)
    lines = [f"# Screening round {args.round}: candidate levels, k = {args.k}", "",
             f"Written by `python experiments/strategy_screen.py --round={args.round}`; descriptive, tests nothing.",
             "", "| T | level | problems | template | avg@k | pass@k | greedy |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['T']} | {r['level']} | {r['problems']} | {r['template'] or '(none)'} | {r['avg']:.3f} | "
              f"{r['pass']:.3f} | {r['greedy']:.3f} |".replace("\n", " ") for r in rows]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
