"""GEPA for hard prompts: evolve short reasoning templates by reflective mutation and Pareto
selection (docs/METHOD.md §5). The policy answers; a reflector (by default a frozen copy of the starting
policy, "Self-Ref") reads the policy's failures and proposes a better template.

The search is pure logic around two callables, so it can be read and tested alone:

    answer_fn([(template, item), ...], kind) -> [response text, ...]   # greedy, current policy;
                                            # kind: "gepa_dev" | "gepa_minibatch" (accounting)
    reflect_fn([meta_prompt, ...])        -> [(text, finished), ...]  # sampled, reflector; an entry
                                            # may be None: a failed call, rejected as call_failed

    result = run_gepa(hard, answer_fn, reflect_fn, train.Config(gepa_budget=400), random.Random(0))
    result.pool        -> ["", "Multiply before adding. ...", ...]    candidate 0 is the empty seed
    result.scores      -> [[0, 1, 0, ...], ...]                       S[candidate][dev item] in {0, 1}
    result.assignment  -> {"builtin-two_step-train-0003": [t1, t1, t2, t1, t2, t1], ...}

`cfg` everywhere is train.Config (duck-typed, never imported here); only its GEPA and guard
fields are read: gepa_budget, gepa_auto, gepa_dev_max, gepa_parents (W), gepa_minibatch (b),
gepa_max_iterations, max_template_chars, template_max_growth, guard_copy_words,
reflect_answer_chars, and for the assignment group_size (K), same_template_per_group, bare_rollout.

Human-Ref: `run_gepa(..., seeds=[...])` starts the pool with given templates beside the empty
one (train.py reads them from --seed_templates); they are scored on dev, selected, covered and
assigned by the same code as evolved candidates, so a round can pick a seed, an evolved child or
nothing.

One iteration: per-item Pareto fronts over the dev scores -> prune dominated candidates ->
sample parents with probability proportional to their number of fronts -> for each parent:
answer a minibatch of b train items under it (b metric calls; all correct: skip) -> reflect ->
guards (reject without spending metric calls) -> answer the same minibatch under the child
(b calls) -> accept_child: its minibatch score is STRICTLY higher -> score it on all of dev
(|dev| calls) and add it to the pool with its parent. Merge/crossover is a no-op for
single-text candidates and is left out.

The budget is a hard cap: metric_calls <= gepa_budget always. One proposal costs at most
2b + |dev| calls, and a proposal starts only while that many calls remain unreserved, so an
accepted child can always be scored on dev; an iteration takes parents one by one while the next
reservation fits (so it may have fewer than W), and the round ends when not even one fits. The
dev set is capped so that the seeds' dev evaluations plus one full proposal fit:
|dev| = min(gepa_dev_max, half of the hard set (at least 1), (budget - 2b) // (2 + seeds)); a
budget too small for that raises ValueError rather than silently assigning no templates. With a
preset (gepa_auto: the reference code's light ... heavy_16) the budget is computed from |dev|
instead (auto_budget).
"""

import math
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

from verify import check

DELIM_OPEN, DELIM_CLOSE = "<template>", "</template>"


@dataclass
class GepaResult:
    pool: list  # templates; 0 is the empty seed
    parents: list  # parent index of each template (-1 for the seed): the lineage
    scores: list  # S[candidate][dev item] in {0, 1}
    dev_ids: list
    train_ids: list
    assignment: dict  # hard prompt id -> K templates
    chosen: list  # set-cover indices into pool
    log: list = field(default_factory=list)  # one entry per proposal: parent, outcome, reason
    metric_calls: int = 0  # never above budget
    budget: int = 0  # the round's budget: cfg.gepa_budget, or the preset's for its dev set
    reflection_calls: int = 0
    rejections: Counter = field(default_factory=Counter)

    def to_json(self):
        return {"pool": self.pool, "parents": self.parents, "scores": self.scores,
                "dev_ids": self.dev_ids, "train_ids": self.train_ids, "chosen": self.chosen,
                "assignment": self.assignment, "log": self.log, "metric_calls": self.metric_calls,
                "budget": self.budget, "reflection_calls": self.reflection_calls,
                "rejections": dict(self.rejections),
                "best_dev_score": self.best_dev_score()}

    def best_dev_score(self):
        return max((sum(r) / max(1, len(r)) for r in self.scores), default=0.0)

    def summary(self):
        """The round in one line of numbers (train.py's GEPA summary and LoopState.gepa_history)."""
        return {"pool": len(self.pool), "accepted": sum(e["outcome"] == "accepted" for e in self.log),
                "proposals": sum(e["outcome"] != "skipped_all_correct" for e in self.log),
                "rejections": dict(self.rejections), "best_dev_score": self.best_dev_score(),
                "chosen": len(self.chosen), "assigned": len(self.assignment), "metric_calls": self.metric_calls,
                "budget": self.budget}


