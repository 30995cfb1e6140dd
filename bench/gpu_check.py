"""The training step on a GPU against the same step on the CPU: for a session that is lent one.

    python bench/gpu_check.py                 # cuda vs cpu (needs torch with CUDA, transformers)
    python bench/gpu_check.py --device=cpu    # the same script on the CPU twice (a smoke test)

A tiny Llama is created at run time (no download): 4 layers, hidden 256, vocabulary 2,000,
random weights. 48 rows (prompts of 20-80 tokens, responses of 8-160, advantages of both signs,
grouped by 6) go through `train.policy_update` -- the trainer's own micro-batching, shared-prompt
packing, PPO-clip loss, global token-mean and AdamW -- on the CPU and on --device. Prints, last:
  grad_rel_err   ||g_device - g_cpu|| / ||g_cpu|| of one step's gradient in fp32 with TF32 off:
                 the same arithmetic in another order, so ~1e-6; <= 1e-4 passes.
  traj_rel_err   ||d_device - d_cpu|| / ||d_cpu||, d = theta after --steps AdamW steps - theta_0,
                 both in bf16 autocast (the training default). Not 0: the devices' bf16 kernels
                 round differently, and Adam's normalised step turns the rounding of tiny
                 gradients into full-size steps. Its yardstick is measured in the same run: the
                 CPU's own bf16 trajectory against its fp32 one (bf16_floor). traj_rel_err <=
                 bf16_floor passes: the device differs from the CPU by less than bf16 itself does.
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

GRAD_PASS = 1e-4


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
    for g in range(n // k):
        prompt = [rng.randrange(1, 2000) for _ in range(rng.randrange(20, 81))]
        for _ in range(k):
            response = [rng.randrange(1, 2000) for _ in range(rng.randrange(8, 161))]
            rows.append(train.Row(prompt, response, rng.choice([-1.2, -0.5, 0.4, 1.0]), group=g))
    return rows


def flat(tensors):
    return torch.cat([t.detach().float().cpu().reshape(-1) for t in tensors])


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def run(device, steps, rows, bf16, tf32=True):
    """-> (theta_0, theta_end, first step's gradient, median step time, peak MiB)."""
    cfg = train.Config(micro_batch_size=8, lr=1e-4, autocast_bf16=bf16)
    model = tiny_model().to(device)
    start = flat(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
        torch.cuda.reset_peak_memory_stats(device)
    times, grad = [], None
    real_step = optimizer.step

    def step_keeping_the_gradient(*args, **kwargs):  # policy_update frees .grad after its last step
        nonlocal grad
        if grad is None:  # one mini-batch: the step's (clipped) gradient
            grad = flat(p.grad for p in model.parameters())
        return real_step(*args, **kwargs)

    optimizer.step = step_keeping_the_gradient
    for _ in range(steps):
        t = time.perf_counter()
        update = train.policy_update(model, None, optimizer, rows, cfg, pad_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
        assert update.finite
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    return start, flat(model.parameters()), grad, statistics.median(times[1:] or times), peak


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    device, cpu = torch.device(args.device), torch.device("cpu")
    rows = make_rows()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    _, _, g_cpu, _, _ = run(cpu, 1, rows, bf16=False)
    _, _, g_dev, _, _ = run(device, 1, rows, bf16=False, tf32=False)
    grad_err = rel_err(g_dev, g_cpu)
    start, end_fp32, _, _, _ = run(cpu, args.steps, rows, bf16=False)
    _, end_cpu, _, cpu_time, _ = run(cpu, args.steps, rows, bf16=True)
    _, end_dev, _, dev_time, dev_peak = run(device, args.steps, rows, bf16=True)
    floor = rel_err(end_fp32 - start, end_cpu - start)
    traj_err = rel_err(end_dev - start, end_cpu - start)

    print(f"train.policy_update, {len(rows)} rows in {len(rows) // 6} groups; {name} against the cpu")
    print(f"cpu:  {cpu_time:.3f} s/step (bf16 autocast)")
    print(f"{name}: {dev_time:.3f} s/step (bf16 autocast), peak memory {dev_peak:.0f} MiB; "
          f"speed ratio cpu/device {cpu_time / dev_time:.1f}x")
    ok_grad, ok_traj = grad_err <= GRAD_PASS, traj_err <= floor
    print(f"grad_rel_err {grad_err:.2e} (fp32, TF32 off; {'PASS' if ok_grad else 'FAIL'}: <= {GRAD_PASS:g})")
    print(f"traj_rel_err {traj_err:.4f} after {args.steps} steps, bf16_floor {floor:.4f} "
          f"({'PASS' if ok_traj else 'FAIL'}: <= bf16_floor)")
    return 0 if ok_grad and ok_traj else 1


if __name__ == "__main__":
    sys.exit(main())
