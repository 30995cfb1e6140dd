"""Evaluate a model on one or more benchmarks: greedy accuracy, avg@k, unbiased pass@k and maj@k.

    python eval.py                                         # default model, built-in test split
    python eval.py --model=runs/<run>/latest --data=aime24,math500 --out=out/eval.json
    python eval.py --data=builtin-test --k=16 --temperature=0.6
    torchrun --nproc_per_node=8 eval.py --model=Qwen/Qwen3-4B --data=aime24   # one engine per GPU, rank 0 writes

Protocol (the paper's; docs/METHOD.md §6): a benchmark with fewer than 100 problems is scored by avg@16 at
temperature 0.6, a larger one greedily; `--k` overrides (0 = greedy only). Greedy accuracy is
always reported. pass@j uses the unbiased estimator 1 - C(n-c, j) / C(n, j) over the k samples
(Chen et al. 2021); maj@k is majority voting over the k samples' answers (majority_reward).
Rows are also broken down by their `source` (the built-in task's levels).

A LoRA run's checkpoint (a PEFT adapter folder) or export is served on vLLM as its base with the
adapters as vLLM's LoRA, unmerged, as training sampled it; the HF backend merges it into its base
in fp32 (lora.merged_folder, once, cached). A run's checkpoint or export (runs/<run>/latest, export-NNNNNN) is evaluated as it was trained:
its prompt format, chat-template arguments, max_tokens, temperature and top_p come from the
folder's train_config.json unless given as flags, and the line "settings of the run that
trained ..." says what was taken. vLLM's context is the longest prompt + --max_tokens: no answer
is cut short by it, and a --max_model_len too small for that is an error.

Writes `--out` (JSON: the numbers per benchmark and per source, and the settings used), beside
it a per-sample JSONL (prompt, responses, extracted answers, rewards) and <out>.engine.log
(vLLM's and transformers' log lines; --verbose keeps them on the console). A bad data file or
setting exits non-zero with one line (`file:line: why` for data).
"""

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

import dist
import lora
from config import chat_template_kwargs, default_engine_dtype, reward_scorer
from data import DataError, load_jsonl
from gepa import read_seed_templates
from model import check_model, resolve_model
from prompts import FORMATS, problem_messages
from rollout import make_rollout
from runs import TRAIN_CONFIG, route_library_logs
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
    """Aggregate per-problem records into the numbers of one table row."""
    n = len(greedy)
    row = {"problems": n, "greedy": sum(r["rewards"][0] for r in greedy) / n,
           "greedy_boxed": sum(r["extracted"][0] is not None for r in greedy) / n,
           "greedy_truncated": sum(r["truncated"][0] for r in greedy) / n}
    if k:
        row[f"avg@{k}"] = sum(sum(r["rewards"]) / k for r in sampled) / n
        for j in pass_ks(k):
            row[f"pass@{j}"] = sum(pass_at_k(k, int(sum(r["rewards"])), j) for r in sampled) / n
        row[f"maj@{k}"] = sum(majority_reward(r["extracted"], r["rewards"]) for r in sampled) / n
        row["sampled_mean_length"] = sum(sum(r["lengths"]) / k for r in sampled) / n
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
    ks = [k for (problems, _, k) in sets for _ in problems]
    sampled = [(m, k) for m, k in zip(flat, ks) if k]
    out = engine.generate([m for m, _ in sampled] + flat, n=[k for _, k in sampled] + [1] * len(flat),
                          temperature=[temperature] * len(sampled) + [0.0] * len(flat), top_p=top_p,
                          max_tokens=max_tokens, progress=progress, seed=seed)
    samples, greedy = iter(out[:len(sampled)]), iter(out[len(sampled):])
    records = []
    for (problems, _, k), ms in zip(sets, messages):
        g = score_groups(problems, ms, [next(greedy) for _ in problems], reward)
        s = score_groups(problems, ms, [next(samples) for _ in problems], reward) if k else [None] * len(problems)
        records.append([{**a, "sampled": b} for a, b in zip(g, s)])
    return records


def summarize_records(records, k):
    """(overall row, {source: row}) of answer_records' records (sources in data order)."""
    by_source = defaultdict(list)
    for r in records:
        by_source[r["source"] or "-"].append(r)
    rows = {src: summarize(rs, [r["sampled"] for r in rs], k) for src, rs in by_source.items()}
    return summarize(records, [r["sampled"] for r in records], k), rows


def format_table(rows):
    """Rows {name: {column: value}} -> an aligned text table (columns from the first row)."""
    columns = list(next(iter(rows.values())).keys())
    header = ["benchmark"] + columns
    lines = [[name] + [f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()]
             for name, row in rows.items()]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*line) for line in lines])


