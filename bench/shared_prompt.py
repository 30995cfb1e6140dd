"""Training time per step with each prompt forwarded once for its rows (shared_prompt=True, the
default) against one forward per row (False), side by side on the same rollout batches.

    python bench/shared_prompt.py              # default model and configuration, 3 batches x 2 rounds

First generates --steps real rollout batches once, exactly as a default `python train.py` step
does (vLLM, B = 16 built-in prompts x K = 6, T = 0.6, 128 max new tokens, verify.py rewards,
train.training_rows), then times `train.policy_update` on every batch with shared_prompt off and
on, alternating (off, on, off, on, ...), each time from the same initial weights and a fresh
AdamW. Also prints the tokens each path forwards. `--all_rows` gives every row a non-zero
advantage (a step in which every group carries signal; by default, as in training, groups whose
rewards are all equal are not forwarded). The ratio is printed last.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import train  # noqa: E402
from data import load_jsonl  # noqa: E402
from model import resolve_model  # noqa: E402
from rollout import VLLMRollout  # noqa: E402
from verify import reward  # noqa: E402


def rollout_batches(cfg, steps, tokenizer):
    engine = VLLMRollout(resolve_model(), seed=cfg.seed)
    stream, state = train.PromptStream(load_jsonl("builtin-train")[0], cfg.seed), train.LoopState()
    batches = []
    for _ in range(steps):
        groups, _ = train.collect_groups(engine, stream, state, cfg, lambda text, p: reward(text, p.answer))
        batches.append(train.training_rows(groups, cfg, tokenizer))
        state.step += 1
    return batches


def forwarded_tokens(rows, shared):
    """Prompt + response tokens that the training forward sees."""
    if not shared:
        return sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    prompts = {tuple(r.prompt_ids) for r in rows}
    return sum(map(len, prompts)) + sum(len(r.response_ids) for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--all_rows", action="store_true")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = train.Config()
    path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    batches = rollout_batches(cfg, args.steps, tokenizer)
    if args.all_rows:
        for rows in batches:
            for r in rows:
                r.advantage = r.advantage or 0.5
    trained = [[r for r in rows if r.advantage != 0] for rows in batches]
    print(f"{args.steps} batches; rows trained per step: {[len(t) for t in trained]}")
    for shared in (False, True):
        print(f"shared_prompt={shared}: {statistics.mean(forwarded_tokens(t, shared) for t in trained):.0f} "
              "tokens forwarded per step")
    initial = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy.train()
    times = {False: [], True: []}
    for _ in range(args.rounds):
        for shared in (False, True):
            run_cfg = train.Config(shared_prompt=shared)
            for rows in batches:
                policy.load_state_dict(initial)
                optimizer = torch.optim.AdamW(policy.parameters(), lr=run_cfg.lr)
                t = time.perf_counter()
                train.policy_update(policy, None, optimizer, rows, run_cfg, pad_id=tokenizer.pad_token_id)
                times[shared].append(time.perf_counter() - t)
    for shared in (False, True):
        print(f"shared_prompt={shared}: {statistics.mean(times[shared]):.2f} s per step "
              f"(median {statistics.median(times[shared]):.2f}, {len(times[shared])} timed)")
    print(f"training time per step, shared / unshared: {statistics.mean(times[True]) / statistics.mean(times[False]):.3f}")


if __name__ == "__main__":
    main()
