"""The whole training loop on a GPU against the same loop on the CPU: for a session that is lent one.

    python bench/gpu_loop.py                          # tokenizer of the default model (converted cache)
    python bench/gpu_loop.py --tokenizer=FOLDER       # any folder with the default model's tokenizer files
    python bench/gpu_loop.py --device=cpu             # the script on the CPU twice (a smoke test)

1. tests/train_dist_child.py's tiny P²O run (a random 2-layer Llama with the default model's
   tokenizer, a scripted engine and reward, DAPO refills, 2 mini-batches, KL, templated steps with
   CRM, GEPA rounds, dev evaluations, checkpoints), fp32, once with --device=cpu and once with
   --device=cuda, then resumed on cuda from its step-2 checkpoint. Printed:
     traj_rel_err   ||d_cuda - d_cpu|| / ||d_cpu||, d = theta_final - theta_0. Not 0: train.py
                    lets fp32 matmuls use TF32 on cuda. Its yardstick is measured in the same
                    run: the CPU loop under bf16 autocast against the CPU loop in fp32
                    (bf16_floor); TF32 keeps 3 more mantissa bits than bf16, so it must stay below.
     metric agreement  the largest relative difference of the logged losses and gradient norms
     p2o state      hard set, assignment, counts and GEPA history: must be equal (the scripted
                    engine and reward make them a function of the data alone)
     resume         max |theta_resumed - theta_uninterrupted| on cuda
2. `train.py --backend=hf --device=cuda` on the same tiny model, built-in data, 2 steps: HF
   generation, math-verify rewards, the push, the checkpoint (needs math-verify installed).
Nothing is downloaded; the runs go to a temporary folder. A few minutes.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from model import tiny_random_model  # noqa: E402

CHILD = os.path.join(ROOT, "tests", "train_dist_child.py")
FINAL = "ckpt-000006"


def child_config(model, data, out, device, **overrides):
    return {"model": model, "backend": "hf", "train_data": data["train"], "dev_data": data["dev"], "algo": "p2o",
            "prompts_per_step": 4, "group_size": 4, "max_tokens": 8, "temperature": 1.0, "micro_batch_size": 3,
            "mini_batches": 2, "kl_beta": 0.01, "dynamic_sampling": True, "lr": 1e-3, "warmup_steps": 1,
            "eval_every": 3, "eval_k": 2, "max_steps": 6, "save_every": 2, "autocast_bf16": False, "seed": 3,
            "tau": 2, "gepa_min_hard": 1, "gepa_budget": 30, "gepa_parents": 3, "gepa_minibatch": 1,
            "device": device, "out_dir": out, "run_name": "run", **overrides}


def launch(tmp, name, cfg):
    out = os.path.join(tmp, name)
    os.makedirs(out)
    job = os.path.join(tmp, f"{name}.json")
    with open(job, "w") as f:
        json.dump({"config": {**cfg, "out_dir": out}, "out": out}, f)
    proc = subprocess.run([sys.executable, CHILD, job], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return out


def final(out):
    return load_file(os.path.join(out, "run", FINAL, "model.safetensors"))


def ended(out):
    return torch.load(os.path.join(out, "rank-0.pt"), weights_only=False)


def metrics(out):
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def untimed(state):
    return {**state, "gepa_history": [{k: v for k, v in h.items() if k != "seconds"} for h in state["gepa_history"]]}


def compare_loops(tmp, model, device):
    rows = [{"id": f"p{i}", "problem": f"Compute {i + 1} * {i + 4} - {i}.", "answer": str((i + 1) * (i + 4) - i),
             "source": "test"} for i in range(12)]
    data = {"train": os.path.join(tmp, "train.jsonl"), "dev": os.path.join(tmp, "dev.jsonl")}
    with open(data["train"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(data["dev"], "w") as f:
        f.writelines(json.dumps({**r, "id": "d" + r["id"]}) + "\n" for r in rows[:4])
    cpu = launch(tmp, "cpu", child_config(model, data, "", "cpu"))
    cpu_bf16 = launch(tmp, "cpu_bf16", child_config(model, data, "", "cpu", autocast_bf16=True,
                                                    cpu_fp32_fallback=False))  # the bf16 floor, emulated or not
    dev = launch(tmp, "dev", child_config(model, data, "", device))
    resumed = launch(tmp, "resumed", child_config(model, data, "", device,
                                                  resume=os.path.join(dev, "run", "ckpt-000002")))
    init = load_file(os.path.join(model, "model.safetensors"))
    a, b, r, h = final(cpu), final(dev), final(resumed), final(cpu_bf16)
    moved = {k: a[k] - init[k] for k in a}
    traj_err = rel_err({k: b[k] - init[k] for k in a}, moved)
    floor = rel_err({k: h[k] - init[k] for k in a}, moved)
    keys = ("loss", "grad_norm", "kl", "crm_mean_log_ratio")
    worst = 0.0
    for x, y in zip(metrics(cpu), metrics(dev), strict=True):
        for key in keys:
            if key in x and x[key] == x[key] and x[key] != 0:
                worst = max(worst, abs(y[key] - x[key]) / abs(x[key]))
    same_state = untimed(ended(cpu)["state"]) == untimed(ended(dev)["state"])
    resume_diff = max((r[k] - b[k]).abs().max().item() for k in b)
    print(f"loop: largest relative difference of {', '.join(keys)}: {worst:.2e}")
    print(f"loop: p2o state equal on cpu and {device}: {same_state}; pushes {ended(dev)['pushes']}")
    print(f"loop: resumed from ckpt-000002 on {device}: max |resumed - uninterrupted| {resume_diff:.3e}")
    ok = traj_err <= floor and same_state
    print(f"traj_rel_err {traj_err:.4f} after 6 steps, bf16_floor {floor:.4f} "
          f"({'PASS' if ok else 'FAIL'}: <= bf16_floor, state equal)")
    return ok


def rel_err(a, b):
    """||a - b|| / ||b|| over all tensors of two state dicts."""
    num = sum(((a[k] - b[k]).double() ** 2).sum() for k in b)
    return (num / sum((b[k].double() ** 2).sum() for k in b)).sqrt().item()


def real_run(tmp, model, device):
    cmd = [sys.executable, "train.py", f"--model={model}", "--backend=hf", f"--device={device}", "--max_steps=2",
           "--prompts_per_step=4", "--group_size=4", "--max_tokens=16", "--eval_every=0", "--save_every=2",
           f"--out_dir={tmp}", "--run_name=real"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-700:])
    ok = proc.returncode == 0 and os.path.exists(os.path.join(tmp, "real", "ckpt-000002", "model.safetensors"))
    print(f"train.py --backend=hf --device={device}: exit {proc.returncode}, checkpoint written: {ok}")
    if proc.returncode:
        print(proc.stderr[-3000:])
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokenizer", default=None, help="folder with the default model's tokenizer files")
    args = ap.parse_args()
    if args.tokenizer is None:
        from model import resolve_model

        args.tokenizer = resolve_model()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_random_model(args.tokenizer, os.path.join(tmp, "tiny"), max_position_embeddings=512,
                                  initializer_range=0.2)  # the tests' tiny model
        ok = compare_loops(tmp, model, args.device)
        ok = real_run(tmp, model, args.device) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
