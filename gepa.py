"""GEPA for hard prompts: evolve short reasoning templates by reflective mutation and Pareto
selection (SPEC §4). The policy answers; a reflector (by default a frozen copy of the starting
policy, "Self-Ref") reads the policy's failures and proposes a better template.

The search is pure logic around two callables, so it can be read and tested alone:

    answer_fn([(template, item), ...], kind) -> [response text, ...]   # greedy, current policy;
                                            # kind: "gepa_dev" | "gepa_minibatch" (accounting)
    reflect_fn([meta_prompt, ...])        -> [(text, finished), ...]  # sampled, reflector

    result = run_gepa(hard, answer_fn, reflect_fn, GepaConfig(budget=400), random.Random(0))
    result.pool        -> ["", "Multiply before adding. ...", ...]    candidate 0 is the empty seed
    result.scores      -> [[0, 1, 0, ...], ...]                       S[candidate][dev item] in {0, 1}
    result.assignment  -> {"builtin-two_step-train-0003": [t1, t1, t2, t1, t2, t1], ...}

One iteration: per-item Pareto fronts over the dev scores -> prune dominated candidates ->
sample W parents with probability proportional to their number of fronts -> for each parent:
answer a minibatch of b train items under it (b metric calls; all correct: skip) -> reflect ->
guards (reject without spending metric calls) -> answer the same minibatch under the child
(b calls) -> accept iff its minibatch score is STRICTLY higher -> score it on all of dev
(|dev| calls) and add it to the pool with its parent. The budget (metric calls) is checked
between iterations. Merge/crossover is a no-op for single-text candidates and is left out.
"""

import random
import re
from collections import Counter
from dataclasses import dataclass, field

from verify import check

DELIM_OPEN, DELIM_CLOSE = "<template>", "</template>"


@dataclass
class GepaConfig:
    budget: int = 400  # metric calls (one = one (template, problem) answer scored)
    dev_max: int = 300  # at most this many hard prompts are dev items (paper 300)
    parents_per_iter: int = 16  # W (paper 16)
    minibatch: int = 3  # b train items per reflection (paper 3)
    max_template_chars: int = 400  # absolute length cap of a template
    max_growth: float = 1.5  # a child may be at most this times longer than a non-empty parent
    answer_chars: int = 300  # the model's answer is truncated to this in reflection records
    copy_words: int = 8  # this many consecutive words of a minibatch problem = a copied span
    max_iterations: int = 50  # safety bound besides the budget


@dataclass
class HardItem:  # any object with these fields works (train.py passes data.Problem rows)
    id: str
    problem: str
    answer: str


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
    metric_calls: int = 0
    reflection_calls: int = 0
    rejections: Counter = field(default_factory=Counter)

    def to_json(self):
        return {"pool": self.pool, "parents": self.parents, "scores": self.scores,
                "dev_ids": self.dev_ids, "train_ids": self.train_ids, "chosen": self.chosen,
                "assignment": self.assignment, "log": self.log, "metric_calls": self.metric_calls,
                "reflection_calls": self.reflection_calls, "rejections": dict(self.rejections),
                "best_dev_score": max((sum(r) / max(1, len(r)) for r in self.scores), default=0.0)}


# ----------------------------------------------------------------------------- selection


