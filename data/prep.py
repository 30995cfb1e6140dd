"""Turn public sets, local files and hub datasets into our JSONL schema (see data/__init__.py).

    python data/prep.py                                   # every named set -> data/public/{name}.jsonl
    python data/prep.py aime24 math500                    # some of them
    python data/prep.py deepscaler --limit=5000 --seed=0  # the paper's 5K training subset
    python data/prep.py deepmath --split=reference        # the reference code's DeepMath train/test files
    python data/prep.py FILE.jsonl --problem=COL --answer=COL [--id=COL] [--solution=COL] [--source=NAME] [--out=PATH]
    python data/prep.py FILE.parquet ...                  # the same options; FILE.csv too
    python data/prep.py hub:OWNER/NAME [--config=NAME] [--split=train] --problem=COL --answer=COL ... [--out=PATH]
    python data/prep.py FILE.parquet --out=PATH           # a verl-style file needs no column options

Inputs. A named set (SOURCES below) and `hub:OWNER/NAME` are read from the HF hub with the
`datasets` package (online); `--config` and `--split` (default train) choose the hub table. A local
.jsonl/.parquet/.csv file is read directly (json, csv, pyarrow: offline, no cache), and a CSV cell
stays text ("007" stays "007"). COL names a column; a dotted COL (`reward_model.ground_truth`)
reaches into a nested one. Without --problem/--answer, a verl-style row is recognised (`prompt`, a
chat list whose user turn is the problem; `reward_model.ground_truth`; `extra_info.index` as id;
`data_source` as source), else columns named `problem` and `answer` (and `id`, `solution`) are used.

Output. --out=PATH.jsonl writes that file (one input only); otherwise --out is a folder (default
data/public/) that receives {name}.jsonl, name being the named set, --source, the file's stem or the
hub dataset's name. A file in data/public/ loads by that name (data/__init__.py: resolve_data).

Rows become {id, problem, answer, solution?, source}:
- answer: numbers are written plainly (42, 2.5; 42.0 -> "42"); one outer $...$ is removed; a list is
  a multi-part answer: each part loses its own $...$ and the parts are joined with ", " (verify.py
  scores \\boxed{1, 2} 1 against "1, 2"); a list of one part is that part. MATH's answer is the last
  \\boxed{...} of its solution. DeepMath-103K keeps difficulty >= 7 (the paper's hard subset);
  with --split=reference, the P²O reference code's split of it instead (reference_deepmath_split:
  answer types re-weighted per difficulty level, seeded), written as deepmath_reference_train.jsonl
  (5,000 problems) and deepmath_reference_test.jsonl (500).
- id: {name}-{id column}, or without one {name}- and 12 hex digits of the problem's SHA-256 (the
  same across runs and row orders). A row repeating an earlier row's problem and answer is dropped
  ("duplicate row": DAPO-Math-17k repeats each problem 100 times); a row whose id is taken by an
  earlier row with other text gets -{8 hex digits of its problem and answer} appended.
- source: the set's name (--source), or a verl row's `data_source`.
Every dropped row is counted with its reason, and main prints the counts. The conversion (`convert`)
is pure and tested offline on fixture rows of each set's shape (tests/fixtures/prep/).
"""

import argparse
import csv
import hashlib
import itertools
import math
import numbers
import os
import random
import re
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import DATA_DIR, Problem, json_object, write_jsonl  # noqa: E402

FILE_TYPES = (".jsonl", ".parquet", ".csv")
MAPPING_OPTIONS = ("problem", "answer", "id", "solution", "source", "split", "config")


class PrepError(ValueError):
    """An input or option that cannot be converted; main prints the message and exits."""


# ----------------------------------------------------------------------------- the named sets

# DAPO-Math-17k wraps every problem in this instruction (the user turn of its `prompt` column, as
# the hub's dataset viewer shows the rows); the problem is what lies between the two parts.
DAPO_WRAPPER = ("Solve the following math problem step by step. The last line of your response should be "
                "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n",
                "\n\nRemember to put your answer on its own line after \"Answer:\".")

# verl's RL parquet layout. The dataset cards of DAPO-Math-17k's hub copies list these columns
# (the original card lists none): data_source, prompt (list of {content, role}), ability,
# reward_model {ground_truth, style}, extra_info {index}.
VERL = dict(problem="prompt", answer="reward_model.ground_truth", id="extra_info.index", solution=None,
            unwrap=DAPO_WRAPPER)


