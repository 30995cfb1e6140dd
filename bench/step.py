"""One GRPO configuration through our train loop and through TRL's GRPOTrainer, side by side.

    pip install trl            # for this benchmark only; not a project dependency
    python bench/step.py       # default model, 8 prompts x K=6, 128 max new tokens, 3 steps each

Each framework runs in its own child process (so peak RSS is its own), alternating
ours -> TRL -> ours -> TRL for `--rounds` rounds. Both use the same prompts (the built-in
train split's first `steps x prompts` prompts in our seeded order, same few-shot chat format),
the same K, max new tokens, temperature, learning rate, micro-batch, bf16 autocast on the CPU,
no KL, token-mean loss, one optimizer step per rollout batch, and verify.reward. Generation is
each framework's own default on this machine: ours vLLM (in-process), TRL transformers
`generate` (TRL's vLLM path expects a CUDA vLLM). The first step of every run is a warm-up and is
not timed. Prints per-step wall time and peak RSS (at the end of the last step) of each, then
the ratios (ours / TRL) last. `--gradient_checkpointing` turns it on in both.
"""

import argparse
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


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompts_for(args):
    from data import load_jsonl
    from train import PromptStream

    stream = PromptStream(load_jsonl("builtin-train")[0], seed=args.seed)
    return stream.take(0, (args.steps + 1) * args.prompts)


def run_ours(args):
    import train

    with tempfile.TemporaryDirectory() as out:
        cfg = train.Config(prompts_per_step=args.prompts, group_size=args.k, max_tokens=args.max_tokens,
                           micro_batch_size=args.micro_batch, lr=args.lr, warmup_steps=1, dev_data="",
                           eval_every=0, save_every=0, max_steps=args.steps + 1, out_dir=out,
                           run_name="bench", seed=args.seed, temperature=args.temperature,
                           gradient_checkpointing=args.gradient_checkpointing,
                           cpu_fp32_fallback=False)  # bf16 as TRL's, even where the CPU emulates it
        train.train(cfg)
        with open(os.path.join(out, "bench", "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f]
    steps = [m["time_step"] for m in metrics[1:]]
    split = {k: statistics.mean(m[k] for m in metrics[1:])
             for k in ("time_generate", "time_score", "time_train", "time_push")}
    # peak RSS at the end of the last step (train.py logs it): the final checkpoint save, which
    # TRL is told to skip, is not counted
    return {"step_seconds": steps, "split": split, "peak_rss_mb": metrics[-1]["peak_rss_mb"]}


def run_trl(args):
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from model import resolve_model
    from prompts import problem_messages
    from verify import reward

    problems = prompts_for(args)
    data = Dataset.from_list([{"prompt": problem_messages(p),
                               "answer": p.answer} for p in problems])

    def verify_reward(completions, answer, **_):
        return [reward(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t = [], None

        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t)
            self.peak = peak_rss_mb()

    rows = args.prompts * args.k
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=True, per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=rows // args.micro_batch, num_generations=args.k,
            max_completion_length=args.max_tokens, temperature=args.temperature, learning_rate=args.lr,
            beta=0.0, loss_type="dapo", num_iterations=1, max_steps=args.steps + 1, logging_steps=1,
            report_to=[], save_strategy="no", seed=args.seed, shuffle_dataset=False,
            warmup_steps=1, lr_scheduler_type="constant_with_warmup",
            gradient_checkpointing=args.gradient_checkpointing)
        timer = Timer()
        trainer = GRPOTrainer(model=resolve_model(), reward_funcs=verify_reward, args=config,
                              train_dataset=data, callbacks=[timer])
        torch.manual_seed(args.seed)
        trainer.train()
    return {"step_seconds": timer.times[1:], "peak_rss_mb": timer.peak}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--max_tokens", type=int, default=128)
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after 1 warm-up)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gradient_checkpointing", action="store_true")
    ap.add_argument("--role", choices=["ours", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.role:  # child process: run one framework, write its result
        result = run_ours(args) if args.role == "ours" else run_trl(args)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return

    results = {"ours": [], "trl": []}
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--rounds")]
    for r in range(args.rounds):
        for role in ("ours", "trl"):
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                subprocess.run([sys.executable, __file__, f"--role={role}", f"--result={tmp.name}"] + passthrough,
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                res = json.load(open(tmp.name))
            results[role].append(res)
            steps = ", ".join(f"{s:.1f}" for s in res["step_seconds"])
            print(f"round {r} {role:4s}: step seconds [{steps}], peak RSS {res['peak_rss_mb']:.0f} MB"
                  + (f", split {json.dumps({k: round(v, 2) for k, v in res['split'].items()})}" if "split" in res else ""))
    med = {role: statistics.median(s for res in rs for s in res["step_seconds"]) for role, rs in results.items()}
    rss = {role: max(res["peak_rss_mb"] for res in rs) for role, rs in results.items()}
    print(f"config: {args.prompts} prompts x K={args.k}, {args.max_tokens} max new tokens, micro-batch {args.micro_batch}"
          f", gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}")
    print(f"median step: ours {med['ours']:.1f} s, TRL {med['trl']:.1f} s; peak RSS: ours {rss['ours']:.0f} MB, TRL {rss['trl']:.0f} MB")
    print(f"ratios ours/TRL: step time {med['ours'] / med['trl']:.2f}, peak RSS {rss['ours'] / rss['trl']:.2f}")


if __name__ == "__main__":
    main()
