"""Model FLOP utilisation of the training step on this machine, and where the time goes.

    python bench/mfu.py                # default model, a default-sized training batch, 3 timed steps

1. Peak: the best bf16 matmul throughput torch reaches here (square and training-shaped
   products, all threads), in FLOP/s.
2. Achieved: `train.policy_update` at the default configuration (bf16 autocast, fp32 master
   weights, shared prompts, micro-batch 8, AdamW) on 8 groups x K = 6 rows of the built-in
   task's real prompts with response lengths like the default run's (uniform 8-64 tokens,
   random ids), every row trained. FLOPs counted, forward + backward = 3 x forward:
     matmuls   6 * N * T          N = non-embedding parameters, T = tokens forwarded
     LM head   6 * V * H * R      only at the R response positions (forward.selected_logprobs)
     attention 12 * L * H * P     P = (query, visible key) pairs, causal and block masks
                                  respected (what a masked kernel needs; padding excluded)
   Not counted: norms, activations, softmax, the optimizer (all memory-bound).
3. MFU = achieved / peak, then a profile of one step: the 12 largest ops by self CPU time.
"""

import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import train  # noqa: E402
from data import load_jsonl  # noqa: E402
from model import resolve_model  # noqa: E402
from prompts import problem_messages  # noqa: E402
from prompts import encode_prompt  # noqa: E402


def peak_flops():
    """Best bf16 matmul FLOP/s over a few shapes (m, k, n), 3 repeats each after a warm-up."""
    best = {}
    for m, k, n in [(2048, 2048, 2048), (4096, 4096, 4096), (2048, 576, 1536), (2048, 1536, 576), (4096, 576, 576)]:
        a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
        a @ b
        times = []
        for _ in range(3):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        best[(m, k, n)] = 2 * m * k * n / min(times)
    return max(best.values()), best


def batch(tokenizer, groups=8, k=6, seed=0):
    rng = random.Random(seed)
    problems = load_jsonl("builtin-train")[0][:groups]
    rows = []
    for g, p in enumerate(problems):
        prompt = encode_prompt(tokenizer, problem_messages(p))
        for _ in range(k):
            response = [rng.randrange(100, 40000) for _ in range(rng.randrange(8, 65))]
            rows.append(train.Row(prompt, response, rng.choice([-1.0, 1.0]), group=g))
    return rows


def step_flops(model, rows):
    cfg = model.config
    embed = cfg.vocab_size * cfg.hidden_size
    n = sum(p.numel() for p in model.parameters()) - embed  # tied head: the embedding counted once, removed
    prompts = {tuple(r.prompt_ids) for r in rows}
    tokens = sum(map(len, prompts)) + sum(len(r.response_ids) for r in rows)
    responses = sum(len(r.response_ids) for r in rows)
    pairs = 0
    for prompt in prompts:
        p = len(prompt)
        pairs += p * (p + 1) // 2  # the prompt, causal
        for r in rows:
            if tuple(r.prompt_ids) == prompt:
                m = len(r.response_ids)
                pairs += m * p + m * (m + 1) // 2  # a response sees the prompt and itself
    flops = 6 * n * tokens + 6 * embed * responses + 12 * cfg.num_hidden_layers * cfg.hidden_size * pairs
    return flops, {"non_embedding_params": n, "tokens": tokens, "response_tokens": responses, "pairs": pairs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy.train()
    cfg = train.Config()
    rows = batch(tokenizer)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    train.policy_update(policy, None, optimizer, rows, cfg, pad_id=tokenizer.pad_token_id)  # warm-up
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        train.policy_update(policy, None, optimizer, rows, cfg, pad_id=tokenizer.pad_token_id)
        times.append(time.perf_counter() - t)
    flops, parts = step_flops(policy, rows)
    peak, shapes = peak_flops()
    step = statistics.median(times)
    print(f"threads {torch.get_num_threads()}; bf16 matmul peak {peak / 1e9:.1f} GFLOP/s "
          f"({', '.join(f'{m}x{k}x{n}: {f / 1e9:.0f}' for (m, k, n), f in shapes.items())})")
    print(f"training step: {len(rows)} rows, {parts}, {flops / 1e9:.1f} GFLOP, median {step:.2f} s "
          f"of {args.steps} -> {flops / step / 1e9:.1f} GFLOP/s")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train.policy_update(policy, None, optimizer, rows, cfg, pad_id=tokenizer.pad_token_id)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
    print(f"MFU: {flops / step / peak:.3f}")


if __name__ == "__main__":
    main()
