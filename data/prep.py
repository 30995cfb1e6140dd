"""Turn the public sets the paper uses into our JSONL schema (needs the HF hub: run it online).

    pip install datasets
    python data/prep.py                        # every set below -> data/public/{name}.jsonl
    python data/prep.py aime24 math500         # some of them
    python data/prep.py deepscaler --limit=5000 --seed=0   # the paper's 5K training subset

Each set is described by where it lives on the hub and how its rows map to
{id, problem, answer, solution?, source}. Rows without a usable answer are dropped and counted
(never silently: the count is printed). DeepMath-103K keeps difficulty >= 7 (the paper's hard
subset). The conversion itself (`convert`) is pure and tested offline on fixture rows of the same
shapes (tests/fixtures/prep/).
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import DATA_DIR, Problem, write_jsonl  # noqa: E402


def _text(value):
    """An answer field as a clean string: ints/floats without a trailing .0, lists joined."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(_text(v) for v in value)
    return str(value).strip()


def _strip_dollars(s):
    return s[1:-1].strip() if len(s) >= 2 and s[0] == "$" and s[-1] == "$" else s


# name -> hub id, split, and field names (problem, answer, solution, id); a `keep` filter
SOURCES = {
    "deepscaler": dict(hub="agentica-org/DeepScaleR-Preview-Dataset", split="train",
                       problem="problem", answer="answer", solution="solution"),
    "deepmath": dict(hub="zwhe99/DeepMath-103K", split="train", problem="question",
                     answer="final_answer", solution=None, keep=lambda r: float(r.get("difficulty", 0)) >= 7),
    "aime24": dict(hub="HuggingFaceH4/aime_2024", split="train", problem="problem", answer="answer",
                   solution="solution", id="id"),
    "aime25": dict(hub="math-ai/aime25", split="test", problem="problem", answer="answer", solution=None, id="id"),
    "amc23": dict(hub="math-ai/amc23", split="test", problem="question", answer="answer", solution=None, id="id"),
    "math500": dict(hub="HuggingFaceH4/MATH-500", split="test", problem="problem", answer="answer",
                    solution="solution", id="unique_id"),
    "minerva": dict(hub="math-ai/minervamath", split="test", problem="question", answer="answer", solution=None),
    "olympiadbench": dict(hub="math-ai/olympiadbench", split="test", problem="question",
                          answer="final_answer", solution=None, id="id"),
}


def convert(name, rows):
    """Hub rows (dicts) of set `name` -> ([Problem], number of dropped rows)."""
    spec = SOURCES[name]
    problems, dropped, seen = [], 0, set()
    for i, row in enumerate(rows):
        if "keep" in spec and not spec["keep"](row):
            continue
        problem = _text(row.get(spec["problem"]))
        answer = _strip_dollars(_text(row.get(spec["answer"])))
        if not problem or not answer:
            dropped += 1
            continue
        raw_id = _text(row.get(spec["id"])) if spec.get("id") else ""
        pid = f"{name}-{raw_id or i}"
        if pid in seen:
            pid = f"{name}-{i}"
        seen.add(pid)
        solution = _text(row.get(spec["solution"])) if spec.get("solution") else None
        problems.append(Problem(id=pid, problem=problem, answer=answer,
                                solution=solution or None, source=name))
    return problems, dropped


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(SOURCES), help=", ".join(SOURCES))
    ap.add_argument("--limit", type=int, default=0, help="keep a seeded random subset of this size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(DATA_DIR, "public"))
    args = ap.parse_args()
    try:
        from datasets import load_dataset
    except ImportError:
        sys.exit("data/prep.py needs the `datasets` package: pip install datasets")
    for name in args.names:
        if name not in SOURCES:
            sys.exit(f"unknown set {name!r}; known: {', '.join(SOURCES)}")
        spec = SOURCES[name]
        problems, dropped = convert(name, load_dataset(spec["hub"], split=spec["split"]))
        if args.limit and len(problems) > args.limit:
            problems = random.Random(args.seed).sample(problems, args.limit)
        path = os.path.join(args.out, f"{name}.jsonl")
        write_jsonl(path, problems)
        print(f"{name}: wrote {len(problems)} problems to {path} ({dropped} rows without problem/answer dropped)")


if __name__ == "__main__":
    main()
