"""Rollout throughput, vLLM backend vs HF backend, measured side by side in one run.

    python bench/rollout.py                  # default model, batch 64 x 128 new tokens, bf16

Both backends get the same 64 prompts (built-in task, few-shot chat), generate exactly
`--new_tokens` tokens each (EOS ignored, so both do the same work) at temperature 1, after one
warm-up call each. Rounds alternate vLLM / HF to spread machine noise over both. The last line is
the ratio of generated tokens per second, vLLM / HF (issue target: >= 2.5).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from data import load_jsonl  # noqa: E402
from model import resolve_model  # noqa: E402
from prompts import problem_messages  # noqa: E402
from rollout import HFRollout, VLLMRollout  # noqa: E402


def timed(engine, prompts, new_tokens):
    t = time.perf_counter()
    groups = engine.generate(prompts, n=1, temperature=1.0, max_tokens=new_tokens, ignore_eos=True)
    seconds = time.perf_counter() - t
    tokens = sum(len(s.response_ids) for g in groups for s in g)
    assert tokens == len(prompts) * new_tokens, tokens
    return tokens / seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    path = resolve_model(args.model)
    problems = load_jsonl("builtin-train")[0][:args.batch]
    prompts = [problem_messages(p) for p in problems]
    vllm = VLLMRollout(path, dtype=args.dtype, max_model_len=1024)
    hf = HFRollout(path, dtype=args.dtype, batch_size=args.batch)
    print(f"batch {args.batch} x {args.new_tokens} new tokens, {args.dtype}, torch threads {torch.get_num_threads()}")
    for name, engine in (("vllm", vllm), ("hf", hf)):  # warm-up
        engine.generate(prompts[:4], n=1, temperature=1.0, max_tokens=8)
    rates = {"vllm": [], "hf": []}
    for r in range(args.rounds):
        for name, engine in (("vllm", vllm), ("hf", hf)):
            rates[name].append(timed(engine, prompts, args.new_tokens))
            print(f"round {r}: {name:4s} {rates[name][-1]:8.1f} tok/s")
    best = {name: max(v) for name, v in rates.items()}
    print(f"vllm {best['vllm']:.1f} tok/s, hf {best['hf']:.1f} tok/s (best of {args.rounds})")
    print(f"ratio vllm/hf: {best['vllm'] / best['hf']:.2f}")


if __name__ == "__main__":
    main()
