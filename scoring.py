"""How answers are scored and summarised: greedy accuracy, avg@k, unbiased pass@k and maj@k of
one engine's answers, the per-problem records that eval.py writes and train.py's dev evaluation
logs (runs.dev_eval). The engine is anything with rollout.py's `generate`.

    records = answer_records(engine, problems, k=16, temperature=0.6, seed=0, reward="ours")
    overall, by_source = summarize_records(records, k=16)
    -> {"problems": 30, "greedy": 0.4, "avg@16": 0.38, "pass@1": 0.38, ..., "maj@16": 0.43, ...}

pass@j uses the unbiased estimator 1 - C(n-c, j) / C(n, j) over the k samples (Chen et al.
2021); maj@k is majority voting over the k samples' answers (majority_reward).
"""

from collections import defaultdict

from prompts import problem_messages
from verify import check, load_reward

SMALL_BENCHMARK = 100  # fewer problems than this: avg@16 at T = 0.6; else greedy (the paper's protocol)


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), computed as a
    product to stay exact for large n (no huge binomials)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    prob_all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_fail *= 1.0 - k / i
    return 1.0 - prob_all_fail


def default_k(num_problems):
    return 16 if num_problems < SMALL_BENCHMARK else 0


def pass_ks(k):
    """The j of the pass@j columns reported for k samples: 1, 2, 4, ..., k."""
    ks, j = [], 1
    while j < k:
        ks.append(j)
        j *= 2
    return ks + [k] if k else []


def score_groups(problems, messages, groups, reward="ours"):
    """Per problem: responses, verdicts (verify.load_reward(reward)) -> one record each (the per-sample JSONL rows)."""
    records, check_fn = [], load_reward(reward)
    for p, m, group in zip(problems, messages, groups):
        verdicts = [check_fn(s.text, p) for s in group]
        records.append({
            "id": p.id, "source": p.source, "answer": p.answer, "prompt": m[-1]["content"],
            "fewshot_turns": (len(m) - 1) // 2,
            "responses": [s.text for s in group],
            "extracted": [v.extracted for v in verdicts],
            "reasons": [v.reason for v in verdicts],
            "rewards": [v.reward for v in verdicts],
            "lengths": [len(s.response_ids) for s in group],
            "truncated": [s.finish_reason == "length" for s in group],
        })
    return records


def majority_reward(extracted, rewards):
    """maj@k of one problem: the reward of the answer most of its k samples gave (majority
    voting, self-consistency). Answers are grouped by mathematical equivalence (verify.py, the
    reward's own rule: `1/2` and `\\frac{1}{2}` are one vote); samples without a boxed answer do
    not vote; a tie goes to the answer given first; no answer at all scores 0."""
    votes = []  # [answer, count, reward], in order of first appearance
    for answer, reward in zip(extracted, rewards):
        if answer is None:
            continue
        for vote in votes:
            if answer == vote[0] or check(f"\\boxed{{{answer}}}", vote[0]).reward == 1.0:
                vote[1] += 1
                break
        else:
            votes.append([answer, 1, reward])
    return max(votes, key=lambda v: v[1])[2] if votes else 0.0  # max keeps the first of equal counts


def summarize(greedy, sampled, k):
    """Aggregate per-problem records into the numbers of one table row. greedy, avg@k and maj@k are
    mean rewards: accuracies when rewards are 0 or 1, as the built-in rules give. pass@j counts a
    sample as solved when its reward is > 0, as mining and GEPA do. A custom reward outside [0, 1]
    adds reward_min and reward_max to the row, so that the means are not read as accuracies."""
    n = len(greedy)
    row = {"problems": n, "greedy": sum(r["rewards"][0] for r in greedy) / n,
           "greedy_boxed": sum(r["extracted"][0] is not None for r in greedy) / n,
           "greedy_truncated": sum(r["truncated"][0] for r in greedy) / n}
    if k:
        row[f"avg@{k}"] = sum(sum(r["rewards"]) / k for r in sampled) / n
        for j in pass_ks(k):
            row[f"pass@{j}"] = sum(pass_at_k(k, sum(x > 0 for x in r["rewards"]), j) for r in sampled) / n
        row[f"maj@{k}"] = sum(majority_reward(r["extracted"], r["rewards"]) for r in sampled) / n
        row["sampled_mean_length"] = sum(sum(r["lengths"]) / k for r in sampled) / n
    every = [x for r in greedy for x in r["rewards"]] + [x for r in sampled if r for x in r["rewards"]]
    if any(not 0.0 <= x <= 1.0 for x in every):
        row.update(reward_min=min(every), reward_max=max(every))
    return row


