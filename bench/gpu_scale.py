"""The training step at a GPU-sized shape: throughput, MFU and peak memory of `train.policy_update`.

    python bench/gpu_scale.py                       # on cuda (a session that is lent a GPU)
    python bench/gpu_scale.py --device=cpu --small  # a smoke test of the script on the CPU

The model is created at run time (no download): a Llama with Qwen3-0.6B's widths (hidden 1024,
MLP 3072, 28 layers, 16 query / 8 KV heads of 64, vocabulary 151,936, tied head), 0.50 B
parameters, random weights, fp32 master weights + AdamW like train.py. The batch is one training
step of a long-answer run: 16 prompts x K = 6 rows, prompts of 150-300 tokens, responses of
64-1024 tokens (random ids), advantages of both signs.

Each setting runs 1 warm-up and --steps timed steps of `train.policy_update` (bf16 autocast,
micro-batch --micro rows), side by side in one process:
  shared        shared-prompt training (the default): each group's prompt forwarded once, under
                FlexAttention on CUDA (--packed_attention=auto), log-probs in chunks (--head_chunk)
  unshared      --shared_prompt=False: the prompt repeated in each of the K rows
  shared+ckpt   shared, with gradient checkpointing
  shared-before shared as before issue 25: the dense [L, L] mask and [N, V] logits
  unshared-before unshared with [N, V] logits
FLOPs are counted as bench/mfu.py counts them (6 N T + head at response positions + masked
attention pairs); the peak is the best bf16 matmul rate torch reaches on this device. Prints, per
setting, the step time, achieved TFLOP/s, MFU and peak memory, then the ratios shared/unshared.
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
from mfu import step_flops  # noqa: E402  (bench/, the script's own folder, is on the path)


def make_model(small, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    if small:
        shape = dict(vocab_size=4000, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    else:
        shape = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8)
    config = LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).float()


def make_rows(vocab, small, groups=16, k=6, seed=0):
    rng = random.Random(seed)
    prompt_len, response_len = ((10, 30), (4, 40)) if small else ((150, 300), (64, 1024))
    rows = []
    for g in range(groups):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_len))]
        for _ in range(k):
            response = [rng.randrange(1, vocab) for _ in range(rng.randint(*response_len))]
            rows.append(train.Row(prompt, response, rng.choice([-1.0, -0.4, 0.6, 1.0]), group=g))
    return rows


def matmul_peak(device, n):
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * n ** 3 / (time.perf_counter() - t)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device, small, rows, steps, micro, shared, checkpointing, before):
    from config import packed_layout
    from model import use_packed_flex

    model = make_model(small, device)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = train.Config(shared_prompt=shared, micro_batch_size=micro, lr=1e-6, gradient_checkpointing=checkpointing,
                       packed_attention="dense" if before else "auto", head_chunk=10**9 if before else 1024)
    if shared and packed_layout(cfg, device.type)[1] == "flex":
        use_packed_flex(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(steps + 1):
        sync(device)
        t = time.perf_counter()
        update = train.policy_update(model, None, optimizer, rows, cfg, pad_id=0)
        sync(device)
        if i:
            times.append(time.perf_counter() - t)
        assert update.finite, "non-finite step"
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    flops, parts = step_flops(model, rows)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times), flops, parts, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch")
    ap.add_argument("--small", action="store_true", help="a tiny model and batch (smoke test)")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = matmul_peak(device, 512 if args.small else 8192)
    print(f"{name}: bf16 matmul peak {peak / 1e12:.1f} TFLOP/s ({'512' if args.small else '8192'}^3, torch)")
    rows = make_rows(4000 if args.small else 151936, args.small)
    results, memory = {}, {}
    settings = [("shared", True, False, False), ("unshared", False, False, False), ("shared+ckpt", True, True, False),
                ("shared-before", True, False, True), ("unshared-before", False, False, True)]
    for label, shared, ckpt, before in settings:
        step, flops, parts, mem = measure(device, args.small, rows, args.steps, args.micro, shared, ckpt, before)
        results[label], memory[label] = step, mem
        print(f"{label:15s} {step:7.3f} s/step  {flops / step / 1e12:7.1f} TFLOP/s  MFU {flops / step / peak:.3f}  "
              f"peak memory {mem:.1f} GiB  ({parts['tokens']} tokens, {flops / 1e12:.1f} TFLOP needed: the prompt once a group)")
    print(f"ratio shared/unshared step time {results['shared'] / results['unshared']:.3f}  (target <= 0.6)")
    print(f"ratio shared/shared-before step time {results['shared'] / results['shared-before']:.3f}, "
          f"peak memory {memory['shared'] / memory['shared-before']:.3f}  (target <= 0.6)")
    print(f"ratio unshared/unshared-before step time {results['unshared'] / results['unshared-before']:.3f}, "
          f"peak memory {memory['unshared'] / memory['unshared-before']:.3f}")
    print(f"ratio shared+ckpt/shared step time {results['shared+ckpt'] / results['shared']:.3f}")


if __name__ == "__main__":
    main()