# ----------------------------------------------------------------------------- selection


# The reference code's budget presets: candidates per round (its `trainer.gepa.auto`).
AUTO_CANDIDATES = {"light": 6, "medium": 12, "heavy": 18, "heavy_2": 36, "heavy_3": 54, "heavy_4": 72, "heavy_16": 288}


def auto_budget(preset, dev_size, minibatch=35, full_eval_every=5):
    """Metric calls of a preset for a dev set of dev_size, by the rule the reference code takes
    from DSPy's GEPA: C candidates give N = max(4 log2 C, 1.5 C) trials of `minibatch` calls,
    plus 5 calls per candidate, plus one dev evaluation at the start and every `full_eval_every`
    trials: V + 5C + N M + ((N + 1) // m + 1 + [N < m]) V. E.g. heavy_4 (C 72 -> N 108),
    V 300: 300 + 360 + 3780 + 22 x 300 = 11040."""
    c = AUTO_CANDIDATES[preset]
    trials = int(max(4 * math.log2(max(c, 1)), 1.5 * c))
    fulls = (trials + 1) // full_eval_every + 1 + (1 if trials < full_eval_every else 0)
    return dev_size + 5 * c + trials * minibatch + fulls * dev_size


def dev_cap(cfg, n_seeds=0):
    """Most dev items the budget allows: min(gepa_dev_max, (budget - 2b) // (2 + n_seeds)), so
    that the dev evaluations of the empty seed and of n_seeds given templates ((1 + n_seeds)
    |dev|) plus one full proposal (2b + |dev|) fit in it. E.g. budget 200, b 3 -> 97. With a
    preset (gepa_auto) the budget follows the dev set instead: gepa_dev_max."""
    if cfg.gepa_auto:
        return cfg.gepa_dev_max
    b = cfg.gepa_minibatch
    cap = min(cfg.gepa_dev_max, (cfg.gepa_budget - 2 * b) // (2 + n_seeds))
    if cap < 1:
        raise ValueError(f"GEPA budget {cfg.gepa_budget} is too small for minibatch b={b} and {n_seeds} seed "
                         f"templates: their dev evaluations plus one proposal need at least "
                         f"2b + 2 + {n_seeds} = {2 * b + 2 + n_seeds} metric calls")
    return cap


def round_budget(cfg, dev_size, n_seeds):
    """The round's metric-call budget: gepa_budget, or the gepa_auto preset's for dev_size items.
    Either must cover the dev evaluations of the empty template and the n_seeds seeds."""
    budget = auto_budget(cfg.gepa_auto, dev_size) if cfg.gepa_auto else cfg.gepa_budget
    if (1 + n_seeds) * dev_size > budget:
        raise ValueError(f"GEPA budget {budget} cannot score the empty template and {n_seeds} seed templates "
                         f"on {dev_size} dev items")
    return budget


def read_seed_templates(path, max_chars):
    """Human-written templates (Human-Ref), one per line; blank lines and lines starting with '#'
    are skipped. A template longer than max_chars is an error naming its line."""
    templates = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            if len(text) > max_chars:
                raise ValueError(f"{path}:{n}: template of {len(text)} characters; the limit is "
                                 f"--max_template_chars={max_chars}")
            if text not in templates:
                templates.append(text)
    if not templates:
        raise ValueError(f"{path}: no template in it (one per line; '#' starts a comment)")
    return templates


def split_dev_train(items, dev_max, rng):
    """Shuffle; dev gets min(dev_max, half of the items) (at least 1), train the rest."""
    items = list(items)
    rng.shuffle(items)
    n_dev = max(1, min(dev_max, len(items) // 2))
    return items[:n_dev], items[n_dev:]


def accept_child(parent_minibatch_score, child_minibatch_score):
    """GEPA's acceptance test: the child must solve STRICTLY more of the same minibatch than its
    parent did (a tie is rejected: it would add a candidate with no evidence of being better)."""
    return child_minibatch_score > parent_minibatch_score


def pareto_fronts(scores):
    """For each dev item, the set of candidates with the best score on it (ties kept).
    Items that no candidate solves (best score 0) carry no preference and get no front."""
    fronts = []
    for j in range(len(scores[0]) if scores else 0):
        best = max(row[j] for row in scores)
        if best > 0:
            fronts.append({c for c, row in enumerate(scores) if row[j] == best})
    return fronts


def prune_dominated(fronts, scores):
    """Union of the fronts minus every candidate whose fronts all hold another survivor,
    checked weakest first (fewest fronts, then lowest total score, then newest)."""
    count = Counter(c for f in fronts for c in f)
    survivors = set(count)
    for c in sorted(survivors, key=lambda c: (count[c], sum(scores[c]), -c)):
        if all(len((f & survivors) - {c}) > 0 for f in fronts if c in f):
            survivors.discard(c)
    return survivors


def select_parents(scores, n, rng):
    """n parents (with replacement), each drawn with probability ∝ its number of fronts
    after pruning. With no front at all (nothing solved yet), draw uniformly from the pool."""
    fronts = pareto_fronts(scores)
    survivors = prune_dominated(fronts, scores)
    if not survivors:
        return [rng.randrange(len(scores)) for _ in range(n)]
    cands = sorted(survivors)
    weights = [sum(c in f for f in fronts) for c in cands]
    return rng.choices(cands, weights=weights, k=n)


def greedy_set_cover(scores):
    """Candidate indices: repeatedly the one solving the most not-yet-covered dev items
    (ties: lowest index), until no candidate adds one."""
    covered, chosen = set(), []
    while True:
        gains = [(len({j for j, s in enumerate(row) if s > 0} - covered), -c) for c, row in enumerate(scores)]
        gain, neg_c = max(gains, default=(0, 0))
        if gain == 0:
            return chosen
        chosen.append(-neg_c)
        covered |= {j for j, s in enumerate(scores[-neg_c]) if s > 0}


def assign_templates(pool, scores, chosen, dev_ids, train_ids, k, rng, same_for_group=False, bare=False):
    """K templates per hard prompt, drawn with replacement ∝ mean dev score. A dev item that
    some chosen template solves draws from those; any other item from the whole chosen set.
    bare: the first of the K is '' (no template) and K - 1 are drawn."""
    if not chosen:
        return {}
    mean = {c: sum(scores[c]) / len(scores[c]) for c in chosen}
    n = k - 1 if bare else k
    out = {}
    for item_id in list(dev_ids) + list(train_ids):
        cands = chosen
        if item_id in dev_ids:
            j = dev_ids.index(item_id)
            solving = [c for c in chosen if scores[c][j] > 0]
            cands = solving or chosen
        draws = rng.choices(cands, weights=[mean[c] for c in cands], k=1 if same_for_group else n)
        out[item_id] = [""] * (k - n) + [pool[c] for c in (draws * n if same_for_group else draws)]
    return out


# ----------------------------------------------------------------------------- reflection


META_PROMPT = """You are improving an instruction that is shown to a student before a math problem.

Current instruction:
{delim_open}{template}{delim_close}

Here is how the student did with the current instruction:
{records}

Write a better instruction: short, general (it must help on other problems of this kind, so do
not mention these numbers or answers), and do not change how the final answer is written.
Reply with the new instruction only, between {delim_open} and {delim_close}."""


def reflection_record(item, response, answer_chars):
    v = check(response, item.answer)
    verdict = "correct" if v.reward > 0 else "wrong"
    extracted = v.extracted[:answer_chars] if v.extracted is not None else "(none: no \\boxed{} answer)"
    return (f"Problem: {item.problem}\nStudent's answer: {response[:answer_chars]}\n"
            f"Feedback: the answer is {verdict}; the extracted answer was {extracted}; "
            f"the correct answer is {item.answer}.")


def meta_prompt(template, records):
    return META_PROMPT.format(template=template or "(empty: no instruction)", records="\n\n".join(records),
                              delim_open=DELIM_OPEN, delim_close=DELIM_CLOSE)


def _normal(text):
    return " ".join(text.lower().split())


# ---- numbers: a leak is the answer's VALUE in the template, whatever its spelling

_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"  # 19, 19.0, 1,000, .5
_SMALL = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
          "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
_WORD_VALUE = {**{w: i for i, w in enumerate(_SMALL)}, **{w: 20 + 10 * i for i, w in enumerate(_TENS)}}
# One alternation, so that re.finditer takes each number whole, leftmost and longest first: the
# digits of \frac{1}{2} or 1/2 are not read again alone, and the lookbehinds keep a match from
# starting inside a longer number (no 19 in 190, no 14 in 3.14). Signs are not read: values are
# unsigned, which can only over-reject (-3 and 3 read alike) and catches "x = -3" for answer -3.
_NUMBER = re.compile(
    rf"\\[dt]?frac\s*\{{\s*(?P<fn>{_UNSIGNED})\s*\}}\s*\{{\s*(?P<fd>{_UNSIGNED})\s*\}}"
    rf"|(?<![\d./])(?P<sn>\d+)/(?P<sd>\d+)(?![\d/]|\.\d)"
    rf"|(?<![\d.])(?P<num>{_UNSIGNED})"
    rf"|\b(?P<tens>{'|'.join(_TENS)})-(?P<unit>{'|'.join(_SMALL[1:10])})\b"
    rf"|\b(?P<word>{'|'.join(_SMALL + _TENS)})\b", re.I)


def _ratio(numerator, denominator):
    """Fraction('3')/Fraction('4') from digit strings; None for a zero denominator."""
    den = Fraction(denominator.replace(",", ""))
    return Fraction(numerator.replace(",", "")) / den if den else None


def _value(match):
    g = match.groupdict()
    if g["fn"] is not None:
        return _ratio(g["fn"], g["fd"])
    if g["sn"] is not None:
        return _ratio(g["sn"], g["sd"])
    if g["num"] is not None:
        return Fraction(g["num"].replace(",", ""))  # Fraction parses "19.0" exactly; no eval
    if g["tens"] is not None:
        return Fraction(_WORD_VALUE[g["tens"].lower()] + _WORD_VALUE[g["unit"].lower()])
    return Fraction(_WORD_VALUE[g["word"].lower()])


def numbers_in(text):
    """Exact unsigned values of the number-like tokens in text, e.g.
    "Add 1,000 to 19.0, halve (\\frac{1}{2}) seven times; 3.14 and 190" -> {1000, 19, 1/2, 7, 157/50, 190}."""
    return {v for m in _NUMBER.finditer(text) if (v := _value(m)) is not None}


def number_value(answer):
    """The unsigned value of an answer that is exactly one number ('19', '-3', '1,000', '0.5',
    '\\frac{1}{2}', '$7$'), else None ('x^2+1', '\\sqrt{2}', '3, 4')."""
    m = _NUMBER.fullmatch(answer.strip().strip("$").strip().lstrip("+-−").strip())
    return _value(m) if m else None


def leaks_answer(template, answer):
    """True iff the template states the answer: a numeric answer by value (any token of
    numbers_in equal to it); any other by its text, ignoring whitespace and case, not as part of
    a longer word or number ("x^2+1" is in "use x^2 + 1." but not in "x^2+10")."""
    value = number_value(answer)
    if value is not None:
        return value in numbers_in(template)
    chars = "".join(answer.split())
    if not chars:
        return False
    pattern = r"\s*".join(map(re.escape, chars))
    if re.match(r"\w", chars[0]):
        pattern = r"(?<!\w)" + pattern
    if re.match(r"\w", chars[-1]):
        pattern += r"(?!\w|\.\d)"  # a sentence's full stop may follow, a decimal part may not
    return re.search(pattern, template, re.I) is not None


# ---- problem copies

_EDGE = string.punctuation + "“”‘’…"


def _words(text):
    """'What is 7 + 4 × 3?' -> ['what', 'is', '7', '+', '4', '×', '3']: lower-cased, punctuation
    stripped at word edges (a word that is only punctuation, like '+', stays as it is)."""
    return [w.strip(_EDGE) or w for w in text.lower().split()]


def copies_problem(template, problem, copy_words):
    """True iff the template holds n = min(copy_words, words in the problem) consecutive words of
    the problem, whole words compared: a problem shorter than copy_words is a copy only whole."""
    pw, tw = _words(problem), _words(template)
    n = min(copy_words, len(pw))
    if n == 0:
        return False
    spans = {tuple(pw[i:i + n]) for i in range(len(pw) - n + 1)}
    return any(tuple(tw[i:i + n]) in spans for i in range(len(tw) - n + 1))


_FORMAT_CONFLICT = re.compile(r"(do not|don't|never|without|instead of|avoid)\W+(\w+\W+){0,3}\\?boxed", re.I)
_SPECIAL = re.compile(r"<\|[^|>]*\|>|<s>|</s>|<bos>|<eos>|\[INST\]")


def guard(text, finished, parent, pool, minibatch, cfg):
    """The template inside the reflector's output, or (None, reason) for a rejection."""
    if not finished:
        return None, "truncated"
    start = text.find(DELIM_OPEN)
    end = text.find(DELIM_CLOSE, start + len(DELIM_OPEN)) if start >= 0 else -1
    if start < 0 or end < 0:
        return None, "no_delimiter"
    tpl = text[start + len(DELIM_OPEN):end].strip()
    if not tpl:
        return None, "empty"
    if len(tpl) > cfg.max_template_chars or (parent and len(tpl) > cfg.template_max_growth * len(parent)):
        return None, "too_long"
    words = tpl.lower().split()
    grams = Counter(tuple(words[i:i + 3]) for i in range(len(words) - 2))
    if grams and max(grams.values()) >= 3 or (len(words) >= 8 and len(set(words)) < 0.3 * len(words)):
        return None, "repetition"
    if _normal(tpl) == _normal(parent) or any(_normal(tpl) == _normal(p) for p in pool):
        return None, "duplicate"
    if _SPECIAL.search(tpl):
        return None, "special_tokens"
    if _FORMAT_CONFLICT.search(tpl):
        return None, "format_conflict"
    for item in minibatch:
        if leaks_answer(tpl, item.answer):
            return None, "answer_leak"
        if copies_problem(tpl, item.problem, cfg.guard_copy_words):
            return None, "problem_copy"
    return tpl, "ok"


# ----------------------------------------------------------------------------- the search


def next_minibatches(train, order, cursor, n, b, rng):
    """n minibatches of b train items, read along `order` from `cursor` and reshuffled (in place)
    whenever fewer than b remain -> (minibatches, new cursor)."""
    batches = []
    for _ in range(n):
        if cursor + b > len(order):
            rng.shuffle(order)
            cursor = 0
        batches.append([train[i] for i in order[cursor:cursor + b]])
        cursor += b
    return batches, cursor


def run_gepa(hard, answer_fn, reflect_fn, cfg, rng, progress=None, reward_fn=None, seeds=()):
    """Evolve templates for the hard items; return the pool, scores, lineage and assignment
    (cfg.group_size templates per hard item; one for the whole group with cfg.same_template_per_group).
    reward_fn(response, item) -> 0/1 scores an answer (default: verify.check against item.answer).
    seeds: given templates (Human-Ref) that start the pool beside the empty one; each is scored
    on the dev items like any candidate, and the metric calls count."""
    reward_fn = reward_fn or (lambda response, item: check(response, item.answer).reward)
    b = cfg.gepa_minibatch
    seeds = [t for t in seeds if t]
    dev, train = split_dev_train(hard, dev_cap(cfg, len(seeds)), rng)
    train = train or dev  # a tiny hard set: reflect on dev items too (then they are not held out)
    budget = round_budget(cfg, len(dev), len(seeds))
    res = GepaResult(pool=["", *seeds], parents=[-1] * (1 + len(seeds)), scores=[], dev_ids=[d.id for d in dev],
                     train_ids=[t.id for t in train if t.id not in {d.id for d in dev}],
                     assignment={}, chosen=[], budget=budget)

    def score(template, items, kind):
        responses = answer_fn([(template, it) for it in items], kind)
        res.metric_calls += len(items)
        return [reward_fn(r, it) for r, it in zip(responses, items)], responses

    for template in res.pool:
        res.scores.append([int(s) for s in score(template, dev, "gepa_dev")[0]])
    order, cursor = list(range(len(train))), len(train)
    reservation = 2 * b + len(dev)  # the most one proposal can spend: parent, child, child on dev
    for iteration in range(cfg.gepa_max_iterations):
        # Parents one by one while the next reservation fits the unreserved budget; a parent
        # never spends more than its reservation, so metric_calls <= gepa_budget holds throughout.
        n_parents = min(cfg.gepa_parents, (budget - res.metric_calls) // reservation)
        if n_parents < 1:
            break
        parents = select_parents(res.scores, n_parents, rng)
        # ---- answer each parent's minibatch under the parent
        batches, cursor = next_minibatches(train, order, cursor, len(parents), b, rng)
        parent_scores, prompts, live = [], [], []
        for p, mb in zip(parents, batches):
            s, responses = score(res.pool[p], mb, "gepa_minibatch")
            parent_scores.append(sum(s))
            if sum(s) == len(mb):
                res.log.append({"iteration": iteration, "parent": p, "outcome": "skipped_all_correct"})
                continue
            records = [reflection_record(it, r, cfg.reflect_answer_chars) for it, r in zip(mb, responses)]
            prompts.append(meta_prompt(res.pool[p], records))
            live.append(len(parent_scores) - 1)
        # ---- reflect (one batched call), guard, test on the same minibatch
        outputs = reflect_fn(prompts) if prompts else []
        res.reflection_calls += len(prompts)
        for idx, output in zip(live, outputs):
            p, mb = parents[idx], batches[idx]
            text, finished = output or ("", False)  # None: the reflection call failed (a server reflector)
            child, reason = guard(text, finished, res.pool[p], res.pool, mb, cfg) if output else (None, "call_failed")
            entry = {"iteration": iteration, "parent": p, "proposal": text[:2000]}
            if child is None:
                res.rejections[reason] += 1
                res.log.append({**entry, "outcome": "rejected", "reason": reason})
                continue
            child_score = sum(score(child, mb, "gepa_minibatch")[0])
            if not accept_child(parent_scores[idx], child_score):
                res.rejections["not_better"] += 1
                res.log.append({**entry, "outcome": "rejected", "reason": "not_better", "template": child,
                                "minibatch": [parent_scores[idx], child_score]})
                continue
            res.pool.append(child)
            res.parents.append(p)
            res.scores.append([int(s) for s in score(child, dev, "gepa_dev")[0]])
            res.log.append({**entry, "outcome": "accepted", "template": child, "index": len(res.pool) - 1,
                            "minibatch": [parent_scores[idx], child_score],
                            "dev_score": sum(res.scores[-1]) / len(dev)})
        if progress:
            progress(res)
    res.chosen = greedy_set_cover(res.scores)
    res.assignment = assign_templates(res.pool, res.scores, res.chosen, res.dev_ids,
                                      res.train_ids, cfg.group_size, rng, cfg.same_template_per_group,
                                      bare=cfg.bare_rollout)
    return res