def eval_context(model_path, problems, args, template="", chat_kwargs=None):
    """vLLM's max_model_len for this evaluation: --max_model_len, or the longest prompt (with
    the template, prompt format and chat-template arguments) plus --max_tokens, so that every
    answer may reach --max_tokens. A given context too short for that is an error, not a silent cut."""
    from transformers import AutoTokenizer  # lazy: transformers takes seconds to import

    from rollout import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    longest = max(len(encode_prompt(tokenizer, problem_messages(p, template, fmt=args.prompt_format), chat_kwargs))
                  for p in problems)
    need = longest + args.max_tokens
    if args.max_model_len and args.max_model_len < need:
        raise SystemExit(f"--max_model_len={args.max_model_len} cannot hold the longest prompt ({longest} tokens) "
                         f"and --max_tokens={args.max_tokens}: answers would be cut; use at least {need} (or 0)")
    return args.max_model_len or need


# Settings a run's checkpoint (train_config.json, or trainer.pt of older runs) passes on to its
# evaluation unless given as flags: answers are scored as the model was trained to give them.
INHERITED = {"prompt_format": "default", "chat_template_kwargs": "", "max_tokens": 256, "temperature": 0.6,
             "top_p": 1.0, "reward": "ours"}


def training_settings(model):
    """The settings of the run that wrote the checkpoint folder `model` ({} for anything else)."""
    file = os.path.join(model, TRAIN_CONFIG)
    if os.path.isfile(file):
        return json.load(open(file))
    if os.path.isfile(os.path.join(model, "trainer.pt")):  # written before train_config.json existed
        return torch.load(os.path.join(model, "trainer.pt"), map_location="cpu", weights_only=False,
                          mmap=True).get("config", {})
    return {}


