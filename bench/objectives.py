"""What each objective and sampler correction costs in a training step, side by side (issue 53).

    python bench/objectives.py                    # the shipped model, CPU, the default step's shape, 3 rounds
    python bench/objectives.py --rounds=1 --groups=2 --k=2 --response=16     # a smoke run

Only the policy update differs between the arms: generation, scoring and the push are the same
work whatever the loss, so (update_arm - update_ppo) / update_ppo bounds the arm's extra share of
a whole step from above. One process holds the policy (loaded as train.py loads it, CPU precision
as train.py chooses) and runs train.policy_update on one synthetic step of the default run's
shape: --groups prompts x --k responses of --response tokens, advantages +-1 in each group, a
third of the responses distilled templated rows (their x~ longer by --template tokens: the CRM
pass runs), the rest with engine log-probs (the mismatch diagnostics and corrections act on
them). Each round times every arm once, in a rotated order, after a warm-up round; AdamW at lr 0,
so every arm sees the same weights. The last lines print each arm's median update time and its
ratio to `ppo` of the same CRM setting (GSPO's sequence ratio is refused with the CRM: its arm
and its baseline run with --crm=False).
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ARMS = {  # name -> (settings, the arm it is compared with)
    "ppo": ({}, "ppo"),
    "gspo_token": (dict(policy_loss="gspo_token"), "ppo"),
    "cispo": (dict(policy_loss="cispo", eps_low=1.0, eps_high=3.0), "ppo"),
    "ppo+token_mask": (dict(sampler_correction="token_mask:0.5,2"), "ppo"),
    "ppo+icepop": (dict(sampler_correction="icepop:0.5,5"), "ppo"),
    "ppo+seq_tis": (dict(sampler_correction="seq_tis:2"), "ppo"),
    "ppo+geo_mask": (dict(sampler_correction="geo_mask:0.999,1.001"), "ppo"),
    "ppo (crm off)": (dict(crm=False), "ppo (crm off)"),
    "gspo (crm off)": (dict(policy_loss="gspo", crm=False), "ppo (crm off)"),
}


def synthetic_step(args, vocab):
    import torch

    import train

    gen = torch.Generator().manual_seed(0)
    rows = []
    for g in range(args.groups):
        prompt = torch.randint(10, vocab, (args.prompt,), generator=gen).tolist()
        template = torch.randint(10, vocab, (args.template,), generator=gen).tolist()
        for j in range(args.k):
            response = torch.randint(10, vocab, (args.response,), generator=gen).tolist()
            adv = 1.0 if j % 2 else -1.0
            if j < args.k // 3:  # a distilled templated row: trained under x, its x~ for the CRM
                rows.append(train.Row(prompt, response, adv, template + prompt, group=g))
            else:
                sampler = (-torch.rand(args.response, generator=gen) * 4).tolist()
                rows.append(train.Row(prompt, response, adv, sampler_logp=sampler, group=g))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--groups", type=int, default=16, help="prompts a step (the default run's 16)")
    ap.add_argument("--k", type=int, default=6, help="responses a prompt (the default run's 6)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--template", type=int, default=40)
    ap.add_argument("--response", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import dataclasses

    import torch
    from tqdm import tqdm

    import rollout
    import train
    from config import check_config, cpu_precision
    from model import resolve_model

    base = train.Config(**({"model": args.model} if args.model else {}), device=args.device, dev_data="", lr=0.0)
    base.engine_dtype, base.autocast_bf16, _ = cpu_precision(base, args.device)  # as train.start_run decides
    model_path = resolve_model(base.model)
    device = torch.device(args.device)
    policy, _, tokenizer, _ = rollout.load_models(base, model_path, model_path, object(), device, [], {})
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.0)
    rows = synthetic_step(args, policy.config.vocab_size)
    cfgs = {name: dataclasses.replace(base, **over) for name, (over, _) in ARMS.items()}
    for cfg in cfgs.values():
        check_config(cfg)
    names, times = list(ARMS), {name: [] for name in ARMS}
    for r in tqdm(range(args.rounds + 1), desc="rounds"):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            update = train.policy_update(policy, None, optimizer, rows, cfgs[name], pad_id=tokenizer.eos_token_id,
                                         n_groups=args.groups)
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t)
            assert update.finite, name
    print(f"{args.groups} x {args.k} rows of {args.response} tokens, {args.rounds} rounds, "
          f"autocast_bf16={base.autocast_bf16}, {torch.get_num_threads()} threads")
    print(f"{'arm':<18}{'median s':>10}{'ratio':>8}   against")
    for name, (_, against) in ARMS.items():
        median = statistics.median(times[name])
        ratio = median / statistics.median(times[against])
        print(f"{name:<18}{median:>10.2f}{ratio:>8.3f}   {against}  (rounds: {' '.join(f'{t:.2f}' for t in times[name])})")


if __name__ == "__main__":
    main()
