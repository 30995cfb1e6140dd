"""Problem files: one JSON object per line, validated row by row.

Schema (one line of a .jsonl file):

    {"id": "builtin-add2-00017", "problem": "What is 38 + 45?", "answer": "83",
     "solution": "38 + 45 = 83.", "source": "builtin/add2"}

`id`, `problem`, `answer` are required non-empty strings, `id` unique within a file;
`solution` and `source` are optional strings. A bad row stops loading with
`DataError("path:line: why")`; `skip_bad=True` skips bad rows instead and reports how many.

Names accepted wherever a data file is asked for:
    builtin-train, builtin-dev, builtin-test   -> data/builtin/{split}.jsonl (shipped)
    fictional-train, fictional-dev, ...         -> data/fictional/{split}.jsonl (shipped; made-up units)
    subtract-train, subtract-heldout, ...       -> data/subtract/{split}.jsonl (shipped; the strategy task)
    aime24, math500, ...                       -> data/public/{name}.jsonl (made by data/prep.py)
    anything else                              -> a path to a .jsonl file

`PromptStream` hands train.py a set's problems in a fresh seeded order every epoch.
"""

import json
import os
import random
from dataclasses import dataclass

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
REQUIRED = ("id", "problem", "answer")
OPTIONAL = ("solution", "source")
SHIPPED = ("builtin", "fictional", "subtract")  # tasks shipped under data/<task>/ (data/<task>.py)
PREP_HINT = "; convert the file with data/prep.py (--problem/--answer/--id map its columns)"


class DataError(ValueError):
    """A data file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str
    solution: str | None = None
    source: str | None = None


def resolve_data(name_or_path):
    """Map a short name (see module docstring) to a file path; paths pass through."""
    for task in SHIPPED:
        if name_or_path.startswith(task + "-"):
            return os.path.join(DATA_DIR, task, name_or_path[len(task) + 1:] + ".jsonl")
    if os.sep not in name_or_path and not name_or_path.endswith(".jsonl"):
        return os.path.join(DATA_DIR, "public", name_or_path + ".jsonl")
    return name_or_path


def json_object(line):
    """One JSONL line -> dict, or ValueError saying why it is not a JSON object."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    return row


def parse_row(line):
    """One JSONL line -> Problem, or ValueError saying what is wrong with it."""
    row = json_object(line)
    for key in REQUIRED:
        if key not in row:
            raise ValueError(f"missing field {key!r}{PREP_HINT}")
        if not isinstance(row[key], str):
            raise ValueError(f"field {key!r} must be a string, got {type(row[key]).__name__}{PREP_HINT}")
        if not row[key].strip():
            raise ValueError(f"field {key!r} is empty")
    for key in OPTIONAL:
        if row.get(key) is not None and not isinstance(row[key], str):
            raise ValueError(f"field {key!r} must be a string, got {type(row[key]).__name__}{PREP_HINT}")
    return Problem(**{k: row.get(k) for k in REQUIRED + OPTIONAL})


def load_jsonl(name_or_path, skip_bad=False):
    """Load and validate every row. Returns (problems, number_of_skipped_rows)."""
    path = resolve_data(name_or_path)
    if not os.path.isfile(path):
        hint = " (run `python data/prep.py` online to make it)" if "public" in path else ""
        raise DataError(f"{path}: no such data file{hint}")
    problems, seen, skipped = [], set(), 0
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is an error naming it, like any bad row
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"not UTF-8 text (byte {e.start + 1} of the line: {raw[e.start:e.start + 1]!r})") \
                        from None
                p = parse_row(line)
                if p.id in seen:
                    raise ValueError(f"duplicate id {p.id!r}")
            except ValueError as e:
                if not skip_bad:
                    raise DataError(f"{path}:{lineno}: {e}") from None
                skipped += 1
                continue
            seen.add(p.id)
            problems.append(p)
    if not problems:
        raise DataError(f"{path}: no valid rows")
    return problems, skipped


def load_data(cfg):
    """(train set, dev set) of a run (`cfg`: config.Config's --train_data, --dev_data, --dev_holdout,
    --seed), every row validated before any model loads: a bad file is one line naming the flag,
    the file and the row."""
    sets = []
    for flag in ("train_data", "dev_data"):
        try:
            sets.append(load_jsonl(getattr(cfg, flag))[0] if getattr(cfg, flag) else [])
        except DataError as e:
            raise SystemExit(f"--{flag}: {e}") from None
    if cfg.dev_holdout:
        sets = hold_out(sets[0], cfg.dev_holdout, cfg.seed)
    return sets


def hold_out(problems, n, seed):
    """(train, dev): n problems drawn (seeded, own stream) as an in-distribution dev set, the rest to train."""
    if not 0 < n < len(problems):
        raise SystemExit(f"--dev_holdout={n} must be between 1 and {len(problems) - 1} (the train set has {len(problems)})")
    order = random.Random(f"holdout/{seed}").sample(range(len(problems)), len(problems))
    held = set(order[:n])
    return [p for i, p in enumerate(problems) if i not in held], [problems[i] for i in sorted(held)]


def write_task(out, splits, seed_name, comment, template):
    """A shipped task's files: {split}.jsonl for every split of `splits`, and its Human-Ref seed template
    file `seed_name` (a '#' comment line, then the template), each written and reported."""
    for name, rows in splits.items():
        path = os.path.join(out, f"{name}.jsonl")
        write_jsonl(path, rows)
        print(f"wrote {len(rows)} problems to {path}")
    path = os.path.join(out, seed_name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# {comment}\n{template}\n")
    print(f"wrote the seed template to {path}")


def write_jsonl(path, problems):
    """Write rows atomically (temp file + rename): a killed writer leaves the old file intact."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for p in problems:
            row = {k: getattr(p, k) for k in REQUIRED + OPTIONAL if getattr(p, k) is not None}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


class PromptStream:
    """Prompts in a fresh seeded order every epoch, as one endless stream addressed by position
    (prompts handed out so far): `take(position, n)` is a pure function of it, so the loop
    state holds the only copy of the position and resuming is exact. A take never crosses an
    epoch's end: with 10 prompts and n = 4 the steps get 4, 4, 2, then 4 of the next epoch's order."""

    def __init__(self, problems, seed):
        self.problems, self.seed = problems, seed
        self._order = {}

    def epoch_of(self, position):
        return position // len(self.problems)

    def steps_per_epoch(self, n):
        return -(-len(self.problems) // n)  # the last one short when n does not divide the set

    def take(self, position, n):
        epoch, start = divmod(position, len(self.problems))
        if epoch not in self._order:
            self._order = {epoch: random.Random(self.seed * 7919 + epoch).sample(
                range(len(self.problems)), len(self.problems))}
        return [self.problems[i] for i in self._order[epoch][start:start + n]]