def inherit_settings(args):
    """Fill every INHERITED flag left unset: from the checkpoint's run when it has the setting,
    else the default. Returns {setting: value} of what came from the checkpoint."""
    saved = training_settings(args.model) if os.path.isdir(args.model) else {}
    taken = {}
    for name, default in INHERITED.items():
        if getattr(args, name) is None:
            if name in saved:
                taken[name] = saved[name]
            setattr(args, name, saved.get(name, default))
    return taken


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="HF id, local folder, or the shipped default")
    ap.add_argument("--data", default="builtin-test", help="comma-separated names or .jsonl paths")
    ap.add_argument("--k", type=int, default=None, help="samples per problem (default: the paper's protocol, docs/METHOD.md §6)")
    def inherited(name):
        return f" (default: the checkpoint's training setting, else {INHERITED[name] or 'none'})"
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature" + inherited("temperature"))
    ap.add_argument("--top_p", type=float, default=None, help="nucleus sampling" + inherited("top_p"))
    ap.add_argument("--max_tokens", type=int, default=None, help="answer tokens" + inherited("max_tokens"))
    ap.add_argument("--prompt_format", default=None, choices=FORMATS, help="as train.py's" + inherited("prompt_format"))
    ap.add_argument("--chat_template_kwargs", default=None, help="JSON for the chat template, e.g. "
                    "'{\"enable_thinking\": false}'" + inherited("chat_template_kwargs"))
    ap.add_argument("--reward", default=None, help="the reward rule, as train.py's: ours | official | "
                    "module:function"
                    + inherited("reward"))
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--dtype", default="", help="the engine's weights: bfloat16 | float16 | float32 | auto; "
                    "default bfloat16, float32 on a CPU without bf16 instructions (emulated bf16: slower)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--template", default="", help="a template applied to every problem: TEXT, or @PATH (the "
                    "file's first template, one per line as train.py's --seed_templates)")
    ap.add_argument("--max_model_len", type=int, default=0, help="vLLM context; 0: the longest prompt of the data + "
                    "--max_tokens, so that no answer is cut short by the context")
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.9, help="GPU: share of the GPU vLLM may "
                    "take (eval runs alone; train.py's engine shares the GPU with the trainer)")
    ap.add_argument("--enforce_eager", action="store_true", help="GPU: vLLM without CUDA graphs (starts faster)")
    ap.add_argument("--skip_bad", action="store_true", help="skip malformed data rows (counted)")
    ap.add_argument("--verbose", action="store_true", help="engine and library logs on the console (else in "
                    "<out>.engine.log)")
    ap.add_argument("--out", default=None, help="results JSON (default out/eval-<time>.json)")
    args = ap.parse_args(argv)
    args.out = args.out or os.path.join("out", f"eval-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return args


def load_inputs(args):
    """Settings, model and data checked before any engine starts -> (benchmarks, template, chat
    kwargs), or a one-line error (DataError, SystemExit)."""
    taken = inherit_settings(args)
    if taken and dist.is_main():
        print(f"settings of the run that trained {args.model} (flags override): "
              + ", ".join(f"--{k}={v!r}" for k, v in taken.items()))
    chat_kwargs = chat_template_kwargs(args)
    check_model(args.model)
    benchmarks = {}
    for name in args.data.split(","):
        problems, skipped = load_jsonl(name, skip_bad=args.skip_bad)
        if skipped:
            print(f"{name}: skipped {skipped} bad rows", file=sys.stderr)
        benchmarks[name] = problems
    try:  # the reward: it loads, and scores the first problem's gold answer (one line, as train.py)
        reward_scorer(args, next((ps for ps in benchmarks.values() if ps), []))
    except SystemExit as e:
        raise ValueError(str(e)) from None
    template = args.template
    if template.startswith("@"):
        template = read_seed_templates(template[1:], max_chars=10_000)[0]
    return benchmarks, template, chat_kwargs


def make_engine(args, benchmarks, template, chat_kwargs, rank):
    """One engine a process (torchrun: one a rank), its context sized for every benchmark. A LoRA
    run's checkpoint or export on vLLM: the base, serving the adapters as vLLM's LoRA (lora.served_adapter)."""
    adapter = lora.served_adapter(args.model) if args.backend == "vllm" and os.path.isdir(args.model) else None
    model_path = lora.base_of(args.model) if adapter else resolve_model(args.model)
    options = {"rank": rank, "chat_template_kwargs": chat_kwargs or None}  # seeded samples differ between ranks
    if args.backend == "vllm":
        every_problem = [p for ps in benchmarks.values() for p in ps]
        options.update(external_launcher=dist.active(), enforce_eager=args.enforce_eager, progress_bars=args.verbose,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       max_model_len=eval_context(model_path, every_problem, args, template, chat_kwargs))
    state = lora.read_adapter(adapter) if adapter else None
    if state:
        options["lora_rank"] = state[1]
    engine = make_rollout(args.backend, model_path, dtype=args.dtype or default_engine_dtype(), seed=args.seed,
                          **options)
    if state:
        engine.push_adapters(*state)
    return engine


def main(argv=None):
    args = parse_args(argv)
    try:  # validate settings, model and every data file before spending minutes on an engine
        benchmarks, template, chat_kwargs = load_inputs(args)
    except (DataError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # under torchrun each rank answers every world-th problem with its own engine; rank 0 merges and writes
    rank, world, _ = dist.setup("cuda" if torch.cuda.is_available() else "cpu")
    if not args.verbose:  # vLLM's and transformers' lines go to <out>.engine.log
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        route_library_logs(os.path.dirname(os.path.abspath(args.out)), rank,
                           name=os.path.splitext(os.path.basename(args.out))[0] + ".engine.log")
    engine = make_engine(args, benchmarks, template, chat_kwargs, rank)
    results, all_records, table = {}, {}, {}
    for name, problems in benchmarks.items():
        k = default_k(len(problems)) if args.k is None else args.k
        if dist.is_main():
            print(f"{name}: {len(problems)} problems, greedy" + (f" + {k} samples at T={args.temperature}" if k else "")
                  + f", up to {args.max_tokens} tokens" + (f", over {world} processes" if world > 1 else ""))
        mine = answer_records(engine, dist.split(problems, rank, world), k, args.temperature, args.top_p,
                              args.max_tokens, seed=args.seed, prompt_format=args.prompt_format,
                              template=template, reward=args.reward)
        records = dist.unsplit(dist.gather_objects(mine))  # every problem once, in data order
        overall, by_source = summarize_records(records, k)
        results[name] = {"k": k, "temperature": args.temperature, "overall": overall, "by_source": by_source}
        all_records[name] = records
        table[name] = overall
        if len(by_source) > 1:
            table.update({f"  {src}": row for src, row in by_source.items()})

    if dist.active() and hasattr(engine, "close"):  # vLLM's subgroups go before the group itself
        engine.close()
    if dist.is_main():
        print(format_table(table))
        write_results(args, results, all_records)
    dist.teardown()
    return 0


def write_results(args, results, all_records):
    """--out (the numbers and the settings used) and, beside it, the per-sample JSONL."""
    out = args.out
    with open(out, "w") as f:
        json.dump({"model": args.model, "config": vars(args), "results": results}, f, indent=2)
    samples_path = os.path.splitext(out)[0] + ".samples.jsonl"
    with open(samples_path, "w") as f:
        for name, records in all_records.items():
            for r in records:
                f.write(json.dumps({"benchmark": name, **r}) + "\n")
    print(f"wrote {out} and {samples_path}")


if __name__ == "__main__":
    sys.exit(main())
