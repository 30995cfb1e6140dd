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

`cfg` everywhere is config.Config (duck-typed, never imported here); only its GEPA and guard
fields are read: gepa_budget, gepa_auto, gepa_dev_max, gepa_parents (W), gepa_minibatch (b),
gepa_max_iterations, max_template_chars, template_max_growth, guard_copy_words,
reflect_answer_chars, reflect_max_tokens, the variant switches reflect_prompt, reflect_guards,
gepa_selection, gepa_accounting, prompt_format (the official prompt shows the user text in it),
and for the assignment group_size (K), same_template_per_group, bare_rollout.

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

The reference code's variants (zlkqz/P2O), each its own switch, read with getattr so that an
older config means "ours": --gepa_selection=official keeps zero-score ties in the fronts (an item
nobody solves holds every candidate), prunes nothing, and takes every front member when there are
at most W of them, else W DISTINCT parents drawn one by one in proportion to their fronts
(select_parents_official). --gepa_accounting=official charges nothing for the seeds' dev
evaluations nor for iterations 0 and 1, and from iteration 2 on charges b per parent plus |dev|
per accepted child (the children's minibatch answers are free); the round stops before an
iteration once the charge has reached the budget, every iteration takes W parents, and |dev| is
not capped by the budget. metric_calls still counts every answer made (it can pass the budget:
that is the rule) and `charged` what the rule counted; gepa_max_iterations still bounds the round.
--reflect_prompt=official asks with GEPA's instruction-proposal prompt (in our words), showing
each minibatch item as the policy's user message and its answer cut head + tail, and parses the
reply between ``` fences after a think block (reply_after_thought); --reflect_guards=False keeps
only the parse and the empty check.
"""

import math
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

from prompts import user_text
from verify import check

DELIM_OPEN, DELIM_CLOSE = "<template>", "</template>"

# The variant switches (config.Config; config.py validates against these). Each defaults to
# "ours" when a config does not have it (_setting), so configs saved before them still load.
REFLECT_PROMPTS = ("ours", "official")
SELECTIONS = ("ours", "official")
ACCOUNTINGS = ("ours", "official")
_VARIANTS = {"reflect_prompt": REFLECT_PROMPTS, "gepa_selection": SELECTIONS, "gepa_accounting": ACCOUNTINGS}


def _setting(cfg, name):
    """cfg.<name> for a variant switch, "ours" when cfg predates it; an unknown value is an error
    here too, so that a typo cannot silently run the other variant."""
    value = getattr(cfg, name, "ours")
    if value not in _VARIANTS[name]:
        raise ValueError(f"{name} must be one of {_VARIANTS[name]}, got {value!r}")
    return value


def _official(cfg, name):
    return _setting(cfg, name) == "official"


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
    metric_calls: int = 0  # every answer made (the true compute); never above budget under ours
    charged: int = 0  # what the accounting rule counted against the budget (ours: metric_calls)
    budget: int = 0  # the round's budget: cfg.gepa_budget, or the preset's for its dev set
    reflection_calls: int = 0
    rejections: Counter = field(default_factory=Counter)

    def to_json(self):
        return {"pool": self.pool, "parents": self.parents, "scores": self.scores,
                "dev_ids": self.dev_ids, "train_ids": self.train_ids, "chosen": self.chosen,
                "assignment": self.assignment, "log": self.log, "metric_calls": self.metric_calls,
                "charged": self.charged, "budget": self.budget, "reflection_calls": self.reflection_calls,
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
                "charged": self.charged, "budget": self.budget}


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
    preset (gepa_auto) the budget follows the dev set instead: gepa_dev_max. So it does under
    official accounting, which charges no seed evaluation and reserves nothing (the reference
    code sizes its dev set without looking at the budget)."""
    if cfg.gepa_auto or _official(cfg, "gepa_accounting"):
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
    Under ours it must cover the dev evaluations of the empty template and the n_seeds seeds;
    official accounting does not charge them."""
    budget = auto_budget(cfg.gepa_auto, dev_size) if cfg.gepa_auto else cfg.gepa_budget
    if not _official(cfg, "gepa_accounting") and (1 + n_seeds) * dev_size > budget:
        raise ValueError(f"GEPA budget {budget} cannot score the empty template and {n_seeds} seed templates "
                         f"on {dev_size} dev items")
    return budget


def read_seed_templates(path, max_chars):
    """Human-written templates (Human-Ref), one per line; blank lines and lines starting with '#'
    are skipped. A template longer than max_chars is an error naming its line."""
    templates = []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is an error naming it
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 text (byte {e.start + 1} of the line)") from None
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


def official_fronts(scores):
    """The reference code's fronts: for each dev item, the candidates whose score on it equals
    the best over all candidates, zero included (an item nobody solves holds every candidate).
    The reference builds them incrementally: each item starts at {seed} with the seed's score, and
    a new candidate with a higher score replaces the set, one with an equal score joins it. By
    induction over the candidates in pool order, the running best is the max of the prefix and the
    set is that prefix's argmax, so after the last candidate it is this full-matrix argmax set;
    nothing there uses 0/1 scores (tests/test_gepa_official.py replays the incremental rule
    on random 0/1 and 0/1/2 matrices)."""
    fronts = []
    for j in range(len(scores[0]) if scores else 0):
        best = max(row[j] for row in scores)
        fronts.append({c for c, row in enumerate(scores) if row[j] == best})
    return fronts


def parent_weights(scores, selection="ours"):
    """{candidate: weight} of one parent draw; a draw picks c with probability weight / total.
    ours: the survivors of prune_dominated over the fronts of solved items, each weighted by its
    number of fronts (every candidate 1 while nothing is solved). official: every candidate on
    an official front, weighted by its number of fronts (the reference's ParetoCandidateSelector
    counts); with no dev item at all, every candidate 1, as the reference falls back to."""
    if selection == "official":
        counts = Counter(c for f in official_fronts(scores) for c in f)
        return dict(sorted(counts.items())) or {c: 1 for c in range(len(scores))}
    fronts = pareto_fronts(scores)
    survivors = prune_dominated(fronts, scores)
    if not survivors:
        return {c: 1 for c in range(len(scores))}
    return {c: sum(c in f for f in fronts) for c in sorted(survivors)}


def select_parents(scores, n, rng):
    """n parents (with replacement), each drawn with probability ∝ its number of fronts
    after pruning. With no front at all (nothing solved yet), draw uniformly from the pool."""
    if not any(map(any, scores)):  # randrange, not choices: the same draws as rounds run before
        return [rng.randrange(len(scores)) for _ in range(n)]
    weights = parent_weights(scores)
    return rng.choices(list(weights), weights=list(weights.values()), k=n)


def select_parents_official(scores, n, rng):
    """The reference's parents: every official front member when there are at most n of them
    (sorted), else n DISTINCT ones drawn one by one, each ∝ its number of fronts among those not
    yet taken. So an iteration has min(n, |union of fronts|) parents, and an early pool (the seed
    alone) gives one."""
    weights = parent_weights(scores, "official")
    if len(weights) <= n:
        return list(weights)
    taken = []
    for _ in range(n):
        cands = [c for c in weights if c not in taken]
        taken.append(rng.choices(cands, weights=[weights[c] for c in cands], k=1)[0])
    return taken


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


def reflection_record(item, response, answer_chars, reward=None):
    """One answer as the reflector reads it; `reward`: its score under the run's --reward (None:
    verify.check's), which decides correct / wrong; the extracted answer is the last box's."""
    v = check(response, item.answer)
    verdict = "correct" if (v.reward if reward is None else reward) > 0 else "wrong"
    extracted = v.extracted[:answer_chars] if v.extracted is not None else "(none: no \\boxed{} answer)"
    return (f"Problem: {item.problem}\nStudent's answer: {response[:answer_chars]}\n"
            f"Feedback: the answer is {verdict}; the extracted answer was {extracted}; "
            f"the correct answer is {item.answer}.")


def meta_prompt(template, records):
    return META_PROMPT.format(template=template or "(empty: no instruction)", records="\n\n".join(records),
                              delim_open=DELIM_OPEN, delim_close=DELIM_CLOSE)


# The official prompt: GEPA's instruction-proposal prompt as the reference code sends it, said
# in our own words. It shows the instruction and the examples in ``` blocks, asks the reflector to
# infer the task, to put niche domain facts from the responses and feedback into the instruction
# and to keep any strategy that generalises, and to answer inside ``` blocks (extract_template).
OFFICIAL_PROMPT = """An assistant was given the instruction below for a task I want done:
```
{template}
```

Below are some inputs of that task as the assistant received them, the response it gave to each, \
and feedback on how each response could have been better:
```
{examples}
```

Your job is to write a new instruction for the assistant.

Study the inputs closely: work out how they are formatted and infer a detailed description of \
the task I want the assistant to solve.

Then go through every response and its feedback. Find all the niche, domain-specific facts \
about the task and write them into the new instruction, since much of this knowledge may not be \
available to the assistant later on. If the assistant followed a strategy that would also work \
on other inputs of the task, describe that strategy in the instruction too.

Give the new instruction inside ``` blocks."""


def official_feedback(response, answer, reward):
    """The reference's three feedback cases: a response without exactly one \\boxed (its
    reward's format test: none, or several) gets a format-error note; otherwise right or wrong;
    each names the correct answer and ends with the reward. The format note is the longest of the
    three, which longest_reflection_prompt relies on."""
    if response.count("\\boxed") != 1:
        text = ("The final answer has to be given once, in the required format, with no further "
                "explanation; this response may have left out the \\boxed{} answer tag or used it more "
                f"than once. The correct answer is '{answer}'.\n\nCompare your reasoning with the "
                "correct answer, and check the format of your output.")
    elif reward > 0:
        text = f"The final answer is correct. The correct answer is '{answer}'."
    else:
        text = f"The final answer is wrong. The correct answer is '{answer}'."
    return f"{text}\n\nReward: {reward:.2f}"


CUT_MARKER = "\n\n[... the middle of this response is left out ...]\n\n"


def cut_middle(text, limit):
    """text when it has at most `limit` characters, else its start and its end around CUT_MARKER,
    `limit` characters in all, so the final \\boxed{} stays in view:
    cut_middle("0123456789" * 10, 73) -> "0123456789" + CUT_MARKER + "0123456789" (10 + 53 + 10).
    The reference cuts an answer only when the prompt would not fit its context, then to 40 % +
    40 % of a token budget (the rest is slack for re-encoding); a cut in characters needs no
    slack, so here each side gets half. A limit with no room beside the marker keeps the start."""
    if len(text) <= limit:
        return text
    room = limit - len(CUT_MARKER)
    if room < 2:
        return text[:limit]
    head = room // 2
    return text[:head].rstrip() + CUT_MARKER + text[len(text) - (room - head):].lstrip()


def official_examples(items, responses, rewards, answer_chars, fmt="default"):
    """The examples as markdown sections: the input (the user message as the policy saw it, in
    prompt format `fmt`, without the template: prompts.user_text), the response cut to
    answer_chars (cut_middle), the feedback."""
    return "\n\n".join(
        f"# Example {i}\n## Input\n{user_text(item.problem, fmt)}\n\n"
        f"## Response\n{cut_middle(response, answer_chars).strip()}\n\n"
        f"## Feedback\n{official_feedback(response, item.answer.strip(), reward)}"
        for i, (item, response, reward) in enumerate(zip(items, responses, rewards), 1))


def reflection_prompt(cfg, template, minibatch, responses, rewards):
    """The meta-prompt for one parent and its minibatch, in the --reflect_prompt style: ours
    (reflection_record + META_PROMPT; it verifies the answers itself) or official. rewards: the
    minibatch's scores under the parent, as reward_fn gave them."""
    if _official(cfg, "reflect_prompt"):
        return OFFICIAL_PROMPT.format(template=template.strip(), examples=official_examples(
            minibatch, responses, rewards, cfg.reflect_answer_chars, getattr(cfg, "prompt_format", "default")))
    records = [reflection_record(it, r, cfg.reflect_answer_chars, s) for it, r, s in zip(minibatch, responses, rewards)]
    return meta_prompt(template, records)


def reflector_framing(cfg):
    """How a local reflector frames the call (rollout.EngineReflector(**...)): ours prefills the
    reply with the opening delimiter and stops at the closing one (a small model rarely writes them
    itself); official sends the prompt as the one user message and reads the whole reply."""
    if _official(cfg, "reflect_prompt"):
        return {"prefill": "", "stop": []}
    return {"prefill": DELIM_OPEN, "stop": [DELIM_CLOSE]}


def max_template_length(cfg):
    """The longest template a prompt can carry, in characters or (guards off) tokens: the guards
    cap a child at max_template_chars; without them a child is bounded only by the reflector's reply
    (reflect_max_tokens tokens), and a seed template still by max_template_chars."""
    if getattr(cfg, "reflect_guards", True):
        return cfg.max_template_chars
    return max(cfg.max_template_chars, cfg.reflect_max_tokens)


def reflection_cut_chars(cfg):
    """The parts of a reflection prompt that longest_reflection_prompt leaves empty, counted as one
    token a character: the parent template (max_template_length), and per minibatch item the answer
    cut to reflect_answer_chars (ours: its start; official: start and end around a marker, the
    same length in all; ours also shows the extracted answer, cut alike)."""
    per_item = 1 if _official(cfg, "reflect_prompt") else 2
    return max_template_length(cfg) + per_item * cfg.reflect_answer_chars * cfg.gepa_minibatch


def longest_reflection_prompt(cfg, problems):
    """The chat messages of the longest reflection call the run can make, but for the parts
    reflection_cut_chars counts: the b problems with the longest text and answer (the official
    prompt shows each as its whole user message), an empty parent and empty answers (the official
    prompt then shows its longest, format-error feedback), in the framing of reflector_framing.
    rollout.context_length: tokens of these + reflection_cut_chars + reflect_max_tokens."""
    longest = sorted(problems, key=lambda p: len(p.problem) + len(p.answer))[-cfg.gepa_minibatch:]
    text = reflection_prompt(cfg, "", longest, [""] * len(longest), [0.0] * len(longest))
    prefill = reflector_framing(cfg)["prefill"]
    return [{"role": "user", "content": text}] + ([{"role": "assistant", "content": prefill}] if prefill else [])


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


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def reply_after_thought(text):
    """A reflector's reply as the reference's reflection server and client read it: a reasoning
    parser (vLLM's deepseek_r1, which its server ran) drops a leading <think> and splits the rest
    at the first </think> into the thought and the content; where there is no content (the thought
    did not finish, nothing follows it, or there are no think tags at all) its client falls back
    to the thought. So: the text after </think> when something follows it, else the thought.
        "<think>Plan.</think>\n```\nA\n```"  -> "\n```\nA\n```"
        "<think>Plan, cut by the token limit"  -> "Plan, cut by the token limit"
        "```\nA\n```"                          -> "```\nA\n```" (no thought: the reply itself)"""
    _, opened, rest = text.partition(THINK_OPEN)
    thought, closed, content = (rest if opened else text).partition(THINK_CLOSE)
    return content if closed and content else thought


def extract_template(text, cfg):
    """The template in a reflector's reply, or None when the reply has none to parse.
    ours: the text between the first <template> and the next </template> (None without them).
    official: in the reply after its thought (reply_after_thought), what lies between the first
    and the last ``` with the whitespace around it trimmed (inline `code` in it is kept) when there
    are at least two, else the whole reply with backticks and whitespace trimmed at its ends; then
    a first line that is only a "markdown" language tag is dropped (the reference drops any
    leading "markdown", which would also cut a template that starts with that word)."""
    if _official(cfg, "reflect_prompt"):
        text = reply_after_thought(text).strip()
        if text.count("```") >= 2:
            text = text[text.find("```") + 3:text.rfind("```")].strip()
        else:
            text = text.strip("`" + string.whitespace)
        first, _, rest = text.partition("\n")
        return (rest if first.strip().lower() == "markdown" else text).strip()
    start = text.find(DELIM_OPEN)
    end = text.find(DELIM_CLOSE, start + len(DELIM_OPEN)) if start >= 0 else -1
    return text[start + len(DELIM_OPEN):end].strip() if start >= 0 and end >= 0 else None


def guard(text, finished, parent, pool, minibatch, cfg):
    """The template inside the reflector's output, or (None, reason) for a rejection. With
    --reflect_guards=False only the parse (no_delimiter) and an empty template reject, as in the
    reference code; a reply cut by the token limit is then parsed like any other."""
    guarded = getattr(cfg, "reflect_guards", True)
    if guarded and not finished:
        return None, "truncated"
    tpl = extract_template(text, cfg)
    if tpl is None:
        return None, "no_delimiter"
    if not tpl:
        return None, "empty"
    reason = content_guard(tpl, parent, pool, minibatch, cfg) if guarded else None
    return (None, reason) if reason else (tpl, "ok")


def content_guard(tpl, parent, pool, minibatch, cfg):
    """Why a parsed, non-empty template is rejected, or None: too long, repetitive, a duplicate,
    special tokens, a conflict with the answer format, a minibatch answer or a copied problem."""
    if len(tpl) > cfg.max_template_chars or (parent and len(tpl) > cfg.template_max_growth * len(parent)):
        return "too_long"
    words = tpl.lower().split()
    grams = Counter(tuple(words[i:i + 3]) for i in range(len(words) - 2))
    if grams and max(grams.values()) >= 3 or (len(words) >= 8 and len(set(words)) < 0.3 * len(words)):
        return "repetition"
    if _normal(tpl) == _normal(parent) or any(_normal(tpl) == _normal(p) for p in pool):
        return "duplicate"
    if _SPECIAL.search(tpl):
        return "special_tokens"
    if _FORMAT_CONFLICT.search(tpl):
        return "format_conflict"
    for item in minibatch:
        if leaks_answer(tpl, item.answer):
            return "answer_leak"
        if copies_problem(tpl, item.problem, cfg.guard_copy_words):
            return "problem_copy"
    return None


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


def parents_allowed(cfg, res, iteration, dev_size):
    """How many parents iteration `iteration` may take; 0 ends the round.
    ours: W, or fewer when the unreserved budget holds fewer reservations of 2b + |dev| (the most
    one parent's proposal can spend), so metric_calls never passes the budget.
    official: W while the charge is below the budget, and always in iterations 0 and 1 (they are
    not charged); an iteration that will not fit whole still runs, as in the reference."""
    if _official(cfg, "gepa_accounting"):
        return cfg.gepa_parents if iteration < 2 or res.charged < res.budget else 0
    return min(cfg.gepa_parents, (res.budget - res.metric_calls) // (2 * cfg.gepa_minibatch + dev_size))


def official_charge(cfg, iteration, n_parents, accepted, dev_size):
    """The official rule's charge for a finished iteration: nothing for iterations 0 and 1, then b
    per parent (the parents' minibatch answers; the children's are not charged) plus |dev| per
    accepted child. b even where the train set is smaller than b, as the reference charges."""
    return 0 if iteration < 2 else cfg.gepa_minibatch * n_parents + accepted * dev_size


def propose(res, iteration, parents, batches, dev, score, reflect_fn, cfg):
    """One iteration's proposals, in three answer calls and one reflection call: every parent
    answers its minibatch (all correct: skipped), one batched reflection call, the guards, every
    surviving child on its parent's minibatch, acceptance, every accepted child on dev. Greedy
    answers do not depend on what else is in a call, so this is the one-proposal-at-a-time
    process, batched. Log, rejections and pool updated in res, in parent order. -> children accepted.
    `score([(template, items), ...], kind)` -> [(rewards, responses), ...] answers all in one call."""
    answered = score([(res.pool[p], mb) for p, mb in zip(parents, batches)], "gepa_minibatch")
    parent_scores = [sum(s) for s, _ in answered]
    prompts, live = [], []
    for i, ((s, responses), p, mb) in enumerate(zip(answered, parents, batches)):
        if sum(s) == len(mb):
            res.log.append({"iteration": iteration, "parent": p, "outcome": "skipped_all_correct"})
            continue
        prompts.append(reflection_prompt(cfg, res.pool[p], mb, responses, s))
        live.append(i)
    outputs = reflect_fn(prompts) if prompts else []
    res.reflection_calls += len(prompts)
    entries, children = [], []  # per live parent: its log entry; (its index in entries, child) passing the guards
    for idx, output in zip(live, outputs):
        p, mb = parents[idx], batches[idx]
        text, finished = output or ("", False)  # None: the reflection call failed (a server reflector)
        child, reason = guard(text, finished, res.pool[p], res.pool, mb, cfg) if output else (None, "call_failed")
        entries.append({"iteration": iteration, "parent": p, "proposal": text[:2000]})
        if child is None:
            res.rejections[reason] += 1
            entries[-1].update(outcome="rejected", reason=reason)
        else:
            children.append((len(entries) - 1, idx, child))
    child_scores = score([(child, batches[idx]) for _, idx, child in children], "gepa_minibatch")
    winners = []
    for (e, idx, child), (s, _) in zip(children, child_scores):
        entries[e].update(template=child, minibatch=[parent_scores[idx], sum(s)])
        if accept_child(parent_scores[idx], sum(s)):
            winners.append((e, idx, child))
        else:
            res.rejections["not_better"] += 1
            entries[e].update(outcome="rejected", reason="not_better")
    for (e, idx, child), (s, _) in zip(winners, score([(child, dev) for _, _, child in winners], "gepa_dev")):
        res.pool.append(child)
        res.parents.append(parents[idx])
        res.scores.append([int(x) for x in s])
        entries[e].update(outcome="accepted", index=len(res.pool) - 1, dev_score=sum(res.scores[-1]) / len(dev))
    res.log += entries
    return len(winners)


def run_gepa(hard, answer_fn, reflect_fn, cfg, rng, progress=None, reward_fn=None, seeds=()):
    """Evolve templates for the hard items; return the pool, scores, lineage and assignment
    (cfg.group_size templates per hard item; one for the whole group with cfg.same_template_per_group).
    reward_fn(response, item) -> 0/1 scores an answer (default: verify.check against item.answer).
    seeds: given templates (Human-Ref) that start the pool beside the empty one; each is scored
    on the dev items like any candidate, and the metric calls count (under official accounting
    they are made but not charged, as the reference's seed evaluation)."""
    reward_fn = reward_fn or (lambda response, item: check(response, item.answer).reward)
    official = _official(cfg, "gepa_accounting")
    select = select_parents_official if _official(cfg, "gepa_selection") else select_parents
    seeds = [t for t in seeds if t]
    dev, train = split_dev_train(hard, dev_cap(cfg, len(seeds)), rng)
    train = train or dev  # a tiny hard set: reflect on dev items too (then they are not held out)
    budget = round_budget(cfg, len(dev), len(seeds))
    res = GepaResult(pool=["", *seeds], parents=[-1] * (1 + len(seeds)), scores=[], dev_ids=[d.id for d in dev],
                     train_ids=[t.id for t in train if t.id not in {d.id for d in dev}],
                     assignment={}, chosen=[], budget=budget)

    def score(jobs, kind):
        """[(template, items)] -> [(rewards, responses)], every answer in one answer_fn call."""
        pairs = [(template, it) for template, items in jobs for it in items]
        if not pairs:
            return []
        responses = iter(answer_fn(pairs, kind))
        res.metric_calls += len(pairs)
        out = []
        for _, items in jobs:
            texts = [next(responses) for _ in items]
            out.append(([reward_fn(r, it) for r, it in zip(texts, items)], texts))
        return out

    res.scores += [[int(x) for x in s] for s, _ in score([(template, dev) for template in res.pool], "gepa_dev")]
    res.charged = 0 if official else res.metric_calls
    order, cursor = list(range(len(train))), len(train)
    for iteration in range(cfg.gepa_max_iterations):
        n_parents = parents_allowed(cfg, res, iteration, len(dev))
        if n_parents < 1:
            break
        parents = select(res.scores, n_parents, rng)
        batches, cursor = next_minibatches(train, order, cursor, len(parents), cfg.gepa_minibatch, rng)
        accepted = propose(res, iteration, parents, batches, dev, score, reflect_fn, cfg)
        if official:
            res.charged += official_charge(cfg, iteration, len(parents), accepted, len(dev))
        else:
            res.charged = res.metric_calls
        if progress:
            progress(res)
    res.chosen = greedy_set_cover(res.scores)
    res.assignment = assign_templates(res.pool, res.scores, res.chosen, res.dev_ids,
                                      res.train_ids, cfg.group_size, rng, cfg.same_template_per_group,
                                      bare=cfg.bare_rollout)
    return res
