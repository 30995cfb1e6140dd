"""Evaluate a model on one or more benchmarks: greedy accuracy, avg@k, unbiased pass@k and maj@k.

    python eval.py                                         # default model, built-in test split
    python eval.py --model=runs/<run>/latest --data=aime24,math500 --out=out/eval.json
    python eval.py --data=builtin-test --k=16 --temperature=0.6
    torchrun --nproc_per_node=8 eval.py --model=Qwen/Qwen3-4B --data=aime24   # one engine per GPU, rank 0 writes

Protocol (the paper's; docs/METHOD.md §6): a benchmark with fewer than 100 problems is scored by avg@16 at
temperature 0.6, a larger one greedily; `--k` overrides (0 = greedy only). Greedy accuracy is
always reported. pass@j uses the unbiased estimator 1 - C(n-c, j) / C(n, j) over the k samples
(Chen et al. 2021); maj@k is majority voting over the k samples' answers (scoring.py).
Rows are also broken down by their `source` (the built-in task's levels).

A LoRA run's checkpoint (a PEFT adapter folder) or export is served on vLLM as its base with the
adapters as vLLM's LoRA, unmerged, as training sampled it; the HF backend merges it into its base
in fp32 (model.merged_folder, once, cached). A run's checkpoint or export (runs/<run>/latest, export-NNNNNN) is evaluated as it was trained:
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
import math
import os
import sys
import time

import torch

import dist
import lora
from config import chat_template_kwargs, default_engine_dtype
from data import DataError, load_jsonl
from gepa import read_seed_templates
from model import base_of, check_model, resolve_model, served_adapter
from prompts import FORMATS, encode_prompt, problem_messages
from rollout import make_rollout
from runs import TRAIN_CONFIG, route_library_logs
from scoring import ScoringError, answer_records, default_k, summarize_records
from verify import reward_scorer, take_failures

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
    answer may reach --max_tokens. A given context too short for that is an error, not a silent cut;
    so is a problem that does not fit the model's positions with --max_tokens (named)."""
    from transformers import AutoConfig, AutoTokenizer  # lazy: transformers takes seconds to import

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    lengths = [len(encode_prompt(tokenizer, problem_messages(p, template, fmt=args.prompt_format), chat_kwargs))
               for p in problems]
    longest = max(lengths)
    need = longest + args.max_tokens
    positions = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    if positions and need > positions:
        name = problems[lengths.index(longest)].id
        raise SystemExit(f"problem {name} ({longest:,} prompt tokens) + --max_tokens={args.max_tokens} needs "
                         f"{need:,} positions, over the model's {positions:,}: shorten it, drop it, or lower --max_tokens")
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
    ap.add_argument("--reward_timeout", type=float, default=60.0, help="seconds a custom --reward may take on one "
                    "response (0 = no bound)")
    ap.add_argument("--reward_errors", default="stop", choices=["stop", "zero"], help="a custom --reward that "
                    "raises, times out or returns no number: stop (the answers generated so far are kept) | zero "
                    "(scores 0, counted)")
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
    every_problem = [p for ps in benchmarks.values() for p in ps]
    try:  # both backends: a problem the model cannot hold is named here, before any engine
        args.context = eval_context(engine_model(args)[0], every_problem, args, template, chat_kwargs)
    except SystemExit as e:
        raise ValueError(str(e)) from None
    return benchmarks, template, chat_kwargs


def engine_model(args):
    """(the folder an engine loads, the adapter it serves or None): a LoRA run's checkpoint or export on vLLM is
    its base serving the adapters as vLLM's LoRA (model.served_adapter)."""
    adapter = served_adapter(args.model) if args.backend == "vllm" and os.path.isdir(args.model) else None
    return (base_of(args.model) if adapter else resolve_model(args.model)), adapter


def make_engine(args, benchmarks, template, chat_kwargs, rank):
    """One engine a process (torchrun: one a rank), its context sized for every benchmark (load_inputs measured
    it). A LoRA run's checkpoint or export on vLLM: the base, serving the adapters (engine_model)."""
    model_path, adapter = engine_model(args)
    options = {"rank": rank, "chat_template_kwargs": chat_kwargs or None}  # seeded samples differ between ranks
    if args.backend == "vllm":
        context = getattr(args, "context", None) or eval_context(
            model_path, [p for ps in benchmarks.values() for p in ps], args, template, chat_kwargs)
        options.update(external_launcher=dist.active(), enforce_eager=args.enforce_eager, progress_bars=args.verbose,
                       gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=context)
    state = lora.read_adapter(adapter) if adapter else None
    if state:
        options["lora_rank"] = state[1]
    engine = make_rollout(args.backend, model_path, dtype=args.dtype or default_engine_dtype(), seed=args.seed,
                          **options)
    if state:
        engine.push_adapters(*state)
    return engine


