"""Log-probs at the LM head: the [N, V] logits path against grpo.head_logprobs (chunked), side by side.

    python bench/head_logprobs.py                          # Qwen's vocabulary, 1,024 tokens, on the CPU
    python bench/head_logprobs.py --device=cuda --tokens=8192 --hidden=1024

One training use of the head: log-probs of N target tokens and their entropy (logged), backward
of a weighted sum into the hidden states and the head's weight. Settings, in one process:
  full     logits = hidden @ W.T, then grpo.token_logprobs and grpo.entropy (the path before issue 25)
  chunked  grpo.head_logprobs(..., chunk=--chunk): no [N, V] tensor
Time: median of --repeats, the settings interleaved. Peak memory: on CUDA the allocator's peak
above the inputs; on the CPU each setting runs once more in a fresh process and reports its
resident-set high-water mark (VmHWM) above the inputs'. Prints both and the ratios chunked/full, and
the largest difference of log-probs and gradients (float32, same inputs).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import grpo  # noqa: E402


def inputs(args, device):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden ** 0.5).to(device).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    upstream = torch.randn(args.tokens, generator=g).to(device)  # d loss / d logp
    return hidden, weight, targets, upstream


def step(setting, hidden, weight, targets, upstream, chunk):
    """One forward (log-probs + entropy) and backward; returns log-probs and the two gradients."""
    if setting == "full":
        logits = hidden @ weight.T  # [N, V]
        logp = grpo.token_logprobs(logits[None], targets[None])[0]
        with torch.no_grad():
            grpo.entropy(logits.detach())
    else:
        logp, _ = grpo.head_logprobs(hidden, weight, targets, 1.0, chunk, with_entropy=True)
    hidden.grad = weight.grad = None
    (logp * upstream).sum().backward()
    return logp.detach(), hidden.grad, weight.grad


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss():
    """This process's resident-set high-water mark in bytes: VmHWM (ru_maxrss would start from the
    parent's peak: Linux carries it over fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def cpu_peaks(args):
    """CPU: each setting once more in a fresh process (this script with --peak_of), which reports
    the resident-set high-water mark it added above its inputs."""
    peaks = {}
    for setting in ("full", "chunked"):
        flags = [f"--{k}={v}" for k, v in vars(args).items() if k != "peak_of"]
        out = subprocess.run([sys.executable, os.path.abspath(__file__), *flags, f"--peak_of={setting}"],
                             capture_output=True, text=True, check=True).stdout
        peaks[setting] = int(out.split()[-1])
    return peaks


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=1024, help="N: response tokens of a micro-batch")
    ap.add_argument("--hidden", type=int, default=576, help="H (SmolLM2-135M: 576; Qwen3-0.6B: 1024)")
    ap.add_argument("--vocab", type=int, default=151936, help="V (Qwen3: 151,936)")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per chunk (train.py --head_chunk)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--peak_of", default="", help=argparse.SUPPRESS)  # internal: one setting's CPU peak
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = inputs(args, device)
    if args.peak_of:
        before = peak_rss()
        step(args.peak_of, *data, args.chunk)
        print(peak_rss() - before)
        return
    print(f"N = {args.tokens} tokens, H = {args.hidden}, V = {args.vocab}, chunk = {args.chunk}, {device}, float32")
    outputs, times = {}, {"full": [], "chunked": []}
    peaks = {}
    for i in range(args.repeats + 1):
        for setting in times:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            sync(device)
            t = time.perf_counter()
            outputs[setting] = step(setting, *data, args.chunk)
            sync(device)
            if i:  # the first round warms up
                times[setting].append(time.perf_counter() - t)
            if device.type == "cuda":
                peaks[setting] = torch.cuda.max_memory_allocated(device) - base
    if device.type != "cuda":
        peaks = cpu_peaks(args)
    for setting in times:
        print(f"{setting:8s} {statistics.median(times[setting]):7.3f} s  peak {peaks[setting] / 2**30:6.2f} GiB above the inputs")
    print(f"ratio chunked/full: time {statistics.median(times['chunked']) / statistics.median(times['full']):.3f}, "
          f"peak memory {peaks['chunked'] / (peaks['full'] or float('nan')):.3f}")  # tiny shapes: below the RSS page
    diffs = [(a - b).abs().max().item() for a, b in zip(outputs["chunked"], outputs["full"])]
    print("largest |chunked - full|: log-probs {:.2e}, d hidden {:.2e}, d W {:.2e}".format(*diffs))


if __name__ == "__main__":
    main()
