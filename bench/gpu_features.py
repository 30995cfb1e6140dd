"""CLIPO's features on a GPU: the pooled hidden states of shapers' forward (forward.hidden_means)
packed through FlexAttention (the CUDA default, --packed_attention=auto) against one row at a
time with no mask at all, for a session that is lent a GPU.

    python bench/gpu_features.py                 # cuda
    python bench/gpu_features.py --device=cpu    # the same on the CPU (dense packed mask)

A random Llama (4 layers, hidden 256, no download) and groups of 6 responses of R tokens after a
shared 64-token prompt, R in 256, 2,048, 8,192 (CPU: 32, 64): the packed pooled states must equal
the per-row ones (fp32: max |diff| <= 1e-4 of their scale), the FlexAttention graphs compiled
over all lengths are counted (dynamic shapes: a handful, not one per length), and the seconds of
each. Prints one line per length and PASS / FAIL last; nothing written.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from forward import hidden_means  # noqa: E402


def tiny_model(device, flex):
    from transformers import LlamaConfig, LlamaForCausalLM

    from model import use_packed_flex

    config = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
                         tie_word_embeddings=True, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().to(device).eval()
    return use_packed_flex(model) if flex else model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    packed_model = tiny_model(device, flex=cuda)
    plain_model = tiny_model(device, flex=False)
    g = torch.Generator().manual_seed(1)
    ok = True
    for r in ((256, 2048, 8192) if cuda else (32, 64)):
        prompts = [torch.randint(1, 2000, (64,), generator=g).tolist()] * 6
        responses = [torch.randint(1, 2000, (r - (r // 16) * i,), generator=g).tolist() for i in range(6)]
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        t = time.perf_counter()
        packed = hidden_means(packed_model, prompts, responses, pad_id=0, chunk_size=6, shared=True)
        sync()
        seconds_packed = time.perf_counter() - t
        t = time.perf_counter()
        alone = torch.cat([hidden_means(plain_model, [p], [y], pad_id=0, chunk_size=1) for p, y in zip(prompts, responses)])
        sync()
        seconds_alone = time.perf_counter() - t
        gap = ((packed - alone).abs().max() / alone.abs().max()).item()
        ok &= gap <= 1e-4
        print(f"R {r}: packed {seconds_packed:.2f} s, one row at a time {seconds_alone:.2f} s, "
              f"max |diff| / scale {gap:.2e}", flush=True)
    if cuda:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # only FlexAttention is compiled here
        print(f"graphs compiled over all lengths: {graphs}", flush=True)
        ok &= graphs <= 4
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
