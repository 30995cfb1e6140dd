"""LoRA against full fine-tuning on one configuration, side by side: training memory, step time,
checkpoint size and push time.

    python bench/lora_vs_full.py                       # the shipped model, CPU; ranks 8 and 32, 2 rounds
    python bench/lora_vs_full.py --device=cuda --model=Qwen/Qwen3-1.7B --groups=8 --response=1024   # a GPU

Training: each arm (full, LoRA at each --ranks) runs in its own child process, alternating
full -> LoRA r -> ... for --rounds rounds, so each peak is its own and the machine's drift falls
on every arm alike. A child loads the policy exactly as train.py does (rollout.load_models: fp32
master weights, or a frozen base in the training dtype with fp32 adapters), builds train.py's
AdamW over what trains, and runs train.policy_update on the same synthetic step (--groups
prompts x --k responses of --response tokens, advantages +-1) once as a warm-up and --steps
times timed. Memory: CPU, peak RSS minus the RSS just before the model loaded (the libraries
are the same in every arm); CUDA, torch's peak allocated bytes. Then one checkpoint through
runs.save_checkpoint (what a resume needs) is written and measured.

Push: one child holds one engine (vLLM with LoRA on, as train.py starts it for --lora_rank;
--push_backend=hf for a GPU machine without vLLM) and pushes, alternately, the full model's
parameters and a LoRA policy as train.py does (lora.push_policy: on vLLM the adapters alone, on
HF the merged weights), --push_repeats times each; both verified as in training.

The last lines are the ratios LoRA / full of one run (the issue's goals: memory <= 0.5, checkpoint
<= 0.05, step time <= 1.0). A checkpoint's ratio is about the trained share of the parameters
(12 bytes a trained parameter either way, plus the tokenizer), so it depends on rank and model shape.
"""

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def config(args, rank):
    import train
    from config import cpu_precision

    cfg = train.Config(model=args.model, device=args.device, micro_batch_size=args.micro_batch, lr=1e-6,
                       group_size=args.k, max_tokens=args.response, lora_rank=rank,
                       gradient_checkpointing=args.gradient_checkpointing, dev_data="")
    cfg.engine_dtype, cfg.autocast_bf16, _ = cpu_precision(cfg, args.device)  # as train.start_run decides
    return cfg


def synthetic_rows(args, vocab):
    """--groups prompts x --k responses (fixed random ids), advantages +1/-1 in each group."""
    import torch

    import train

    gen = torch.Generator().manual_seed(0)
    rows = []
    for g in range(args.groups):
        prompt = torch.randint(10, vocab, (args.prompt,), generator=gen).tolist()
        for j in range(args.k):
            response = torch.randint(10, vocab, (args.response,), generator=gen).tolist()
            rows.append(train.Row(prompt, response, 1.0 if j % 2 else -1.0, group=g))
    return rows


def run_train(args):
    import torch

    import rollout
    import runs
    import train
    from model import resolve_model

    cfg = config(args, args.lora_rank)
    device = torch.device(args.device)
    model_path = resolve_model(args.model)
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = rss_mb()
    policy, reference, tokenizer, _ = rollout.load_models(cfg, model_path, model_path, object(), device, [], {})
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=train.learning_rate(cfg))
    rows = synthetic_rows(args, policy.config.vocab_size)
    times = []
    for i in range(args.steps + 1):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        update = train.policy_update(policy, reference, optimizer, rows, cfg, pad_id=tokenizer.eos_token_id,
                                     n_groups=args.groups)
        if cuda:
            torch.cuda.synchronize()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t)
        assert update.finite and update.trained_rows == len(rows)
    memory = torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else peak_rss_mb() - before
    with tempfile.TemporaryDirectory() as out:
        trainer = {"config": dataclasses.asdict(cfg), "loop": {}, "world": 1, "optimizer": optimizer.state_dict()}
        t = time.perf_counter()
        path = runs.save_checkpoint(out, 1, policy, tokenizer, trainer)
        save_seconds = time.perf_counter() - t
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2 ** 20
    return {"step_seconds": times, "memory_mb": memory, "checkpoint_mb": size, "checkpoint_seconds": save_seconds,
            "trained": sum(p.numel() for p in trained), "parameters": sum(p.numel() for p in policy.parameters()),
            "autocast_bf16": cfg.autocast_bf16}


