"""The training step on a GPU against the same steps on the CPU: for a session that is lent one.

    python bench/gpu_check.py                 # cuda vs cpu (needs torch with CUDA, transformers)
    python bench/gpu_check.py --device=cpu    # the same script on the CPU twice (a smoke test)

A tiny Llama is created at run time (no download): 4 layers, hidden 256, vocabulary 2,000,
random weights. 48 rows (prompts of 20-80 tokens, responses of 8-160, advantages of both signs,
grouped by 6) go through `train.policy_update` -- the trainer's own micro-batching, PPO-clip
loss, global token-mean and AdamW -- for --steps steps on the CPU and on --device, both in fp32
master weights with bf16 autocast (the training default). Prints, last:
  param_diff_ratio  max |theta_device - theta_cpu| / max |theta_cpu - theta_0|: how far the two
                    devices' trajectories part, relative to how far training moved. bf16
                    kernels differ between devices, so this is not 0; <= 0.1 passes.
  step time (median of the steps after the first) and peak memory on each device.
No vLLM, no data files, nothing written; a few minutes at most.
"""

import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

import train

PASS_RATIO = 0.1


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def make_rows(n=48, k=6):
    rng = random.Random(0)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(1, 2000) for _ in range(rng.randrange(20, 81))]
        response = [rng.randrange(1, 2000) for _ in range(rng.randrange(8, 161))]
        rows.append(train.Row(prompt, response, rng.choice([-1.2, -0.5, 0.4, 1.0]), group=i // k))
    return rows


def run(device, steps, rows):
    cfg = train.Config(micro_batch_size=8, lr=1e-4, autocast_bf16=True)
    model = tiny_model().to(device)
    start = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        update = train.policy_update(model, None, optimizer, rows, cfg, pad_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
        assert update.finite
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    end = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return start, end, statistics.median(times[1:] or times), peak


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = make_rows()
    start, cpu_end, cpu_time, _ = run(torch.device("cpu"), args.steps, rows)
    _, dev_end, dev_time, dev_peak = run(device, args.steps, rows)
    moved = max((cpu_end[k] - start[k]).abs().max().item() for k in start)
    apart = max((dev_end[k] - cpu_end[k]).abs().max().item() for k in start)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.steps} steps of train.policy_update, {len(rows)} rows, bf16 autocast, fp32 master weights")
    print(f"cpu:      {cpu_time:.3f} s/step")
    print(f"{name}: {dev_time:.3f} s/step, peak memory {dev_peak:.0f} MiB")
    print(f"max |param change| on cpu {moved:.3e}; max |device - cpu| {apart:.3e}")
    ratio = apart / moved
    print(f"param_diff_ratio {ratio:.4f} ({'PASS' if ratio <= PASS_RATIO else 'FAIL'}: <= {PASS_RATIO})")
    print(f"speed ratio cpu/device {cpu_time / dev_time:.1f}x")
    return 0 if ratio <= PASS_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