def split_dev_train(items, dev_max, rng):
    """Shuffle; dev gets min(dev_max, half of the items) (at least 1), train the rest."""
    items = list(items)
    rng.shuffle(items)
    n_dev = max(1, min(dev_max, len(items) // 2))
    return items[:n_dev], items[n_dev:]


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


def assign_templates(pool, scores, chosen, dev_ids, train_ids, k, rng, same_for_group=False):
    """K templates per hard prompt, drawn with replacement ∝ mean dev score. A dev item that
    some chosen template solves draws from those; any other item from the whole chosen set."""
    if not chosen:
        return {}
    mean = {c: sum(scores[c]) / len(scores[c]) for c in chosen}
    out = {}
    for item_id in list(dev_ids) + list(train_ids):
        cands = chosen
        if item_id in dev_ids:
            j = dev_ids.index(item_id)
            solving = [c for c in chosen if scores[c][j] > 0]
            cands = solving or chosen
        draws = rng.choices(cands, weights=[mean[c] for c in cands], k=1 if same_for_group else k)
        out[item_id] = [pool[c] for c in (draws * k if same_for_group else draws)]
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
    extracted = v.extracted if v.extracted is not None else "(none: no \\boxed{} answer)"
    return (f"Problem: {item.problem}\nStudent's answer: {response[:answer_chars]}\n"
            f"Feedback: the answer is {verdict}; the extracted answer was {extracted}; "
            f"the correct answer is {item.answer}.")


def meta_prompt(template, records):
    return META_PROMPT.format(template=template or "(empty: no instruction)", records="\n\n".join(records),
                              delim_open=DELIM_OPEN, delim_close=DELIM_CLOSE)


def _normal(text):
    return " ".join(text.lower().split())


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
    if len(tpl) > cfg.max_template_chars or (parent and len(tpl) > cfg.max_growth * len(parent)):
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
        if re.search(r"(?<![\w.])" + re.escape(item.answer.strip()) + r"(?![\w.])", tpl):
            return None, "answer_leak"
        pw = item.problem.lower().split()
        text_words = " ".join(words)
        for i in range(len(pw) - cfg.copy_words + 1):
            if " ".join(pw[i:i + cfg.copy_words]) in text_words:
                return None, "problem_copy"
    return tpl, "ok"


# ----------------------------------------------------------------------------- the search


def run_gepa(hard, answer_fn, reflect_fn, cfg, rng, k=6, same_for_group=False, progress=None,
             reward_fn=None):
    """Evolve templates for the hard items; return the pool, scores, lineage and assignment.
    reward_fn(response, item) -> 0/1 scores an answer (default: verify.check against item.answer)."""
    reward_fn = reward_fn or (lambda response, item: check(response, item.answer).reward)
    dev, train = split_dev_train(hard, cfg.dev_max, rng)
    train = train or dev  # a tiny hard set: reflect on dev items too (then they are not held out)
    res = GepaResult(pool=[""], parents=[-1], scores=[], dev_ids=[d.id for d in dev],
                     train_ids=[t.id for t in train if t.id not in {d.id for d in dev}],
                     assignment={}, chosen=[])

    def score(template, items, kind):
        responses = answer_fn([(template, it) for it in items], kind)
        res.metric_calls += len(items)
        return [reward_fn(r, it) for r, it in zip(responses, items)], responses

    res.scores.append([int(s) for s in score("", dev, "gepa_dev")[0]])
    order, cursor = list(range(len(train))), len(train)
    for iteration in range(cfg.max_iterations):
        if res.metric_calls >= cfg.budget:
            break
        parents = select_parents(res.scores, cfg.parents_per_iter, rng)
        # ---- answer each parent's minibatch under the parent
        batches = []
        for p in parents:
            if cursor + cfg.minibatch > len(order):
                rng.shuffle(order)
                cursor = 0
            batches.append([train[i] for i in order[cursor:cursor + cfg.minibatch]])
            cursor += cfg.minibatch
        parent_scores, prompts, live = [], [], []
        for p, mb in zip(parents, batches):
            s, responses = score(res.pool[p], mb, "gepa_minibatch")
            parent_scores.append(sum(s))
            if sum(s) == len(mb):
                res.log.append({"iteration": iteration, "parent": p, "outcome": "skipped_all_correct"})
                continue
            records = [reflection_record(it, r, cfg.answer_chars) for it, r in zip(mb, responses)]
            prompts.append(meta_prompt(res.pool[p], records))
            live.append(len(parent_scores) - 1)
        # ---- reflect (one batched call), guard, test on the same minibatch
        outputs = reflect_fn(prompts) if prompts else []
        res.reflection_calls += len(prompts)
        for idx, (text, finished) in zip(live, outputs):
            p, mb = parents[idx], batches[idx]
            child, reason = guard(text, finished, res.pool[p], res.pool, mb, cfg)
            entry = {"iteration": iteration, "parent": p, "proposal": text[:2000]}
            if child is None:
                res.rejections[reason] += 1
                res.log.append({**entry, "outcome": "rejected", "reason": reason})
                continue
            child_score = sum(score(child, mb, "gepa_minibatch")[0])
            if child_score <= parent_scores[idx]:
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
                                      res.train_ids, k, rng, same_for_group)
    return res
