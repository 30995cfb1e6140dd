"""Each objective, with P²O on, for a few CPU steps on the default task (issue 53): its logged diagnostics
and its step time against the default objective's, one run after another on one machine.

    python experiments/objective_runs.py                 # every arm (skips those already done), then the report
    python experiments/objective_runs.py --report        # the report alone, from the runs' metrics.jsonl

P²O needs an epoch's end before any template exists, so the runs take every fifth problem of
builtin-train (48: 3 steps an epoch at the default 16 prompts), GEPA from 8 hard prompts with a
budget of 60 metric calls, and 6 steps: 3 plain, a GEPA round, 3 with templated (distilled, CRM-
masked) rows. Everything else is the default run's (the shipped model, vLLM, K = 6, T = 0.6, 128
tokens), and every arm has the same seed, so step 1 samples the same rollouts in every arm. GSPO's
sequence ratio is refused with the CRM (docs/METHOD.md §3), so its arm runs with --crm=False.
Each run goes to results/objectives/runs/<arm>/ (checkpoints deleted); report.md is written from
their metrics.jsonl. Step-time ratios between separate runs include the sampling noise of
different rollouts after step 1; bench/objectives.py measures the update alone, side by side.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "results", "objectives")
STEPS = 6
COMMON = ["--gepa_min_hard=8", "--gepa_budget=60", "--dev_data=", f"--max_steps={STEPS}", "--save_every=0",
          "--keep_checkpoints=1"]
ARMS = {  # name -> the flags beside COMMON (the objectives' clip settings are their presets')
    "ppo": [],
    "gspo_token": ["--policy_loss=gspo_token", "--eps_low=3e-4", "--eps_high=4e-4", "--loss_agg=seq-mean-token-mean"],
    "cispo": ["--policy_loss=cispo", "--eps_low=1.0", "--eps_high=3.0"],
    "gspo_crm_off": ["--policy_loss=gspo", "--eps_low=3e-4", "--eps_high=4e-4", "--loss_agg=seq-mean-token-mean",
                     "--crm=False"],
    "ppo_icepop": ["--sampler_correction=icepop:0.5,5"],
}
COLUMNS = ["reward_mean", "templated_row_fraction", "trained_rows", "clip_fraction", "crm_masked_fraction", "sampler_mismatch_mean",
           "sampler_kl_k1", "sampler_kl_k3", "trainer_ppl", "sampler_ppl", "corrected_token_fraction",
           "time_train", "time_step"]


def train_file():
    from data import load_jsonl, write_jsonl

    path = os.path.join(OUT, "train48.jsonl")
    if not os.path.exists(path):
        os.makedirs(OUT, exist_ok=True)
        write_jsonl(path, load_jsonl("builtin-train")[0][::5])
    return path


def metrics(arm):
    path = os.path.join(OUT, "runs", arm, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def run(arm):
    if len(metrics(arm)) == STEPS:
        print(f"{arm}: done")
        return
    run_dir = os.path.join(OUT, "runs", arm)
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished run starts again: its steps would not be comparable
    train_data, out_dir = (os.path.relpath(p, ROOT) for p in (train_file(), os.path.join(OUT, "runs")))  # no machine paths
    cmd = [sys.executable, "train.py", f"--train_data={train_data}", f"--out_dir={out_dir}",
           f"--run_name={arm}", *COMMON, *ARMS[arm]]
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    for name in os.listdir(run_dir):  # the weights are not results
        if name.startswith(("ckpt-", "export-")) or name in ("latest", "best", "engine.log"):  # the log names paths
            path = os.path.join(run_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def fmt(v):
    return "—" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


def report():
    lines = ["# Each objective with P²O on, a few CPU steps (issue 53)", "",
             "Written by `python experiments/objective_runs.py --report` from `runs/<arm>/metrics.jsonl`; how the runs",
             "were made: the script's docstring. Steps 1-3 are plain (epoch 0), a GEPA round follows, steps 4-6 carry",
             "templated rows. One machine, one run after another.", ""]
    base = metrics("ppo")
    lines += ["Step times between separate runs are not a cost comparison: after step 1 each arm samples its own",
              "rollouts, so it forwards its own number of rows (a group whose rewards are all equal is not forwarded),",
              "and other work shared the machine while some of these ran. What an objective costs is measured side",
              "by side on one batch by `bench/objectives.py`: `bench.txt` here.", "",
              "| arm | flags | steps | templated rows (4-6) | rows forwarded (4-6) | mean time_train s (4-6) | "
              "mean time_step s (4-6) | step time / ppo's |", "|---|---|---|---|---|---|---|---|"]
    for arm, flags in ARMS.items():
        ms = metrics(arm)
        if not ms:
            lines.append(f"| {arm} | `{' '.join(flags)}` | not run | | | |")
            continue
        late = [m for m in ms if m["step"] > 3]
        step = statistics.mean(m["time_step"] for m in late) if late else float("nan")
        ref = statistics.mean(m["time_step"] for m in base if m["step"] > 3) if base else float("nan")
        lines.append(f"| {arm} | `{' '.join(flags) or '(default)'}` | {len(ms)} | "
                     f"{statistics.mean(m['templated_row_fraction'] for m in late):.2f} | "
                     f"{sum(m['trained_rows'] for m in late)} | "
                     f"{statistics.mean(m['time_train'] for m in late):.1f} | {step:.1f} | {step / ref:.3f} |")
    lines += ["", "GEPA's round after epoch 0 (the 135M policy reflecting on its own failures; `gepa-epoch-0.json`): the",
              "pool it kept and the templates it chose for the hard prompts ('' is no template, so no templated rows):", ""]
    for arm in ARMS:
        path = os.path.join(OUT, "runs", arm, "gepa-epoch-0.json")
        if os.path.exists(path):
            with open(path) as f:
                g = json.load(f)
            lines.append(f"- {arm}: pool {g['pool']}, chosen {[g['pool'][i] for i in g['chosen']]}")
    lines += ["", "Every logged diagnostic, per step:", ""]
    for arm in ARMS:
        ms = metrics(arm)
        if not ms:
            continue
        lines += [f"### {arm}", "", "| step | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
        lines += ["| " + " | ".join([str(m["step"])] + [fmt(m.get(c)) for c in COLUMNS]) + " |" for m in ms]
        lines.append("")
    with open(os.path.join(OUT, "report.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines[:14]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", action="store_true", help="only write report.md from the runs there are")
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args(argv)
    if not args.report:
        for arm in args.arms.split(","):
            run(arm)
    report()


if __name__ == "__main__":
    main()
