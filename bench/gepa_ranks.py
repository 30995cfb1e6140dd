"""One GEPA round answered by one process against the same round shared over two, side by side.

    python bench/gepa_ranks.py               # the shipped model on vLLM-CPU, train.py's GEPA defaults, 2 rounds
    python bench/gepa_ranks.py --hard=8 --dev=4 --budget=30 --max_tokens=32 --rounds=1   # a quick check

Each arm runs train.gepa_round exactly as train.end_epoch does, in a fresh child: alone
(`python bench/gepa_ranks.py --child`), and under `torchrun --nproc_per_node=2`, where rank 0
searches and reflects and every rank's engine answers its share of each call (dist.shared_map;
rank 1 sits in dist.serve). Arms alternate for --rounds rounds, so the machine's drift falls on
both alike. Timed: the round alone (engines are started and warm before the clock starts).

What a child gets: --hard problems of --data as the round's hard set, train.py's GEPA defaults
(budget 200 metric calls, W 4, b 3, so 97 dev items), its answers greedy with --max_tokens, the reflector --reflector (init: Self-Ref, the starting weights swapped into rank
0's engine for each reflection and the policy pushed back, as in train.py; here both are the
starting model, but each push is made and verified), and the search settings below.

Printed: each arm's round seconds and the part spent in answer calls, the answers each rank gave,
whether the archives are equal,
how many (template, problem) answers differ between the arms (greedy answers are a function of
the prompt only if the engine's logits do not depend on the batch; a differing answer is a flip),
and the ratios one-process / two-process time of the answer calls and of the round (> 1: sharing is
faster; the round's reflection, its Self-Ref pushes and the search stay on rank 0).

Every engine runs on one core (OMP_NUM_THREADS=1, which torchrun sets for two processes anyway):
one process on one core against two on two, the CPU's picture of one GPU against two. The thread
count matters beyond speed: a vLLM-CPU engine on two threads samples the reflector's text
differently (float reductions in another order), so a one-process arm on two threads grows
another archive from the first reflection on, while its greedy answers agree. docs/GPU.md gives
the arithmetic for a node.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def settings(args):
    import train

    return train.Config(model=args.model, backend=args.backend, max_tokens=args.max_tokens, reflector=args.reflector,
                        gepa_budget=args.budget, gepa_dev_max=args.dev, gepa_parents=args.parents,
                        gepa_minibatch=3, seed=args.seed, dev_data="")


def child(args):
    """One arm: start this rank's engine, run the round, write rank 0's record to --out."""
    import dist
    import rollout
    import train
    from config import chat_template_kwargs, cpu_precision
    from rollout import context_length
    from data import load_jsonl
    from model import resolve_model
    from verify import REWARDS

    cfg = settings(args)
    rank, world, _ = dist.setup("cpu", timeout_minutes=60)
    cfg.engine_dtype, _, _ = cpu_precision(cfg, "cpu")
    hard = load_jsonl(args.data)[0][:args.hard]
    model_path = resolve_model(cfg.model)
    chat = chat_template_kwargs(cfg)
    if cfg.backend == "vllm":
        from transformers import AutoTokenizer

        length = context_length(cfg, AutoTokenizer.from_pretrained(model_path), hard, chat)
        engine = rollout.make_rollout("vllm", model_path, dtype=cfg.engine_dtype, seed=cfg.seed, max_model_len=length,
                                      chat_template_kwargs=chat, external_launcher=dist.active(), progress_bars=False,
                                      rank=rank)
    else:
        engine = rollout.make_rollout("hf", model_path, chat_template_kwargs=chat, rank=rank)
    answered, calls, answering = Counter(), [], [0.0]
    shared_map = dist.shared_map

    def recording(fn, items):  # rank 0: each call's prompts, the answers that came back, its seconds
        t = time.perf_counter()
        out = shared_map(fn, items)
        answering[0] += time.perf_counter() - t
        calls.append([[m[-1]["content"], text] for m, (text, _, _) in zip(items, out)])
        return out
    dist.shared_map = recording
    answer = rollout.greedy_answers(engine, cfg.max_tokens)

    def counting(prompts):  # this rank's share
        answered["items"] += len(prompts)
        answered["calls"] += 1
        return answer(prompts)
    dist.barrier()
    started = time.perf_counter()
    if rank == 0:
        counts = Counter()
        weights = None
        if cfg.reflector == "init":
            from transformers import AutoModelForCausalLM

            weights = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
        reflector = rollout.make_reflector(cfg, engine, model_path, weights, counts)
        train.greedy_answers = lambda engine, max_tokens: counting
        with dist.leading():  # the others answer until the round ends; if it fails, they raise its error
            result = train.gepa_round(cfg, 0, hard, engine, reflector, counts,
                                      lambda text, p: REWARDS[cfg.reward](text, p.answer))
    else:
        dist.serve(counting)
    seconds = time.perf_counter() - started
    shares = dist.gather_objects(dict(answered))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"seconds": seconds, "answer_seconds": answering[0], "world": world, "shares": shares, "archive": result.to_json(),
                       "calls": calls, "counts": dict(counts)}, f)
    dist.barrier()
    if cfg.backend == "vllm":
        engine.close()
    dist.teardown()


def launch(args, world, out):
    flags = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("child", "out", "rounds")]
    cmd = [os.path.abspath(__file__), "--child", f"--out={out}", *flags]
    if world > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *cmd]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # one core an engine in both arms (torchrun sets it so for 2): one device vs two
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{world}-process arm failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    with open(out) as f:
        return json.load(f)


def flips(a, b):
    """(template+problem) prompts answered differently by the two arms, of those both made."""
    answers = [{prompt: text for call in arm["calls"] for prompt, text in call} for arm in (a, b)]
    common = answers[0].keys() & answers[1].keys()
    return sum(answers[0][k] != answers[1][k] for k in common), len(common)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--backend", default="vllm", choices=("vllm", "hf"))
    parser.add_argument("--data", default="builtin-train")
    parser.add_argument("--hard", type=int, default=120, help="problems in the round's hard set")
    parser.add_argument("--dev", type=int, default=300, help="gepa_dev_max (the budget caps it: 97 at 200)")
    parser.add_argument("--budget", type=int, default=200, help="gepa_budget (metric calls)")
    parser.add_argument("--parents", type=int, default=4, help="gepa_parents (W)")
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--reflector", default="init", choices=("init", "policy"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    times, answering, last = {1: [], 2: []}, {1: [], 2: []}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for world in (1, 2):
                last[world] = launch(args, world, os.path.join(tmp, f"w{world}-r{r}.json"))
                times[world].append(last[world]["seconds"])
                answering[world].append(last[world]["answer_seconds"])
                print(f"round {r} {world} process(es): {last[world]['seconds']:.1f} s, of which answer calls "
                      f"{last[world]['answer_seconds']:.1f} s; answers per rank "
                      f"{[s.get('items', 0) for s in last[world]['shares']]}", flush=True)
    one, two = last[1], last[2]
    flipped, compared = flips(one, two)
    same = one["archive"] == two["archive"]
    ratio = statistics.median(times[1]) / statistics.median(times[2])
    answer_ratio = statistics.median(answering[1]) / statistics.median(answering[2])
    serial = statistics.median(t - a for t, a in zip(times[1], answering[1])) / statistics.median(times[1])
    print(f"metric calls {one['archive']['metric_calls']} (1 process) / {two['archive']['metric_calls']} (2); "
          f"reflections {one['archive']['reflection_calls']} / {two['archive']['reflection_calls']}")
    print(f"archives equal: {same}; greedy answers that differ between the arms: {flipped} of {compared}")
    print(f"answer calls' time 1 process / 2 processes: {answer_ratio:.2f}; the rest of the round (reflection, "
          f"its weight pushes, rewards, the search) is {serial:.0%} of the one-process round and runs on rank 0 alone")
    print(f"round time 1 process / 2 processes (median of {args.rounds}): {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "seconds": times, "answer_seconds": answering, "ratio": ratio,
                       "answer_ratio": answer_ratio, "serial_share": serial, "archives_equal": same,
                       "flips": flipped, "compared": compared,
                       "shares": {w: last[w]["shares"] for w in (1, 2)},
                       "metric_calls": [one["archive"]["metric_calls"], two["archive"]["metric_calls"]]}, f, indent=1)
    return {"ratio": ratio, "answer_ratio": answer_ratio, "archives_equal": same, "flips": flipped, "one": one,
            "two": two}


if __name__ == "__main__":
    main()