def answer_records(engine, problems, k=0, temperature=0.6, top_p=1.0, max_tokens=256, progress=True,
                   seed=None, prompt_format="default", template="", reward="ours"):
    """Greedy answers, plus k samples at `temperature` when k > 0 (seeded when `seed` is given):
    one record per problem, its greedy response first, the samples under "sampled". `template`:
    a P²O template applied to every problem (prompts.apply_template; '' = none); `reward`: the
    rule that scores them (train.py's --reward)."""
    return answer_sets(engine, [(problems, template, k)], temperature, top_p, max_tokens, progress, seed,
                       prompt_format, reward)[0]


def answer_sets(engine, sets, temperature=0.6, top_p=1.0, max_tokens=256, progress=True, seed=None,
                prompt_format="default", reward="ours"):
    """answer_records for several sets [(problems, template, k)] at once -> one list of records per
    set, from ONE engine call: the k samples of every prompt at `temperature` first (on CUDA their
    per-request seeds are then those of a call without the greedy requests), then every prompt's
    greedy answer (temperature 0). One call waits for its longest answer once, not twice."""
    messages = [[problem_messages(p, template, fmt=prompt_format) for p in problems] for problems, template, _ in sets]
    flat = [m for ms in messages for m in ms]
    every = [p for problems, _, _ in sets for p in problems]
    ks = [k for (problems, _, k) in sets for _ in problems]
    sampled = [(m, k) for m, k in zip(flat, ks) if k]
    requests = [m for m, _ in sampled] + flat  # the k samples' prompts, then every prompt's greedy one
    out = engine.generate(requests, n=[k for _, k in sampled] + [1] * len(flat),
                          temperature=[temperature] * len(sampled) + [0.0] * len(flat), top_p=top_p,
                          max_tokens=max_tokens, progress=progress, seed=seed)
    samples, greedy = iter(out[:len(sampled)]), iter(out[len(sampled):])
    records = []
    try:
        for (problems, _, k), ms in zip(sets, messages):
            g = score_groups(problems, ms, [next(greedy) for _ in problems], reward)
            s = score_groups(problems, ms, [next(samples) for _ in problems], reward) if k else [None] * len(problems)
            records.append([{**a, "sampled": b} for a, b in zip(g, s)])
    except Exception as e:  # a reward that fails: what was generated is not lost with it
        asked = [p for p, k in zip(every, ks) if k] + every  # the problem of each engine request, in order
        raise ScoringError(str(e), [{"id": p.id, "answer": p.answer, "greedy": i >= len(sampled),
                                     "prompt": m[-1]["content"], "responses": [s.text for s in group]}
                                    for i, (p, m, group) in enumerate(zip(asked, requests, out))]
                           ) from e
    return records


class ScoringError(RuntimeError):
    """Scoring failed after generation; `generated` holds every prompt's responses, unscored."""

    def __init__(self, message, generated):
        super().__init__(message)
        self.generated = generated


def summarize_records(records, k):
    """(overall row, {source: row}) of answer_records' records (sources in data order)."""
    by_source = defaultdict(list)
    for r in records:
        by_source[r["source"] or "-"].append(r)
    rows = {src: summarize(rs, [r["sampled"] for r in rs], k) for src, rs in by_source.items()}
    return summarize(records, [r["sampled"] for r in records], k), rows
