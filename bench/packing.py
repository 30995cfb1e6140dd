"""The work of shared-prompt packing under FlexAttention before and after N5: pack_rows' padded
layout [S, Lp] (every sequence padded to the longest; the padding queries attend all earlier
padding) against grpo.one_row (the sequences end to end in one row [1, ΣL], no padding), which
grpo.packed_inputs gives FlexAttention since N5. Counts, no timing: cheap on any CPU.

    python bench/packing.py            # the review's example and the default run's groups
    python bench/packing.py --review   # the review's example only (no tokenizer)

Per case, summed over its forwards: the tokens the linear layers see (S x Lp before, ΣL after)
and the padding's share of them; the tiles of 128 x 128 FlexAttention computes (the block mask's
partial and full tiles, grpo.packed_block_mask), and how many of those belong to query tiles
that are all padding.

1. The review's example (gpu-path-3, N5): the CRM pass (forward.two_context_logprobs) of one
   micro-batch of 8 templated rows, 2 groups of 4: the 8 rows under x (2 prompts of 300 tokens)
   and under their own x~ (8 prompts of 400 tokens), 4,096-token answers: S = 10.
2. The default run's groups (train.py's defaults: B = 16 prompts of K = 6 rollouts, micro-batches
   of 8, max_tokens 128; CUDA packs with flex). The committed runs hold no default run's rollouts,
   so these are the groups logged by the natural task's P²O runs (results/compare/natural/p2o_*:
   the default model, built-in problems and prompt format, 4 groups logged a step, max_tokens 96;
   templates from human seeds or Self-Ref), tokenized with the default tokenizer (a response: its
   text's tokens plus the EOS, at most 96), taken 16 at a time as default steps (a problem once a
   step). The training pass: grpo.micro_chunks of every group's rows (a group of 6 fills a
   micro-batch of 8 alone, so each forward is one sequence, S = 1, and nothing changes). The CRM
   pass: the step's templated rows 8 at a time under x and under x~, as two_context_logprobs
   forwards them.

Output (2026-12, CPU):

    case                                forwards  layout     tokens  padding     tiles  padding-query tiles
    review example: CRM pass            1         before    166,840   58.4%    50,804  40,280 (79.3%)
                                                  after      69,336    0.0%    10,552  0 (0.0%)
    default run: training pass          240       before     79,843    0.0%     1,504  0 (0.0%)
                                                  after      79,843    0.0%     1,504  0 (0.0%)
    default run: CRM pass               27        before     37,204   15.8%       762  184 (24.1%)
                                                  after      31,312    0.0%       669  0 (0.0%)
    (default run: 15 steps of 16 logged groups)

The review's example: 4.8x fewer tiles and 2.4x fewer tokens. One row computes a few tiles the
padded layout's real queries did not (10,552 against 50,804 - 40,280 = 10,524; 669 against 578):
a tile that straddles two sequences attends both. Equal-length sequences, which pack_rows does not
pad, compute the same tiles either way (within one, in the cases tried). The CPU (dense masks)
keeps the padded layout (grpo.packed_inputs), so the default CPU run is unchanged.
"""

import argparse
import collections
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import grpo  # noqa: E402

TILE = 128  # FlexAttention's block size, packed_block_mask's default
Row = collections.namedtuple("Row", "prompt_ids response_ids")  # what grpo.micro_chunks reads of a row


def work(prompts, responses, tile=TILE):
    """One packed forward of these rows, before and after N5 -> {layout: (tokens, padding tokens,
    tiles computed, tiles of all-padding query tiles)}."""
    p = grpo.pack_rows(prompts, responses, 0)
    in_one_row = grpo.one_row(p.input_ids, p.block, p.position_ids, p.index)[1]  # [1, ΣL]
    out = {}
    for layout, block in (("before", p.block), ("after", in_one_row)):
        S, L = block.shape
        mask = grpo.packed_block_mask(block, tile)
        per_query_tile = (mask.kv_num_blocks + mask.full_kv_num_blocks)[:, 0]  # [S, T]
        T = per_query_tile.shape[1]
        padding = torch.nn.functional.pad(block == -2, (0, T * tile - L), value=True).view(S, T, tile).all(-1)
        out[layout] = (S * L, int((block == -2).sum()), int(per_query_tile.sum()), int(per_query_tile[padding].sum()))
    return out


