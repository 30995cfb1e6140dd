"""bf16 against fp32 on this CPU, side by side in one run: the case for --cpu_fp32_fallback.

    python bench/cpu_precision.py             # default model; generation and a training step

On a CPU without bf16 instructions (no AVX512-BF16, no AMX: config.bf16_is_emulated) torch's and
vLLM's bf16 kernels convert to fp32 and back. Measured here, alternating bf16 / fp32 for
`--rounds` rounds:
  generation      vLLM engine with bfloat16 against float32 weights, each in its own child process
                  (one engine a process), the same --prompts dev prompts x --n samples of exactly
                  --new_tokens tokens (EOS ignored: the same work), after a warm-up call
  training step   the trainer's forward + backward (train.response_logprobs, fp32 master weights)
                  of --rows rows of --tokens tokens, under bf16 autocast against without
Prints the medians and the ratios fp32 / bf16 (below 1: fp32 is faster), and whether this CPU
has bf16 instructions.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def generation_child(args):
    """One engine of args.child's dtype: the seconds of one timed generate call, as JSON."""
    from data import load_jsonl
    from model import resolve_model
    from prompts import problem_messages
    from rollout import VLLMRollout

    engine = VLLMRollout(resolve_model(args.model), dtype=args.child, max_model_len=1024, progress_bars=False)
    messages = [problem_messages(p) for p in load_jsonl("builtin-dev")[0][:args.prompts]]
    engine.generate(messages[:2], n=1, temperature=0.0, max_tokens=8)  # warm-up
    t = time.perf_counter()
    groups = engine.generate(messages, n=args.n, temperature=0.6, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "tokens": sum(len(s.response_ids) for g in groups for s in g)}))


def generation_seconds(args, dtype):
    cmd = [sys.executable, os.path.abspath(__file__), f"--child={dtype}", f"--model={args.model}",
           f"--prompts={args.prompts}", f"--n={args.n}", f"--new_tokens={args.new_tokens}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the {dtype} generation child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def training_seconds(model, batch, bf16):
    import torch

    import train

    ids, attention, mask = batch
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        logp, _ = train.response_logprobs(model, ids, attention, mask, 1.0)
    logp.sum().backward()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return generation_child(args)

    import torch
    from transformers import AutoModelForCausalLM

    from config import bf16_is_emulated
    from model import resolve_model

    print(f"bf16 instructions on this CPU: {'no (bf16 is emulated)' if bf16_is_emulated('cpu') else 'yes'}")
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32).train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.rows, args.tokens), generator=gen)
    mask = torch.zeros(args.rows, args.tokens - 1, dtype=torch.bool)
    mask[:, args.tokens // 2:] = True  # the second half is the "response"
    batch = (ids, torch.ones_like(ids), mask)
    training_seconds(model, batch, False)  # warm-up
    training_seconds(model, batch, True)
    times = {k: [] for k in ("generate bfloat16", "generate float32", "train bf16", "train fp32")}
    for r in range(args.rounds):
        for dtype in ("bfloat16", "float32"):
            out = generation_seconds(args, dtype)
            times[f"generate {dtype}"].append(out["seconds"])
            print(f"round {r}: generate {dtype:8s} {out['seconds']:7.2f} s ({out['tokens']} tokens)", flush=True)
        for name, bf16 in (("train bf16", True), ("train fp32", False)):
            seconds = training_seconds(model, batch, bf16)
            times[name].append(seconds)
            print(f"round {r}: {name:17s} {seconds:7.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"generation: {args.prompts} prompts x {args.n} samples x {args.new_tokens} tokens; training: "
          f"{args.rows} rows x {args.tokens} tokens, forward + backward; medians of {args.rounds}")
    print(f"generate: bf16 {med['generate bfloat16']:7.2f} s, fp32 {med['generate float32']:7.2f} s, "
          f"ratio fp32/bf16 {med['generate float32'] / med['generate bfloat16']:.3f}")
    print(f"train   : bf16 {med['train bf16']:7.2f} s, fp32 {med['train fp32']:7.2f} s, "
          f"ratio fp32/bf16 {med['train fp32'] / med['train bf16']:.3f}")


if __name__ == "__main__":
    main()
