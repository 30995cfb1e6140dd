"""Issue 54's pilot: does a short hand-written strategy template lift the default model on the hard
`two_step` level (a + b × c), which tokens of its templated successes would the default Context
Ratio Mask drop, and can the model itself (Self-Ref) write a template that helps?

    python experiments/strategy_pilot.py                         # the candidates below, train split, k = 8, T = 1
    python experiments/strategy_pilot.py --split=dev --k=16

For every candidate template (none of which holds an answer or a fact about one problem): each
two_step problem of the split is answered k times at T = 1 with the template (and without: the
plain arm) in one vLLM call, scored by the run's reward; avg@k (mean success), pass@k and the
greedy accuracy are written per template with each problem's count. Then, for every templated
success of each template (up to --crm_rows), the log-prob of each response token under the plain
prompt x and the templated x~ (few-shot turns included, as training builds them) at the training
temperature, and the tokens the default CRM band [0.01, 10] drops (distill.crm_weights). Results:
results/strategy_pilot/pilot-<split>.json and .md. Self-Ref: --reflections prompts built as a GEPA round
builds them from the model's own greedy answers; each proposal gepa.guard accepts is scored like the
hand-written ones (self_ref_<i>). The numbers are descriptive: a pilot chooses the
task and calibrates the study's power analysis; it tests nothing.
"""

import argparse
import collections
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "results", "strategy_pilot")
from data.subtract import STRATEGY  # noqa: E402
TEMPLATES = {  # name -> text: a strategy, no answer, nothing specific to one problem
    "plain": "",
    "order": "Do the multiplication first, then the addition.",
    "steps": "Order of operations: first multiply the two numbers joined by ×, then add the first number to "
             "that product. Write each step, then the final number in \\boxed{}.",
    "pattern": "For a + b × c: compute b × c first, then add a to the result.",
    # round 2: the strategy shown on a problem outside the level (its a is 1-9: 11 + 2 × 3 is none of its
    # problems; the answer 17 is some problems' answer too, but no fact about them), or as a two-line scaffold
    "example": "Worked example: 11 + 2 × 3. First 2 × 3 = 6. Then 11 + 6 = 17. Do the same: multiply first, "
               "then add.",
    "scaffold": "Answer in two lines. Line 1: the multiplication and its result. Line 2: the first number plus "
                "that result.",
    "reorder": "Rewrite a + b × c as b × c + a. Compute b × c, then add a.",
    # round 3, the add3 level (a + b + c): the same kind of strategy for a level the model half-solves
    "pairwise": "Add the first two numbers, then add the third number to that sum.",
    "pairwise_example": "Worked example: 11 + 12 + 13. First 11 + 12 = 23. Then 23 + 13 = 36. Do the same: add "
                        "two numbers at a time.",
    # round 5, the subtraction task (data/subtract.py): a negative result's procedure, conditional (the task's
    # seed template), unconditional, and shown on a problem no split has (its numbers are no answer of the task)
    "sub_strategy": STRATEGY,
    "sub_schema": "Answer like this: (bigger) − (smaller) = (difference), so the answer is \\boxed{-difference}.",
    "sub_example": "Example: What is 20 − 31?\n31 − 20 = 11, so 20 − 31 = -11. The answer is \\boxed{-11}.",
}


def wilson(successes, n, z=1.96):
    """95% Wilson interval of a proportion (describes one pooled rate; samples of a problem are not independent)."""
    if not n:
        return float("nan"), float("nan")
    p, d = successes / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5 / d
    return centre - half, centre + half


def crm_of(model, tokenizer, problem, response, template, cfg):
    """[(token text, dropped by the default CRM band)] of one response, its log-probs under the plain and the
    templated prompt as training builds them (the few-shot turns included) at the training temperature. The
    response is re-tokenised from its text (the engine's ids are not kept): a token may split differently."""
    import torch

    from distill import crm_weights
    from model import pad_token_id
    from prompts import encode_prompt, problem_messages
    from train import row_logprobs

    prompts = [encode_prompt(tokenizer, problem_messages(problem, t, fmt=cfg.prompt_format)) for t in ("", template)]
    ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        plain, tilde = row_logprobs(model, prompts, [ids] * 2, pad_token_id(tokenizer), cfg.temperature)
    weights, _ = crm_weights(plain, tilde, cfg.crm_low, cfg.crm_high)
    return [(tokenizer.decode([t]), w.item() == 0.0) for t, w in zip(ids, weights)]


