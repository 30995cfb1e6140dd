"""Child process for tests/test_train_crash.py: a tiny P²O run that can SIGKILL itself at a chosen point.

    python tests/crash_child.py --model=DIR --data=FILE --out=DIR [--resume] [--kill=POINT] [--slow=SECONDS] [--lora]

Kill points (each a real `os.kill(os.getpid(), signal.SIGKILL)`):
    partial-N   inside the Nth torch.save into a `.partial-*` checkpoint folder of this process,
                after the model and tokenizer files and half of trainer.pt's bytes are written
    trainer-tmp inside runs.write_atomic of a trainer.pt after the GEPA round (gepa-epoch-0.json
                exists): the temp file is written, the rename has not happened
    gepa-N      inside the GEPA round: the reflector's Nth call in this process
--slow=S sleeps S seconds before each training-step generation, so that a parent polling
metrics.jsonl can SIGKILL the child in a step's generation. Every scripted piece (engine marks,
reward, reflector) is a pure function of its inputs, so a fresh process reproduces a run.
"""

import argparse
import io
import os
import signal
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

import runs
import train
from rollout import HFRollout

RUN_NAME = "crash"


def die():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class MarkingEngine:
    """HF rollouts on the tiny model; the text of a rollout whose prompt carried a template
    ('Approach ...') gets a marker, so the scripted reward can favour templated answers."""

    def __init__(self, path, slow):
        self.hf, self.slow = HFRollout(path), slow

    def generate(self, prompts, **kw):
        if self.slow and "seed" in kw and "top_p" in kw:  # a training step's generation (not GEPA's)
            time.sleep(self.slow)
        groups = self.hf.generate(prompts, **kw)
        for p, g in zip(prompts, groups):
            if "Approach" in p[-1]["content"]:
                for s in g:
                    s.text += " <marked>"
        return groups

    def push_weights(self, state_dict):
        return self.hf.push_weights(state_dict)


def reward(text, problem):
    """About half of the marked (templated) answers score 1, a fifth of the plain ones: epoch 0
    trains too, and most of its groups stay below tau = 2 successes (hard prompts for GEPA)."""
    h = zlib.crc32(f"{problem.id}|{text}".encode())
    return float(h % 2 == 1 if text.endswith("<marked>") else h % 5 == 0)


def make_reflector(kill_on_call):
    calls = [0]

    def reflect(prompts):
        calls[0] += 1
        if calls[0] == kill_on_call:
            die()
        out = []
        for p in prompts:
            tag = zlib.crc32(p.encode()) % 997  # stable across processes, unlike hash()
            out.append((f"<template>Approach {tag}: write each step, then check it.</template>", True))
        return out
    return reflect


def kill_in_partial_save(n):
    real_save, seen = torch.save, [0]

    def save(obj, f, *args, **kwargs):
        if isinstance(f, str) and os.path.basename(os.path.dirname(f)).startswith(".partial-"):
            seen[0] += 1
            if seen[0] == n:
                buf = io.BytesIO()
                real_save(obj, buf, *args, **kwargs)
                data = buf.getvalue()
                with open(f, "wb") as out:
                    out.write(data[:len(data) // 2])
                die()
        return real_save(obj, f, *args, **kwargs)
    torch.save = save  # runs.torch is this same module


def kill_in_trainer_replace(run_dir):
    real = runs.write_atomic

    def write_atomic(path, write):
        if os.path.basename(path) == "trainer.pt" and os.path.exists(os.path.join(run_dir, "gepa-epoch-0.json")):
            def write_then_die(tmp):
                write(tmp)
                die()
            return real(path, write_then_die)
        return real(path, write)
    runs.write_atomic = write_atomic  # save_checkpoint looks the name up in runs at call time


def config(args):
    return train.Config(
        model=args.model, backend="hf", train_data=args.data, dev_data="", algo="p2o",
        prompts_per_step=3, group_size=4, max_tokens=6, temperature=1.0, micro_batch_size=5, lr=1e-3,
        warmup_steps=1, eval_every=0, epochs=2, max_steps=0, save_every=3, keep_checkpoints=0, autocast_bf16=False, seed=5,
        tau=2, gepa_min_hard=1, gepa_budget=30, gepa_parents=3, gepa_minibatch=1,
        out_dir=args.out, run_name=RUN_NAME, resume="auto" if args.resume else "",
        lora_rank=4 if args.lora else 0, lora_alpha=8)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill", default="")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (rank 4) instead of every weight")
    args = parser.parse_args()
    torch.set_num_threads(1)
    point, _, number = args.kill.partition("-")
    reflect_kill = 0
    if point == "partial":
        kill_in_partial_save(int(number))
    elif point == "trainer":
        kill_in_trainer_replace(os.path.join(args.out, RUN_NAME))
    elif point == "gepa":
        reflect_kill = int(number)
    elif args.kill:
        raise SystemExit(f"unknown kill point {args.kill!r}")
    out = train.train(config(args), engine=MarkingEngine(args.model, args.slow), reward_fn=reward,
                      reflector=make_reflector(reflect_kill))
    print(f"finished at step {out['step']}: {out['checkpoint']}")


if __name__ == "__main__":
    main()