def run_push(args):
    """Alternate full and LoRA pushes into one engine; also time loading the starting weights,
    what full training's Self-Ref reflector does each GEPA round and LoRA's does not."""
    import torch
    from transformers import AutoModelForCausalLM

    import lora
    from model import resolve_model
    from rollout import make_rollout

    model_path = resolve_model(args.model)
    rank = max(args.ranks)
    cfg = config(args, rank)
    vllm = {"max_model_len": 512, "kv_cache_gib": 1, "lora_rank": rank}  # LoRA on: train.py's LoRA engine
    engine = make_rollout(args.push_backend, model_path, dtype=cfg.engine_dtype,
                          **(vllm if args.push_backend == "vllm" else {}))
    full = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(args.device)
    adapted = lora.load_policy(cfg, model_path, model_path, args.device)  # as train.py loads it
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 1e-3)
    times = {"full": [], "lora": [], "load_initial": []}
    for _ in range(args.push_repeats):
        for arm, model in (("full", full), ("lora", adapted)):  # what train_step pushes, either way
            t = time.perf_counter()
            lora.push_policy(engine, model)
            times[arm].append(time.perf_counter() - t)
        t = time.perf_counter()
        initial = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
        times["load_initial"].append(time.perf_counter() - t)
    unique = {v.untyped_storage().data_ptr(): v for v in initial.values()}.values()  # a tied head once
    initial_mb = sum(v.numel() * v.element_size() for v in unique) / 2 ** 20
    return {"seconds": times, "initial_mb": initial_mb, "rank": rank}


def child(args, role, extra):
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [sys.executable, __file__, f"--role={role}", f"--result={tmp.name}", *extra, *args.passthrough]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{role} {extra} failed:\n{proc.stderr[-3000:]}")
        return json.load(open(tmp.name))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ranks", default="8,32", help="LoRA ranks, each an arm")
    ap.add_argument("--groups", type=int, default=2, help="prompts in the step")
    ap.add_argument("--k", type=int, default=6, help="responses a prompt")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--response", type=int, default=128, help="response tokens")
    ap.add_argument("--micro_batch", type=int, default=6)
    ap.add_argument("--gradient_checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per child (after one warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--push_backend", default="vllm", choices=["vllm", "hf", "none"])
    ap.add_argument("--push_repeats", type=int, default=3)
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    ap.add_argument("--role", choices=["train", "push"], help=argparse.SUPPRESS)
    ap.add_argument("--lora_rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ranks = [int(r) for r in str(args.ranks).split(",")]
    if args.role:
        result = run_train(args) if args.role == "train" else run_push(args)
        json.dump(result, open(args.result, "w"))
        return
    args.passthrough = [a for a in sys.argv[1:] if not a.startswith(("--rounds", "--out", "--push_repeats"))]
    arms = {"full": 0, **{f"lora r{r}": r for r in args.ranks}}
    results = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm, rank in arms.items():
            res = child(args, "train", [f"--lora_rank={rank}"])
            results[arm].append(res)
            print(f"round {r} {arm:9s}: step s [{', '.join(f'{s:.2f}' for s in res['step_seconds'])}], "
                  f"memory {res['memory_mb']:.0f} MB, checkpoint {res['checkpoint_mb']:.1f} MB "
                  f"({res['checkpoint_seconds']:.2f} s), {res['trained']:,} of {res['parameters']:,} trained", flush=True)
    summary = {arm: {"step_s": statistics.median(s for res in rs for s in res["step_seconds"]),
                     "memory_mb": max(res["memory_mb"] for res in rs), "checkpoint_mb": rs[0]["checkpoint_mb"],
                     "trained_share": rs[0]["trained"] / rs[0]["parameters"]} for arm, rs in results.items()}
    push = child(args, "push", [f"--push_repeats={args.push_repeats}"]) if args.push_backend != "none" else None
    full = summary["full"]
    print(f"config: {args.model} on {args.device}, {args.groups} x {args.k} rows of {args.prompt} + {args.response} "
          f"tokens, micro-batch {args.micro_batch}, bf16 autocast {results['full'][0]['autocast_bf16']}, "
          f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}")
    if push:
        med = {k: statistics.median(v) for k, v in push["seconds"].items()}
        print(f"push ({args.push_backend}, LoRA r{push['rank']} merged vs full): {med['lora']:.2f} s vs {med['full']:.2f} s; "
              f"full training's Self-Ref loads the starting weights each round: {med['load_initial']:.2f} s, "
              f"{push['initial_mb']:.0f} MB (LoRA: adapters off, nothing loaded)")
    for arm, s in summary.items():
        if arm == "full":
            continue
        print(f"ratios {arm}/full: training memory {s['memory_mb'] / full['memory_mb']:.2f}, "
              f"step time {s['step_s'] / full['step_s']:.2f}, checkpoint {s['checkpoint_mb'] / full['checkpoint_mb']:.3f} "
              f"(trained share {s['trained_share']:.3f})"
              + (f", push time {med['lora'] / med['full']:.2f}" if push and arm == f"lora r{push['rank']}" else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "passthrough"}, "train": results,
                       "summary": summary, "push": push}, f, indent=1)


if __name__ == "__main__":
    main()