def check_out(out):
    """--out names a file that can be written (its folder made if missing): a one-line reason, or None."""
    if os.path.isdir(out) or out.endswith(("/", os.sep)):
        return f"--out={out} is a folder; give a file name, e.g. {os.path.join(out, 'eval.json')}"
    folder = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        return f"--out={out}: cannot make its folder {folder} ({e.strerror})"
    if not os.access(folder, os.W_OK):
        return f"--out={out}: its folder {folder} is not writable"
    return None


def main(argv=None):
    args = parse_args(argv)
    bad = check_out(args.out) or next((f"--{k} must be a finite number, got {v}" for k, v in vars(args).items()
                                       if isinstance(v, float) and not math.isfinite(v)), None)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
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
        try:
            mine, failure = answer_records(engine, dist.split(problems, rank, world), k, args.temperature, args.top_p,
                                           args.max_tokens, seed=args.seed, prompt_format=args.prompt_format,
                                           template=template, reward=args.reward), None
        except ScoringError as e:  # the reward failed: keep what was generated, say where
            mine, failure = e.generated, e
        if dist.all_max(int(failure is not None)):  # every rank takes this branch: none is left waiting in a gather
            return stop_unscored(args, name, rank, failure, mine, results, all_records, engine)
        records = dist.unsplit(dist.gather_objects(mine))  # every problem once, in data order
        overall, by_source = summarize_records(records, k)
        results[name] = {"k": k, "temperature": args.temperature, "overall": overall, "by_source": by_source}
        failed = dist.all_sum(take_failures())  # --reward_errors=zero: calls scored 0, every rank's
        if failed:
            results[name]["reward_failures"] = failed
            if dist.is_main():
                print(f"WARNING: {name}: {failed} calls of the custom --reward failed (raised, timed out or returned "
                      "no number) and scored 0 (--reward_errors=zero)")
        all_records[name] = records
        table[name] = overall
        if len(by_source) > 1:
            table.update({f"  {src}": row for src, row in by_source.items()})

    if dist.active() and hasattr(engine, "close"):  # vLLM's subgroups go before the group itself
        engine.close()
    if dist.is_main():
        print(format_table(table))
        if any("reward_max" in row for row in table.values()):
            print("note: rewards outside [0, 1] (reward_min, reward_max): greedy, avg@k and maj@k are mean rewards, "
                  "not accuracies; pass@k counts a reward > 0 as solved")
        write_results(args, results, all_records)
    dist.teardown()
    return 0


def stop_unscored(args, name, rank, failure, mine, results, all_records, engine):
    """Scoring failed on `name` (on this rank: `failure`, else on another rank): this rank's answers to it go to
    <out>.unscored[.rank-R].jsonl (unscored where its reward failed, scored otherwise); the benchmarks finished
    before it are written to --out as usual, with "stopped_at": name. Exit status 1."""
    path = os.path.splitext(args.out)[0] + ".unscored" + (f".rank-{rank}" if dist.active() else "") + ".jsonl"
    with open(path, "w") as f:
        for row in mine:
            f.write(json.dumps({"benchmark": name, **row}) + "\n")
    main_rank = dist.is_main()
    if main_rank and results:
        write_results(args, results, all_records, stopped_at=name)
    if dist.active() and hasattr(engine, "close"):
        engine.close()
    dist.teardown()
    what = f"error: {failure}" if failure else "error: another rank's --reward failed"
    print(f"{what}; {len(mine)} prompts' answers generated for {name} are in {path}" + (", unscored" if failure else "")
          + (f"; the finished benchmarks are in {args.out}" if results and main_rank else ""), file=sys.stderr)
    return 1


def write_results(args, results, all_records, stopped_at=None):
    """--out (the numbers and the settings used) and, beside it, the per-sample JSONL. `stopped_at`: the benchmark
    whose scoring failed (stop_unscored), recorded so that a partial file is never read as a whole one."""
    out = args.out
    with open(out, "w") as f:
        json.dump({"model": args.model, "config": vars(args), "results": results,
                   **({"stopped_at": stopped_at} if stopped_at else {})}, f, indent=2)
    samples_path = os.path.splitext(out)[0] + ".samples.jsonl"
    with open(samples_path, "w") as f:
        for name, records in all_records.items():
            for r in records:
                f.write(json.dumps({"benchmark": name, **r}) + "\n")
    print(f"wrote {out} and {samples_path}")


if __name__ == "__main__":
    sys.exit(main())
