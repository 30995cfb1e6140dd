"""Training curves of a run as a PNG: python plot.py runs/NAME  ->  runs/NAME/curves.png

Reads metrics.jsonl (one line per step) and dev.jsonl (one line per dev evaluation) written by
train.py, and draws reward, zero-variance groups, dev accuracy and the step's time split.
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def read_jsonl(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run_dir):
    steps = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    dev = read_jsonl(os.path.join(run_dir, "dev.jsonl"))
    if not steps:
        raise SystemExit(f"{run_dir}/metrics.jsonl: no steps to plot")
    x = [m["step"] for m in steps]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0, 0].plot(x, [m["reward_mean"] for m in steps], label="train reward (mean)")
    ax[0, 0].plot(x, [m["zero_variance_groups"] for m in steps], label="zero-variance groups")
    ax[0, 0].plot(x, [m.get("templated_row_fraction", 0.0) for m in steps], label="templated rows (P²O)")
    ax[0, 0].set_title("rollouts")
    if dev:
        keys = [k for k in dev[0] if k == "greedy" or k.startswith("avg@")]
        for k in keys:
            ax[0, 1].plot([d["step"] for d in dev], [d[k] for d in dev], marker="o", label=f"dev {k}")
    ax[0, 1].set_title("dev accuracy")
    ax[1, 0].plot(x, [m["entropy"] for m in steps], label="policy entropy")
    ax[1, 0].plot(x, [m["response_len_mean"] / 100 for m in steps], label="response length / 100")
    ax[1, 0].set_title("policy")
    for key in ("time_generate", "time_train", "time_push", "time_score"):
        ax[1, 1].plot(x, [m[key] for m in steps], label=key[5:])
    ax[1, 1].set_title("seconds per step")
    for a in ax.flat:
        a.set_xlabel("step")
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.normpath(run_dir)))
    fig.tight_layout()
    out = os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(plot_run(sys.argv[1]))
