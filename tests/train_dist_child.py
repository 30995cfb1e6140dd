"""One process of tests/test_train_dist.py: a tiny P²O run of train.py with a scripted engine,
reward and reflector, started either alone (`python tests/train_dist_child.py JOB.json`) or
under torchrun (`python -m torch.distributed.run --standalone --nproc_per_node=2 ...`).

The scripted engine's answers are a pure function of the prompt text and the sample's index,
never of the seed, the batch or the rank, so one process and two processes see exactly the
same global batch: whatever differs in their results comes from how train.py splits, reduces
and shards. Every process writes what it ended with to JOB["out"]/rank-R.pt.
"""

import json
import os
import sys
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

import train
from prompts import encode_prompt
from rollout import Sample, named_tensors


class ScriptedEngine:
    """Answers 'good ...' or 'bad ...' of 1-7 words. A prompt carrying a template ('Approach')
    is good half the time; a plain one a fifth of the time, or never for a third of the
    problems (all-fail groups: hard prompts, DAPO refills). Records the pushed weights."""

    def __init__(self, tokenizer):
        self.tokenizer, self.pushes, self.pushed = tokenizer, 0, None
        self.in_gepa, self.gepa_calls = False, []  # the user texts of each call made in an epoch's end

    def generate(self, prompts, n=1, temperature=1.0, max_tokens=8, stop=None, **_):
        counts = [n] * len(prompts) if isinstance(n, int) else n
        temperatures = temperature if isinstance(temperature, list) else [temperature] * len(prompts)
        if self.in_gepa:
            self.gepa_calls.append([p if isinstance(p, str) else p[-1]["content"] for p in prompts])
        groups = []
        for prompt, k, temperature in zip(prompts, counts, temperatures):
            text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            ids = encode_prompt(self.tokenizer, prompt)
            group = []
            for j in range(k):
                h = zlib.crc32(f"{text}|{j}|{temperature}".encode())
                if "Approach" in text:
                    good = h % 2 == 0
                else:
                    good = zlib.crc32(text.encode()) % 3 != 0 and h % 5 == 0
                words = ("good " if good else "bad ") + "step " * (h % 7)
                response = self.tokenizer(words.strip(), add_special_tokens=False).input_ids[:max_tokens]
                group.append(Sample(ids, response + [self.tokenizer.eos_token_id], words.strip(), "stop"))
            groups.append(group)
        return groups

    def push_weights(self, weights):
        pushed = {}
        for name, tensor in named_tensors(weights):  # streamed: one gathered parameter at a time
            if type(tensor) is not torch.Tensor:
                raise TypeError(f"{name}: pushed a {type(tensor).__name__}, not the full tensor")
            pushed[name] = tensor.detach().clone()
        self.pushes += 1
        self.pushed = pushed


def reward(text, problem):
    return float(text.startswith("good"))


def reflect(prompts):
    return [(f"<template>Approach {zlib.crc32(p.encode()) % 997}: write each step, then check it.</template>", True)
            for p in prompts]


def main(job_path):
    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(1)
    cfg = train.Config(**job["config"])
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(cfg.model))
    local_tokens, training_rows = [], train.training_rows

    def counting_rows(*args, **kwargs):  # this rank's response tokens per step
        rows = training_rows(*args, **kwargs)
        local_tokens.append(sum(len(r.response_ids) for r in rows))
        return rows
    train.training_rows = counting_rows
    end_epoch = train.end_epoch

    def marked_end_epoch(*args, **kwargs):  # the engine's calls in here are GEPA's answers
        engine.in_gepa = True
        try:
            return end_epoch(*args, **kwargs)
        finally:
            engine.in_gepa = False
    train.end_epoch = marked_end_epoch
    bonuses, apply_shapers = [], train.shaping.apply_shapers

    def recorded_shapers(shapers, groups, features):  # this rank's bonuses per step
        logs = apply_shapers(shapers, groups, features)
        bonuses.append([g.bonus for g in groups])
        return logs
    train.shaping.apply_shapers = recorded_shapers
    out = train.train(cfg, engine=engine, reward_fn=reward, reflector=reflect)
    rank = int(os.environ.get("RANK", "0"))
    torch.save({"state": train.fields_of(out["state"]), "pushes": engine.pushes, "pushed": engine.pushed,
                "checkpoint": out["checkpoint"],
                "local_tokens": local_tokens, "gepa_calls": engine.gepa_calls, "bonuses": bonuses,
                "shapers": [s.state_dict() for s in out["shapers"] if hasattr(s, "state_dict")]}, os.path.join(job["out"], f"rank-{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