def _difficulty_below(limit):
    """A drop_if test: the row's `difficulty` is missing, not a number, or below `limit`."""
    def below(row):
        try:
            return float(_scalar(row.get("difficulty"))) < limit
        except (TypeError, ValueError):
            return True
    return below


# name -> hub id, config, split, and columns (problem, answer, solution, id); options:
#   drop_if=(label, test): rows passing `test` are dropped as "filtered (label)";
#   boxed=True: the answer column is a full solution, the answer is its last \boxed{...};
#   unwrap=(prefix, suffix): instruction text removed from around the problem.
SOURCES = {
    "deepscaler": dict(hub="agentica-org/DeepScaleR-Preview-Dataset", split="train",
                       problem="problem", answer="answer", solution="solution"),
    "deepmath": dict(hub="zwhe99/DeepMath-103K", split="train", problem="question",
                     answer="final_answer", solution=None, drop_if=("difficulty < 7", _difficulty_below(7))),
    # MATH's train split (7,500 rows): the card's default config has problem, level, solution, type.
    "math": dict(hub="DigitalLearningGmbH/MATH-lighteval", config="default", split="train",
                 problem="problem", answer="solution", boxed=True, solution="solution"),
    "dapo17k": dict(hub="BytedTsinghua-SIA/DAPO-Math-17k", split="train", **VERL),
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


# ----------------------------------------------------------------------------- field values

_MISSING = object()


def _get(row, path, default=None):
    """The value of column `path` in `row`; a dotted path reaches into nested dicts."""
    if path in row:
        return row[path]
    value = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def _scalar(value):
    """A cell as clean text: strings stripped, numbers written plainly (42.0 -> "42", 2.5 -> "2.5");
    "" for a missing value (None, NaN); None for what is neither text nor a number (bool, dict)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        if not math.isfinite(value):
            return ""
        return str(int(value)) if value.is_integer() else repr(value)
    return None


_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def _strip_math(text):
    """`text` without one outer $$...$$, $...$ or \\(...\\); None if a `$` is left inside, as in
    "$3$ and $4$" (text and math mixed: no single answer string says the same)."""
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)")):
        if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left):len(text) - len(right)].strip()
            break
    return None if _UNESCAPED_DOLLAR.search(text) else text


def _top_level_comma(text):
    """Whether `text` has a comma outside every bracket pair (`\\,` is a LaTeX space, not a comma)."""
    depth, i = 0, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth <= 0:
            return True
        i += 1
    return False


def _answer_text(value):
    """(answer, None) or (None, why the row cannot keep it). A list is a multi-part answer."""
    if isinstance(value, (list, tuple)):
        return _multi_part(value)
    text = _scalar(value)
    if text is None:
        return None, "answer is not text or a number"
    text = _strip_math(text)
    if text is None:
        return None, "answer mixes text and $math$"
    if not text:
        return None, "missing answer"
    return text, None


def _multi_part(parts):
    """Parts each without their own $...$, joined with ", " (a tuple verify.py compares as one);
    refused where the join would be ambiguous (a part with its own top-level comma)."""
    texts = []
    for part in parts:
        if isinstance(part, (list, tuple)):
            return None, "nested multi-part answer"
        text, why = _answer_text(part)
        if why == "missing answer":
            return None, "empty part in a multi-part answer"
        if why:
            return None, why
        texts.append(text)
    if not texts:
        return None, "missing answer"
    if len(texts) > 1 and any(_top_level_comma(t) for t in texts):
        return None, "multi-part answer with a comma inside a part"
    return ", ".join(texts), None


def _problem_text(value, unwrap=None):
    """(problem, None) or (None, why). A chat list (verl's `prompt`) gives its one user turn."""
    if isinstance(value, (list, tuple)):
        turns = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if len(turns) != 1:
            return None, "several user turns in prompt" if turns else "no user turn in prompt"
        value = turns[0].get("content")
    text = _scalar(value)
    if text is None:
        return None, "problem is not text"
    if unwrap:
        prefix, suffix = unwrap
        if text.startswith(prefix):
            text = text[len(prefix):]
        if text.endswith(suffix):
            text = text[:len(text) - len(suffix)]
        text = text.strip()
    if not text:
        return None, "empty problem"
    return text, None


def _closing_brace(text, start):
    """Index of the `}` that closes the `{` at text[start], or None. `\\{` and `\\}` do not count."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def boxed_answer(solution):
    """Content of the last top-level \\boxed{...} (or \\fbox{...}) in `solution`, or None when there
    is none or one is never closed. Boxes nested in a box stay part of its content."""
    found, pos = None, 0
    while (m := _BOX.search(solution, pos)) is not None:
        end = _closing_brace(solution, m.end() - 1)
        if end is None:
            return None
        found, pos = solution[m.end():end], end + 1
    return found


# ----------------------------------------------------------------------------- conversion


def _digest(*texts):
    """Hex SHA-256 of the texts: the same on every machine and run (unlike Python's hash())."""
    return hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()


def _fields(name, spec, row):
    """(Problem fields, None) for one row, or (None, the reason it is dropped)."""
    drop = spec.get("drop_if")
    if drop and drop[1](row):
        return None, f"filtered ({drop[0]})"
    problem, why = _problem_text(_get(row, spec["problem"]), spec.get("unwrap"))
    if why:
        return None, why
    raw = _get(row, spec["answer"])
    if spec.get("boxed") and isinstance(raw, str) and raw.strip():
        raw = boxed_answer(raw)
        if raw is None:
            return None, "no \\boxed{} answer in solution"
    answer, why = _answer_text(raw)
    if why:
        return None, why
    raw_id = _scalar(_get(row, spec["id"])) if spec.get("id") else ""
    solution = _scalar(_get(row, spec["solution"])) if spec.get("solution") else ""
    source = _scalar(_get(row, spec["source"])) if spec.get("source") else ""
    return dict(id=f"{name}-{raw_id or _digest(problem)[:12]}", problem=problem, answer=answer,
                solution=solution or None, source=source or name), None


def _unique_id(pid, key, taken):
    """`pid`, or where an earlier row took it, pid-{8 hex digits of the row's (problem, answer)
    `key`}: the same in every run of the same file."""
    suffix = _digest(*key)[:8]
    more = (f"{pid}-{suffix}-{n}" for n in itertools.count(2))  # only on a hash collision
    return next(c for c in itertools.chain([pid, f"{pid}-{suffix}"], more) if c not in taken)


def convert(name, rows, spec=None):
    """Rows (dicts) of set `name` -> ([Problem], Counter of dropped rows by reason). `spec` maps
    the columns (keys as in SOURCES); by default the named set's own. A row repeating an earlier
    kept row's problem and answer is dropped as a "duplicate row", whatever its id."""
    spec = SOURCES[name] if spec is None else spec
    problems, dropped, kept, taken = [], Counter(), set(), set()
    for row in rows:
        fields, why = _fields(name, spec, row)
        key = (fields["problem"], fields["answer"]) if fields else None
        if key in kept:
            why = "duplicate row"
        if why:
            dropped[why] += 1
            continue
        pid = _unique_id(fields["id"], key, taken)
        kept.add(key)
        taken.add(pid)
        problems.append(Problem(**{**fields, "id": pid}))
    return problems, dropped


def describe_drops(dropped):
    """'missing answer: 3, empty problem: 1' (reasons in the order first met), or 'none'."""
    return ", ".join(f"{why}: {n}" for why, n in dropped.items()) or "none"


# ----------------------------------------------------------------------------- the reference's DeepMath split

# The P²O reference code's DeepMath files (zlkqz/P2O scripts/data_process/DeepMath-103K.py, the
# `very_hard_le_7/balanced` train_5000 and test_500 its script trains and validates on), rebuilt
# from the hub table in our own code: same rows, same order, same seeds.
REFERENCE, REFERENCE_SEED = "reference", 42  # --split=reference; the seed of every draw it makes
REFERENCE_COLUMNS = ("question", "final_answer", "difficulty")

_INTEGER, _DECIMAL, _RATIO = re.compile(r"-?\d+"), re.compile(r"-?\d+\.\d+"), re.compile(r"-?\d+/\d+")
_PERCENT, _WITH_UNIT = re.compile(r"-?\d+\.?\d*%"), re.compile(r"-?\d+\.?\d*\s*[a-zA-Z]+")
_LETTER = re.compile(r"[A-Za-z]|\([A-Za-z]\)")
_BRACKETED_LIST = re.compile(r"[\[(].*,.*[\])]")


def answer_type(answer):
    """The reference's answer type of a `final_answer`, by the first rule that holds: empty ("" or
    None), yes_no (yes/no/true/false, any case), multiple_choice ("B", "(b)"), numeric ("12",
    "-0.5", "3/4"), percentage ("12%", "2.5%"), numeric_with_unit ("5 cm", "2x"),
    mathematical_symbol (any of √ π ∞ ∑ ∫; LaTeX like \\pi does not count), interval_set (starts
    with ( or [, ends with ) or ], holds a comma: "(0, 1]", "(1,2)"), text_answer (over five
    words), other ("x^2+1", "\\frac{1}{2}"). Its coordinate rule comes after interval_set, which
    takes every coordinate first, so it never holds and is left out."""
    if answer is None or answer == "":
        return "empty"
    text = str(answer).strip()
    if text.lower() in ("yes", "no", "true", "false"):
        return "yes_no"
    rules = ((_LETTER, "multiple_choice"), (_INTEGER, "numeric"), (_DECIMAL, "numeric"), (_RATIO, "numeric"),
             (_PERCENT, "percentage"), (_WITH_UNIT, "numeric_with_unit"))
    for pattern, kind in rules:
        if pattern.fullmatch(text):
            return kind
    if any(c in text for c in "√π∞∑∫"):
        return "mathematical_symbol"
    if _BRACKETED_LIST.fullmatch(text):
        return "interval_set"
    return "text_answer" if len(text.split()) > 5 else "other"


def _level_quota(type_counts, yes_no_share, power):
    """{answer type: rows to keep} for one difficulty level, types in `type_counts`' order:
    the non-yes/no types share int(n (1 - yes_no_share)) rows (n: the level's rows), each in
    proportion to count^power, rounded down; yes/no rows are capped at yes_no_share of the total,
    int(those quotas' sum x share / (1 - share)). A quota may exceed its type's rows (a rare type
    gets a large share): all of them are kept, and the yes/no cap still counts the quota.
    E.g. {numeric: 64, other: 16, yes_no: 20}, share 0.05, power 0.5: weights 8 and 4, 95 rows
    -> {numeric: 63, other: 31, yes_no: 4}."""
    total = sum(type_counts.values())
    quota = {}
    weights = {kind: n ** power for kind, n in type_counts.items() if kind != "yes_no"}
    if weights:
        mass, target = sum(weights.values()), int(total * (1 - yes_no_share))
        quota = {kind: int(w / mass * target) for kind, w in weights.items()}
    if "yes_no" in type_counts:
        quota["yes_no"] = min(type_counts["yes_no"], int(sum(quota.values()) * yes_no_share / (1 - yes_no_share)))
    return quota


def balance_answer_types(rows, yes_no_share=0.05, power=0.5, seed=REFERENCE_SEED):
    """The reference's balance_dataset_by_answer_type: the rows to keep (a new list). Rows with an
    empty final_answer are dropped; then, level by level in increasing `difficulty`, every answer
    type (answer_type) is sampled down to its _level_quota with one random.Random(seed) (types in
    the order they first appear in the level, yes/no last; a type within its quota is kept whole,
    in row order); the kept rows are shuffled; and where yes/no answers still exceed yes_no_share
    of them, the yes/no rows are sampled down to int(kept x share) and everything shuffled again."""
    rng, levels = random.Random(seed), {}
    for i, row in enumerate(rows):
        kind = answer_type(row.get("final_answer", ""))
        if kind != "empty":
            levels.setdefault(row.get("difficulty", 0), {}).setdefault(kind, []).append(i)
    kept = []
    for level in sorted(levels):
        by_type = levels[level]
        quota = _level_quota({kind: len(ids) for kind, ids in by_type.items()}, yes_no_share, power)
        for kind, k in quota.items():
            ids = by_type[kind]
            kept += ids if k >= len(ids) else rng.sample(ids, k)
    rng.shuffle(kept)
    yes_no = [p for p, i in enumerate(kept) if answer_type(rows[i].get("final_answer", "")) == "yes_no"]
    if kept and len(yes_no) / len(kept) > yes_no_share:
        cap = int(len(kept) * yes_no_share)
        is_yes_no = set(yes_no)
        others = [p for p in range(len(kept)) if p not in is_yes_no]
        order = others + (rng.sample(yes_no, cap) if len(yes_no) > cap else yes_no)
        rng.shuffle(order)
        kept = [kept[p] for p in order]
    return [rows[i] for i in kept]


def seeded_split(rows, test_size, seed=REFERENCE_SEED):
    """(rest, test) as the datasets library's train_test_split(test_size=n, seed=seed) cuts a
    table: numpy's default_rng(seed).permutation of the rows, the first n to test and the rest to
    train, each in permutation order. At most test_size rows: ([], all of them), as the reference
    keeps them when its table is that small."""
    if len(rows) <= test_size:
        return [], list(rows)
    import numpy as np  # lazy: only this split needs numpy

    order = np.random.default_rng(seed).permutation(len(rows)).tolist()
    return [rows[i] for i in order[test_size:]], [rows[i] for i in order[:test_size]]


def reference_deepmath_split(rows, test_size=500, train_size=5000, seed=REFERENCE_SEED):
    """(train, test) rows of the reference's DeepMath run from DeepMath-103K's train table in hub
    order: the rows of difficulty >= 7, balanced (balance_answer_types), then test = 500 of them
    (seeded_split) and train = 5,000 of the rest (seeded_split again, keeping its test side); the
    same seed every time. Each row is cut to REFERENCE_COLUMNS, so the table's long solutions are
    not held."""
    too_easy = _difficulty_below(7)
    hard = [{k: row.get(k) for k in REFERENCE_COLUMNS} for row in rows if not too_easy(row)]
    rest, test = seeded_split(balance_answer_types(hard, seed=seed), test_size, seed)
    _, train = seeded_split(rest, train_size, seed)
    return train, test


# ----------------------------------------------------------------------------- reading inputs


def _jsonl_rows(path):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json_object(line)
            except ValueError as e:
                raise PrepError(f"{path}:{lineno}: {e}") from None
            yield row


def _csv_rows(path):
    with open(path, encoding="utf-8-sig", newline="") as f:
        yield from csv.DictReader(f)


def _parquet_rows(path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepError("reading parquet needs pyarrow: pip install datasets") from None
    for batch in pq.ParquetFile(path).iter_batches(batch_size=10_000):
        yield from batch.to_pylist()


def read_file(path):
    """The rows (dicts) of a local .jsonl, .parquet or .csv file, read lazily."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_TYPES:
        raise PrepError(f"{path}: unsupported file type (use {', '.join(FILE_TYPES)})")
    if not os.path.isfile(path):
        raise PrepError(f"{path}: no such file")
    return {".jsonl": _jsonl_rows, ".csv": _csv_rows, ".parquet": _parquet_rows}[ext](path)


def hub_rows(repo, config, split):
    """The rows of one split of a hub dataset (needs the `datasets` package and the network)."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise PrepError("hub datasets need the `datasets` package: pip install datasets") from None
    return load_dataset(repo, name=config, split=split)


def _is_verl(row):
    return "prompt" in row and _get(row, "reward_model.ground_truth", _MISSING) is not _MISSING


def mapping_spec(first, args, label):
    """The column spec for a file or hub input, from the options or its first row's columns."""
    if args.problem or args.answer:
        if not (args.problem and args.answer):
            raise PrepError("--problem and --answer go together")
        spec = dict(problem=args.problem, answer=args.answer)
    elif _is_verl(first):
        spec = dict(VERL, source="data_source")
    elif "problem" in first and "answer" in first:
        spec = dict(problem="problem", answer="answer", id="id" if "id" in first else None,
                    solution="solution" if "solution" in first else None)
    else:
        raise PrepError(f"{label}: give --problem=COL --answer=COL (columns: {', '.join(map(str, first))})")
    spec.update({k: getattr(args, k) for k in ("id", "solution") if getattr(args, k)})
    if args.source:
        spec.pop("source", None)
    for option in ("problem", "answer", "id", "solution"):
        column = getattr(args, option)
        if column and _get(first, column, _MISSING) is _MISSING:
            raise PrepError(f"{label}: no column {column!r} for --{option} (columns: {', '.join(map(str, first))})")
    return spec


def open_input(item, args):
    """(name, spec, rows) for one input: a named set, `hub:OWNER/NAME`, or a local file."""
    if item in SOURCES:
        spec = SOURCES[item]
        return item, spec, hub_rows(spec["hub"], spec.get("config"), spec["split"])
    if item.startswith("hub:"):
        repo = item[len("hub:"):].strip("/")
        name = args.source or repo.rsplit("/", 1)[-1]
        rows = hub_rows(repo, args.config, args.split or "train")
    elif item.lower().endswith(FILE_TYPES):
        name = args.source or os.path.splitext(os.path.basename(item))[0]
        rows = read_file(item)
    else:
        raise PrepError(f"unknown input {item!r}: a named set ({', '.join(SOURCES)}), "
                        f"a {'/'.join(FILE_TYPES)} file, or hub:OWNER/NAME")
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        raise PrepError(f"{item}: no rows")
    return name, mapping_spec(first, args, item), itertools.chain([first], rows)


# ----------------------------------------------------------------------------- command line


def _parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", help=f"named sets ({', '.join(SOURCES)}), "
                    f"{'/'.join(FILE_TYPES)} files, or hub:OWNER/NAME (default: every named set)")
    for option in ("problem", "answer", "id", "solution"):
        ap.add_argument(f"--{option}", metavar="COL", help=f"column of the {option} (files and hub: inputs)")
    ap.add_argument("--source", metavar="NAME", help="set name: id prefix, source field, output file name")
    ap.add_argument("--split", help="hub: split (default train); deepmath: `reference` writes the reference code's "
                    "split (5,000 train + 500 test problems, seeded) instead of the whole hard subset")
    ap.add_argument("--config", help="hub: config (subset) name")
    ap.add_argument("--limit", type=int, default=0, help="keep a seeded random subset of this size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="output .jsonl file (one input), or folder (default data/public)")
    return ap


def _check_args(args, items):
    """Refuse option combinations that would be silently ignored."""
    if args.split == REFERENCE:
        if items != ["deepmath"]:
            raise PrepError(f"--split={REFERENCE} is the reference code's DeepMath split: give the one input deepmath")
        if args.limit or (args.out and args.out.endswith(".jsonl")):
            raise PrepError(f"--split={REFERENCE} has its own sizes and writes two files: "
                            "no --limit, and --out is a folder")
        args = argparse.Namespace(**{**vars(args), "split": None})  # the other checks as without it
    named = [i for i in items if i in SOURCES]
    given = [f"--{o}" for o in MAPPING_OPTIONS if getattr(args, o)]
    if named and given:
        raise PrepError(f"{', '.join(given)} apply to files and hub: inputs; {named[0]} has its own columns")
    if args.out and args.out.endswith(".jsonl") and len(items) > 1:
        raise PrepError("--out=FILE.jsonl takes one input; give a folder for several")


def _out_path(out, name):
    if out and out.endswith(".jsonl"):
        return out
    return os.path.join(out or os.path.join(DATA_DIR, "public"), f"{name}.jsonl")


def _write(label, problems, dropped, path):
    """Write the problems and print what was written and dropped. False if nothing was kept."""
    n = sum(dropped.values())
    summary = f"dropped {n} row{'s' * (n != 1)} ({describe_drops(dropped)})" if n else "dropped no rows"
    if not problems:
        print(f"{label}: no rows kept, nothing written; {summary}")
        return False
    write_jsonl(path, problems)
    print(f"{label}: wrote {len(problems)} problems to {path}; {summary}")
    return True


def prepare_reference_split(args):
    """deepmath --split=reference: the reference's train and test files (reference_deepmath_split),
    converted as the named set is, as {out}/deepmath_reference_train.jsonl and _test.jsonl."""
    spec = SOURCES["deepmath"]
    rows = hub_rows(spec["hub"], spec.get("config"), spec["split"])
    if hasattr(rows, "select_columns"):  # a hub table: leave its long solution columns unread
        rows = rows.select_columns(list(REFERENCE_COLUMNS))
    train, test = reference_deepmath_split(rows)
    written = [_write(f"deepmath --split={REFERENCE} ({part})", *convert("deepmath", part_rows),
                      _out_path(args.out, f"deepmath_{REFERENCE}_{part}"))
               for part, part_rows in (("train", train), ("test", test))]
    return all(written)


def prepare(item, args):
    """Convert and write one input; print what was written and dropped. False if nothing was kept."""
    if args.split == REFERENCE:
        return prepare_reference_split(args)
    name, spec, rows = open_input(item, args)
    path = _out_path(args.out, name)
    if os.path.abspath(path) == os.path.abspath(item):
        raise PrepError(f"{item}: the output would overwrite the input; give another --out or --source")
    problems, dropped = convert(name, rows, spec)
    if args.limit and len(problems) > args.limit:
        problems = random.Random(args.seed).sample(problems, args.limit)
    return _write(item, problems, dropped, path)


def main(argv=None):
    args = _parser().parse_args(argv)
    items = args.inputs or list(SOURCES)
    try:
        _check_args(args, items)
        kept = [prepare(item, args) for item in items]
    except PrepError as e:
        sys.exit(f"data/prep.py: {e}")
    if not all(kept):
        sys.exit(1)


if __name__ == "__main__":
    main()