def self_ref_proposals(engine, problems, cfg, args):
    """What the 135M model writes as a template when it reflects on its own failures, as a Self-Ref GEPA round
    asks it (gepa.reflection_prompt from the empty template, --gepa_minibatch problems a prompt with its greedy
    answers and their rewards, the default reflector settings) -> [{reply, template or None, why}], the
    template when gepa.guard accepts it."""
    import random

    import gepa
    from rollout import EngineReflector
    from scoring import answer_records

    rng = random.Random(args.seed)
    batches = [rng.sample(problems, cfg.gepa_minibatch) for _ in range(args.reflections)]
    asked = list({p.id: p for b in batches for p in b}.values())
    greedy = {r["id"]: r for r in answer_records(engine, asked, 0, max_tokens=cfg.max_tokens, progress=False,
                                                 prompt_format=cfg.prompt_format, reward=cfg.reward)}
    prompts = [gepa.reflection_prompt(cfg, "", b, [greedy[p.id]["responses"][0] for p in b],
                                      [greedy[p.id]["rewards"][0] for p in b]) for b in batches]
    reflector = EngineReflector(engine, temperature=cfg.reflect_temperature, max_tokens=cfg.reflect_max_tokens,
                                seed=args.seed, **gepa.reflector_framing(cfg))
    out, pool = [], []
    for (text, finished), batch in zip(reflector.reflect(prompts), batches):
        template, why = gepa.guard(text, finished, "", pool, batch, cfg)
        pool += [template] if template else []
        out.append({"reply": text, "template": template, "why": why})
    return out


def template_entry(template, problems, records, model, tokenizer, cfg, args):
    """One template's numbers: avg@k, pass@k, greedy, each problem's successes, and (templated) the CRM on its
    successes."""
    solved = [sum(r > 0 for r in rec["sampled"]["rewards"]) for rec in records]
    entry = {"template": template, "avg": statistics.mean(s / args.k for s in solved),
             "pass": statistics.mean(s > 0 for s in solved),
             "greedy": statistics.mean(rec["rewards"][0] > 0 for rec in records), "successes": sum(solved),
             "samples": args.k * len(records), "per_problem": dict(zip([p.id for p in problems], solved)),
             "wilson_pooled": wilson(sum(solved), args.k * len(records))}
    if template:
        successes = [(p, text) for p, rec in zip(problems, records)
                     for text, r in zip(rec["sampled"]["responses"], rec["sampled"]["rewards"]) if r > 0]
        masked, tokens, rows_with_mask, dropped = 0, 0, 0, collections.Counter()
        for p, text in successes[:args.crm_rows]:
            ratios = crm_of(model, tokenizer, p, text, template, cfg)
            masked += sum(m for _, m in ratios)
            tokens += len(ratios)
            rows_with_mask += any(m for _, m in ratios)
            dropped.update(t for t, m in ratios if m)
        entry["crm"] = {"rows": min(len(successes), args.crm_rows), "tokens": tokens, "masked_tokens": masked,
                        "rows_with_a_masked_token": rows_with_mask, "dropped": dropped.most_common(15),
                        "example": successes[0][1] if successes else None}
    return entry


