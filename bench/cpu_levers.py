"""The engine-call levers of issue 25, each measured old against new, side by side in one run.

    python bench/cpu_levers.py                        # default model, bf16 engine (AMX CPUs)
    python bench/cpu_levers.py --dtype=float32        # CPUs without bf16 kernels (AMD EPYC, ...)

One vLLM engine, the default run's settings (max_tokens 128, temperature 0.6, eval_k 4, GEPA
W = 4 parents x b = 3 items). Each lever runs its old and its new call pattern alternately,
--rounds times each, and prints the median times and the ratio new/old:
  dev evaluation   old: greedy answers, then k samples (two engine calls, each as long as its
                   longest answer); new: scoring.answer_sets, one call (samples first, greedy after)
  GEPA answers     old: one call per template (W calls of b prompts, as gepa.propose made for the
                   parents' minibatches and again for the children's); new: one call of W x b prompts
Also printed: whether the greedy answers of old and new are identical (they should be: greedy
decoding does not depend on the rest of the batch, up to float rounding), and the sampled
scores of both (the samples themselves differ: vLLM-CPU draws from one global generator).
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data import load_jsonl  # noqa: E402
from scoring import answer_sets, score_groups, summarize_records  # noqa: E402
from model import resolve_model  # noqa: E402
from prompts import problem_messages  # noqa: E402
from rollout import VLLMRollout  # noqa: E402

TEMPLATES = ["", "Work step by step and check the arithmetic.", "First find the quantity asked for.",
             "Write the equation, then solve it."]  # GEPA parents: W = 4 templates


def dev_old(engine, problems, k, seed):
    """The two calls scoring.answer_sets made before issue 25."""
    messages = [problem_messages(p) for p in problems]
    greedy = engine.generate(messages, n=1, temperature=0.0, max_tokens=128)
    sampled = engine.generate(messages, n=k, temperature=0.6, max_tokens=128, seed=seed)
    g, s = score_groups(problems, messages, greedy), score_groups(problems, messages, sampled)
    return [{**a, "sampled": b} for a, b in zip(g, s)]


def dev_new(engine, problems, k, seed):
    return answer_sets(engine, [(problems, "", k)], temperature=0.6, max_tokens=128, progress=False, seed=seed)[0]


def gepa_old(engine, batches):
    return [engine.generate([problem_messages(p, t) for p in mb], n=1, temperature=0.0, max_tokens=128)
            for t, mb in zip(TEMPLATES, batches)]


def gepa_new(engine, batches):
    out = iter(engine.generate([problem_messages(p, t) for t, mb in zip(TEMPLATES, batches) for p in mb], n=1,
                               temperature=0.0, max_tokens=128))
    return [[next(out) for _ in mb] for mb in batches]


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eval_k", type=int, default=4)
    args = ap.parse_args()
    engine = VLLMRollout(resolve_model(args.model), dtype=args.dtype, max_model_len=1024)
    dev = load_jsonl("builtin-dev")[0]
    train = load_jsonl("builtin-train")[0]
    engine.generate([problem_messages(p) for p in dev[:4]], n=1, temperature=0.0, max_tokens=8)  # warm-up
    times = {name: [] for name in ("dev old", "dev new", "gepa old", "gepa new")}
    same_greedy, scores = True, {"dev old": [], "dev new": []}
    for r in range(args.rounds):
        batches = [train[(r * 12 + 3 * i) % len(train):][:3] for i in range(len(TEMPLATES))]
        for name, fn, inputs in (("dev old", dev_old, (dev, args.eval_k, r)), ("dev new", dev_new, (dev, args.eval_k, r)),
                                 ("gepa old", gepa_old, (batches,)), ("gepa new", gepa_new, (batches,))):
            seconds, out = timed(fn, engine, *inputs)
            times[name].append(seconds)
            if name.startswith("dev"):
                scores[name].append(summarize_records(out, args.eval_k)[0])
                greedy = [rec["responses"] for rec in out]
                same_greedy &= name == "dev old" or greedy == previous
                previous = greedy
            else:
                texts = [g[0].text for mb in out for g in mb]
                same_greedy &= name == "gepa old" or texts == previous
                previous = texts
            print(f"round {r}: {name:8s} {seconds:6.2f} s")
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"{len(dev)} dev problems x (greedy + {args.eval_k} samples); GEPA {len(TEMPLATES)} templates x 3 items; "
          f"{args.dtype} engine; medians of {args.rounds}")
    for lever in ("dev", "gepa"):
        print(f"{lever:4s}: old {med[f'{lever} old']:6.2f} s, new {med[f'{lever} new']:6.2f} s, "
              f"ratio new/old {med[f'{lever} new'] / med[f'{lever} old']:.3f}")
    for name in scores:
        print(f"{name}: greedy " + ", ".join(f"{s['greedy']:.3f}" for s in scores[name]) +
              f"; avg@{args.eval_k} " + ", ".join(f"{s[f'avg@{args.eval_k}']:.3f}" for s in scores[name]))
    print(f"greedy answers identical, old vs new: {same_greedy}")


if __name__ == "__main__":
    main()
