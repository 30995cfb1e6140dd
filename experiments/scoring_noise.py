"""How much a score moves with the test-time sampling alone. experiments/compare.py scores every
checkpoint with one sampling seed (common random numbers), so two runs with equal weights score
alike and their sampling noise is drawn once; this scores one checkpoint (by default the
starting model) on a task's sets, with compare.py's scorer, under several sampling seeds.

    python experiments/scoring_noise.py --task=fictional --seeds=0,1,2,3,4 --dtype=float32

Seed 0 is the draw compare.py used (for the starting model: results/compare/<task>/untrained).
Writes --out (JSON: every seed's scores per set, and their mean, sd, min and max) and prints a table.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import SHARED, TASKS, Scorer, first_template, score_sets  # noqa: E402  (puts the root on sys.path)
from data import load_jsonl  # noqa: E402
from model import resolve_model  # noqa: E402
from runs import write_atomic  # noqa: E402


def spread(scores, seeds):
    """{set: {metric: {"mean", "sd", "min", "max"}}} over the seeds' {set: {"overall": {metric: x}}}."""
    out = {}
    for name, first in scores[seeds[0]].items():
        out[name] = {}
        for metric in first["overall"]:
            xs = [scores[s][name]["overall"][metric] for s in seeds]
            out[name][metric] = {"mean": statistics.mean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
                                 "min": min(xs), "max": max(xs)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="fictional", help=", ".join(TASKS))
    ap.add_argument("--model", default="smollm2-135m", help="the starting model, or a checkpoint folder")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated sampling seeds")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--k_templated", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max_tokens", type=int, default=SHARED["max_tokens"])
    ap.add_argument("--dtype", default="", help="the engine's dtype ('' = the machine's default, as compare.py)")
    ap.add_argument("--backend", default="vllm", choices=("vllm", "hf"))
    ap.add_argument("--out", default="", help="default results/compare/scoring-noise/<task>.json")
    args = ap.parse_args(argv)
    task, seeds = TASKS[args.task], [int(s) for s in args.seeds.split(",")]
    sets = score_sets(task, load_jsonl(task.test)[0], load_jsonl(task.heldout)[0] if task.heldout else [],
                      first_template(task.seed_templates), args.k, args.k_templated)
    model = resolve_model(os.path.abspath(args.model) if os.path.exists(args.model) else args.model)
    scorer = Scorer(args.backend, args.temperature, args.max_tokens, args.dtype)
    scores = {seed: scorer(model, sets, seed=seed)[0] for seed in seeds}
    result = {"task": args.task, "model": args.model, "seeds": seeds, "k": args.k, "k_templated": args.k_templated,
              "temperature": args.temperature, "max_tokens": args.max_tokens, "scores": scores,
              "spread": spread(scores, seeds)}
    out = args.out or os.path.join("results", "compare", "scoring-noise", f"{args.task}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    text = json.dumps(result, indent=1)
    write_atomic(out, lambda tmp: open(tmp, "w").write(text))
    print("| set | metric | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | sd |")
    print("|---|---|" + "---|" * (len(seeds) + 2))
    for name, metrics in result["spread"].items():
        for metric, st in metrics.items():
            print(f"| {name} | {metric} | " + " | ".join(f"{scores[s][name]['overall'][metric]:.3f}" for s in seeds)
                  + f" | {st['mean']:.3f} | {st['sd']:.3f} |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