def report_lines(out, argv):
    """pilot-<split>[-<tag>].md's lines from the JSON's dict."""
    level = out.get("level", "two_step")  # round 1's file predates --level
    lines = [f"# Strategy-template pilot: {out['problems']} {out.get('task', 'builtin')} {level} problems "
             f"({out['split']}), k = {out['k']}, T = {out['temperature']}", "",
             "Written by `python experiments/strategy_pilot.py " + " ".join(argv if argv is not None else sys.argv[1:])
             + "`; descriptive, tests nothing.", "",
             "| template | avg@k | pass@k | greedy | successes / samples (Wilson 95%, pooled) | CRM: masked tokens "
             "of templated successes | rows with one |", "|---|---|---|---|---|---|---|"]
    for name, e in out["templates"].items():
        crm = e.get("crm")
        lo, hi = e["wilson_pooled"]
        lines.append(f"| {name}: {e['template'] or '(none)'} | {e['avg']:.3f} | {e['pass']:.3f} | {e['greedy']:.3f} | "
                     f"{e['successes']} / {e['samples']} ({lo:.3f}, {hi:.3f}) | "
                     + (f"{crm['masked_tokens']} / {crm['tokens']} | {crm['rows_with_a_masked_token']} / {crm['rows']}"
                        if crm else "— | —") + " |")
    lines += ["", f"What the model wrote when asked to reflect ({len(out['self_ref'])} Self-Ref prompts; "
              "gepa.guard's verdict):", ""]
    lines += [f"- {r['why']}: {r['reply'][:160]!r}" for r in out["self_ref"]]
    lines += ["", "Tokens the mask drops most often, by template:", ""]
    for name, e in out["templates"].items():
        if e.get("crm"):
            lines.append(f"- {name}: {e['crm']['dropped'] or 'none'}; a success: {e['crm']['example']!r}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--split", default="train")
    ap.add_argument("--task", default="builtin", help="a shipped task (builtin | subtract): its <task>-<split> set")
    ap.add_argument("--level", default="two_step", help="the split's problems of this level (source <task>/<level>), "
                    "or 'all'")
    ap.add_argument("--prompt_format", default="default", help="default (the built-in task's few-shot turns) | "
                    "official (no few-shot turns)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max_tokens", type=int, default=128)
    ap.add_argument("--crm_rows", type=int, default=40, help="templated successes whose tokens are ratioed, a template")
    ap.add_argument("--reflections", type=int, default=8, help="Self-Ref proposals asked of the model (0: none)")
    ap.add_argument("--templates", default="plain,order,steps,pattern", help="which of TEMPLATES, comma-separated")
    ap.add_argument("--tag", default="", help="a suffix of the output files (a pilot round)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from config import Config, cpu_precision
    from data import load_jsonl
    from model import resolve_model
    from rollout import make_rollout
    from scoring import answer_sets

    cfg = Config(prompt_format=args.prompt_format)
    cfg.engine_dtype, cfg.autocast_bf16, _ = cpu_precision(cfg, "cpu")  # the engine train.py would start
    path = resolve_model(cfg.model)
    problems = [p for p in load_jsonl(f"{args.task}-{args.split}")[0]
                if args.level == "all" or p.source.endswith("/" + args.level)]
    engine = make_rollout("vllm", path, dtype=cfg.engine_dtype, seed=args.seed, max_model_len=2048, kv_cache_gib=2)
    reflections = self_ref_proposals(engine, problems, cfg, args) if args.reflections else []
    templates = {name: TEMPLATES[name] for name in args.templates.split(",")}
    templates.update({f"self_ref_{i}": r["template"] for i, r in enumerate(reflections) if r["template"]})
    sets = answer_sets(engine, [(problems, t, args.k) for t in templates.values()], temperature=args.temperature,
                       max_tokens=args.max_tokens, progress=True, seed=args.seed, prompt_format=args.prompt_format,
                       reward=cfg.reward)
    del engine
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {"model": cfg.model, "task": args.task, "level": args.level, "split": args.split, "k": args.k,
           "temperature": args.temperature,
           "max_tokens": args.max_tokens, "problems": len(problems), "templates": {}}
    out["self_ref"] = reflections
    for (name, template), records in zip(templates.items(), sets):
        out["templates"][name] = template_entry(template, problems, records, model, tokenizer, cfg, args)
    os.makedirs(OUT, exist_ok=True)
    stem = os.path.join(OUT, f"pilot-{args.split}" + (f"-{args.tag}" if args.tag else ""))
    with open(stem + ".json", "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
    lines = report_lines(out, argv)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