def review_example():
    """[(prompts, responses)]: the one forward of the review's CRM micro-batch."""
    firsts = [[5] * 300] * 4 + [[6] * 300] * 4  # two groups of 4 under their x
    seconds = [[7 + i] * 400 for i in range(8)]  # each row under its own x~
    return [(firsts + seconds, [[9] * 4096] * 16)]


def default_run_forwards(batch=16, micro_batch=8):
    """{'training pass': [(prompts, responses)], 'CRM pass': [...]}: the logged groups of the
    natural task's P²O runs as default steps of `batch` groups (module docstring, 2.)."""
    from transformers import AutoTokenizer

    from data import load_jsonl
    from model import resolve_model
    from prompts import problem_messages
    from prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(resolve_model())
    task = os.path.join(ROOT, "results", "compare", "natural")
    problems = {p.id: p for p in load_jsonl(os.path.join(task, "train.jsonl"))[0]}
    groups = []  # (problem id, x, [x~ or None] * K, [response length] * K)
    for path in sorted(glob.glob(os.path.join(task, "p2o_*", "seed-*", "rollouts.jsonl"))):
        cap = json.load(open(os.path.join(os.path.dirname(path), "result.json")))["settings"]["max_tokens"]
        for line in open(path):
            g = json.loads(line)
            p = problems[g["id"]]
            x = encode_prompt(tokenizer, problem_messages(p))
            tildes = [encode_prompt(tokenizer, problem_messages(p, t)) if t else None for t in g["templates"]]
            lengths = [min(len(tokenizer(text, add_special_tokens=False).input_ids) + 1, cap)  # + the EOS
                       for text in g["responses"]]
            groups.append((g["id"], x, tildes, lengths))
    steps = []  # in order, a problem once a step (a later epoch's group of it waits for the next step)
    while True:
        step = []
        for g in groups:
            if len(step) < batch and g[0] not in {s[0] for s in step}:
                step.append(g)
        if len(step) < batch:
            break
        steps.append(step)
        taken = {id(g) for g in step}
        groups = [g for g in groups if id(g) not in taken]
    out = {"training pass": [], "CRM pass": []}
    for step in steps:
        rows = [Row(x, [9] * n) for _, x, _, ns in step for n in ns]  # P²O trains a templated rollout under x
        for chunk in grpo.micro_chunks(rows, micro_batch, shared=True):
            out["training pass"].append(([r.prompt_ids for r in chunk], [r.response_ids for r in chunk]))
        templated = [(x, t, [9] * n) for _, x, ts, ns in step for t, n in zip(ts, ns) if t is not None]
        for c in range(0, len(templated), micro_batch):
            chunk = templated[c:c + micro_batch]
            out["CRM pass"].append(([x for x, _, _ in chunk] + [t for _, t, _ in chunk], [y for _, _, y in chunk] * 2))
    return out, len(steps)


def report(name, forwards):
    """Print one case's two lines: its forwards' work summed, before and after."""
    total = {"before": [0] * 4, "after": [0] * 4}
    for prompts, responses in forwards:
        for layout, counts in work(prompts, responses).items():
            total[layout] = [a + b for a, b in zip(total[layout], counts)]
    for layout, (tokens, padding, tiles, padding_tiles) in total.items():
        print(f"{name if layout == 'before' else '':<34}  {len(forwards) if layout == 'before' else '':<8}  "
              f"{layout:<6}  {tokens:>9,}  {padding / tokens:>6.1%}  {tiles:>8,}  "
              f"{padding_tiles:,} ({padding_tiles / tiles:.1%})", flush=True)
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--review", action="store_true", help="the review's example only (no tokenizer)")
    args = ap.parse_args()
    print(f"{'case':<34}  {'forwards':<8}  {'layout':<6}  {'tokens':>9}  {'padding':>7}  {'tiles':>8}  "
          "padding-query tiles")
    report("review example: CRM pass", review_example())
    if args.review:
        return
    cases, steps = default_run_forwards()
    for name, forwards in cases.items():
        report(f"default run: {name}", forwards)
    print(f"(default run: {steps} steps of 16 logged groups)")


if __name__ == "__main__":
    main()
