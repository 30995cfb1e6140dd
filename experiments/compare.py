"""P²O against its baselines at equal compute, over seeds, on held-out data: one resumable command.

    python experiments/compare.py                      # the default comparison: both tasks, every arm, 3 seeds
    python experiments/compare.py --tasks=fictional --arms=grpo_k,p2o_human --seeds=0,1
    python experiments/compare.py --quick              # a smoke test of the harness on a tiny random model (CI)
    python experiments/compare.py --report_only        # rewrite the report from the finished runs
    python experiments/compare.py --reflector=http://HOST:PORT/v1 [--reflector_model=NAME]   # + P²O Teacher-Ref

Every arm is a train.py configuration (ARMS; no second training path) on top of the task's
shared settings (TASKS). Compute matching: every arm runs until it has generated the same
number of tokens (train.py --max_gen_tokens: training rollouts + GEPA answers + reflections;
dev evaluations are not counted), so an arm that spends less per epoch trains longer; the
report gives each run's actual spend. Every run is then scored on the task's test split, which
no arm trains, mines or runs GEPA on: greedy, avg@k and pass@k, overall and per source, from
its final and from its best-dev checkpoint.

Resumable: a run with result.json is never redone; an interrupted one resumes from its last
checkpoint (train.py --resume=auto); runs already trained are only scored. Each run lives in
OUT/<task>/<arm>/seed-<s>/ (train.py's run folder, plus console.log, result.json and
train_seconds.json: wall time summed over the run's train.py processes). Stopping compare.py
(Ctrl-C or SIGTERM) stops train.py at a checkpoint. Once a run is scored its checkpoints are
deleted (1.6 GB each at 135M: the default comparison would keep ~70 GB) unless
--keep_checkpoints.

Writes OUT/report.md (per task: mean ± std over seeds of every arm, the paired difference of
each arm against GRPO (K) with a bootstrap 95% interval, per-source scores, the leak audit),
OUT/results.json (every number of every run) and OUT/<task>-dev-vs-tokens.png. Every seed is
reported; nothing is dropped.

Leak audit: every template assigned to a problem (the GEPA archives of every P²O run) is
checked against that problem's answer with the guard's own test (gepa.leaks_answer: the
answer's value anywhere in the template, digits or words). The report gives the count; it
must be 0.
"""

import argparse
import dataclasses
import glob
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data import load_jsonl, write_jsonl  # noqa: E402
from eval import answer_records, summarize_records  # noqa: E402
from gepa import leaks_answer  # noqa: E402
from model import resolve_model, tiny_random_model  # noqa: E402
from plot import read_jsonl  # noqa: E402
from runs import write_atomic  # noqa: E402


@dataclass
class Task:
    train: str  # data names or paths (data/__init__.py)
    dev: str
    test: str
    seed_templates: str  # Human-Ref's file
    arms: tuple  # the arms run by default
    budget: int  # generated tokens per run (--max_gen_tokens)
    train_per_source: int = 0  # > 0: the first N training problems of each source (a shorter epoch)


BASELINES = ("grpo_k", "grpo_2k", "dapo", "p2o_self", "p2o_human")
TASKS = {
    # the natural task: expected no P²O gain at 135M (no context unlocks its hard levels, docs/EVIDENCE.md)
    "natural": Task("builtin-train", "builtin-dev", "builtin-test", "data/builtin/human_templates.txt",
                    BASELINES, budget=15_000, train_per_source=8),
    # the mechanism test: the conversion rule exists only in a template; GRPO alone gets no signal
    "fictional": Task("fictional-train", "fictional-dev", "fictional-test", "data/fictional/facts.txt",
                      BASELINES + ("p2o_human_no_distill", "p2o_human_no_crm"), budget=30_000),
}
SEED_TEMPLATES = "<task's seed templates>"  # stands for Task.seed_templates in ARMS
ARMS = {  # train.py settings of each arm, on top of the shared ones
    "grpo_k": {"algo": "grpo"},
    "grpo_2k": {"algo": "grpo", "group_size": "2K"},  # twice the shared group size
    "dapo": {"algo": "grpo", "dynamic_sampling": True, "eps_high": 0.28},
    "p2o_self": {"algo": "p2o", "reflector": "init"},
    "p2o_human": {"algo": "p2o", "seed_templates": SEED_TEMPLATES},
    "p2o_human_no_distill": {"algo": "p2o", "seed_templates": SEED_TEMPLATES, "context_distill": False},
    "p2o_human_no_crm": {"algo": "p2o", "seed_templates": SEED_TEMPLATES, "crm": False},
    "p2o_human_same_template": {"algo": "p2o", "seed_templates": SEED_TEMPLATES, "same_template_per_group": True},
}
SHARED = {  # every arm, every task (sizes: docs/EVIDENCE.md)
    "prompts_per_step": 8, "group_size": 6, "max_tokens": 96, "epochs": 1000, "eval_every": 4, "eval_k": 0,
    "save_every": 4, "keep_checkpoints": 1, "gepa_min_hard": 4, "gepa_budget": 120, "gepa_parents": 4,
}
QUICK = {  # --quick: a tiny random model, so the harness (not the method) is what is tested
    "backend": "hf", "prompts_per_step": 4, "group_size": 3, "max_tokens": 8, "epochs": 1000, "eval_every": 2,
    "eval_k": 0, "save_every": 2, "keep_checkpoints": 1, "gepa_min_hard": 1, "gepa_budget": 40, "gepa_parents": 2, "gepa_minibatch": 1,
    "autocast_bf16": False,
}


def arm_settings(arm, task, shared):
    """train.py settings of one arm on one task: shared, then the arm's own."""
    settings = {**shared, "train_data": task.train, "dev_data": task.dev}
    for key, value in ARMS[arm].items():
        if value == SEED_TEMPLATES:
            value = os.path.join(ROOT, task.seed_templates)
        if value == "2K":
            value = 2 * settings["group_size"]
        settings[key] = value
    return settings


def source_subset(name, per_source, out_path):
    """The first per_source problems of each source of a data set, written to out_path."""
    subset, seen = [], Counter()
    for p in load_jsonl(name)[0]:
        seen[p.source] += 1
        if seen[p.source] <= per_source:
            subset.append(p)
    write_jsonl(out_path, subset)
    return out_path


# ----------------------------------------------------------------------------- one run


def repo_relative(value):
    """A path inside the repository as seen from its root (train.py runs there), so that logs and
    result.json committed under results/ name no folder of the machine they ran on; anything else
    unchanged."""
    if isinstance(value, str) and os.path.isabs(value) and os.path.commonpath([value, ROOT]) == ROOT:
        return os.path.relpath(value, ROOT)
    return value


def train_run(run_dir, settings, budget, model, seed):
    """train.py in a subprocess until the budget is spent; resumes an interrupted run."""
    out_dir, name = os.path.split(run_dir)
    args = {**settings, "model": model, "seed": seed, "max_gen_tokens": budget, "out_dir": out_dir, "run_name": name}
    if os.path.exists(os.path.join(run_dir, "latest")):
        args["resume"] = "auto"
    flags = [f"--{k}={repo_relative(v)}" for k, v in args.items()]
    os.makedirs(run_dir, exist_ok=True)
    t = time.perf_counter()
    with open(os.path.join(run_dir, "console.log"), "a") as log:
        log.write(f"\n$ python train.py {' '.join(flags)}\n")
        log.flush()
        proc = subprocess.Popen([sys.executable, "train.py", *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait()
        except BaseException as stop:  # interrupted: train.py finishes its step, checkpoints and exits
            if not isinstance(stop, KeyboardInterrupt):  # Ctrl-C reaches train.py itself; SIGTERM does not
                proc.terminate()
            proc.wait()
            raise
        finally:  # the time until the interruption counts too
            seconds = add_train_seconds(run_dir, time.perf_counter() - t)
    if code:
        raise SystemExit(f"{run_dir}: train.py exited {code}; see {run_dir}/console.log (rerun to resume)")
    return seconds


def add_train_seconds(run_dir, seconds):
    """A run's training wall time summed over its train.py processes (a resumed run has several)."""
    path = os.path.join(run_dir, "train_seconds.json")
    total = json.load(open(path))["seconds"] if os.path.exists(path) else 0.0
    write_json(path, {"seconds": total + seconds})
    return total + seconds


class Scorer:
    """Test-set scores of checkpoints with one engine, loaded once and pushed each checkpoint's weights."""

    def __init__(self, backend, k, temperature, max_tokens):
        self.backend, self.k, self.temperature, self.max_tokens, self.engine = backend, k, temperature, max_tokens, None

    def __call__(self, checkpoint, problems, seed=0):
        from safetensors.torch import load_file

        from rollout import make_rollout

        if self.engine is None:
            self.engine = make_rollout(self.backend, checkpoint, seed=seed)
        else:
            self.engine.push_weights(load_file(os.path.join(checkpoint, "model.safetensors")))
        records = answer_records(self.engine, problems, k=self.k, temperature=self.temperature,
                                 max_tokens=self.max_tokens, progress=False, seed=seed)
        overall, by_source = summarize_records(records, self.k)
        return {"overall": overall, "by_source": by_source}


def untrained_result(path, scorer, model, test):
    """The starting model's test scores (once per task, kept in path): the row every arm starts from."""
    if not os.path.exists(path):
        score = scorer(model, test)
        result = {"arm": "untrained", "seed": None, "generated_tokens": 0, "steps": 0, "train_seconds": 0.0,
                  "test": {"final": score, "best": score}, "dev": [], "templates_assigned": 0, "leaks": []}
        write_json(path, result)
    return json.load(open(path))


def write_json(path, obj):
    """Atomically (runs.write_atomic): a crash leaves the old file or the new one."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
    write_atomic(path, write)


def leak_audit(run_dir, answers):
    """(templates assigned, [(problem id, template)] that contain the problem's answer)."""
    assigned, leaks = 0, []
    for path in sorted(glob.glob(os.path.join(run_dir, "gepa-epoch-*.json"))):
        with open(path) as f:
            assignment = json.load(f)["assignment"]
        for pid, templates in assignment.items():
            for template in set(t for t in templates if t):
                assigned += 1
                if leaks_answer(template, answers[pid]):
                    leaks.append((pid, template))
    return assigned, leaks


def finish_run(run_dir, arm, seed, settings, budget, wall, scorer, test, answers):
    """Score the final and the best-dev checkpoints, audit the templates, write result.json."""
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    tokens_at = {m["step"]: m["generated_tokens"] for m in metrics}
    dev = [{**d, "generated_tokens": tokens_at.get(d["step"], 0)} for d in read_jsonl(os.path.join(run_dir, "dev.jsonl"))]
    final = os.path.realpath(os.path.join(run_dir, "latest"))
    best = os.path.realpath(os.path.join(run_dir, "best")) if os.path.exists(os.path.join(run_dir, "best")) else final
    t = time.perf_counter()
    scores = {"final": scorer(final, test)}
    scores["best"] = scores["final"] if best == final else scorer(best, test)
    score_seconds = time.perf_counter() - t
    assigned, leaks = leak_audit(run_dir, answers)
    last = metrics[-1] if metrics else {}
    settings = {k: repo_relative(v) for k, v in settings.items()}
    result = {"arm": arm, "seed": seed, "settings": settings, "budget": budget,
              "generated_tokens": last.get("generated_tokens", 0), "steps": last.get("step", 0),
              "train_seconds": wall, "score_seconds": score_seconds, "final_checkpoint": os.path.basename(final),
              "best_checkpoint": os.path.basename(best), "test": scores, "dev": dev,
              "templates_assigned": assigned, "leaks": leaks}
    write_json(os.path.join(run_dir, "result.json"), result)
    return result


def drop_checkpoints(run_dir):
    """Delete a scored run's checkpoints and their links; result.json keeps their scores and names."""
    for name in ("latest", "best"):  # a symlink, or a one-line file in runs older than links
        if os.path.lexists(os.path.join(run_dir, name)):
            os.remove(os.path.join(run_dir, name))
    for path in glob.glob(os.path.join(run_dir, "ckpt-*")):
        shutil.rmtree(path)


# ----------------------------------------------------------------------------- the report


def mean_std(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def bootstrap_ci(diffs, n=10_000, seed=0):
    """95% percentile interval of the mean of `diffs`, resampled with replacement."""
    rng = random.Random(seed)
    means = sorted(statistics.mean(rng.choices(diffs, k=len(diffs))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def metric_keys(k):
    return ["greedy"] + ([f"avg@{k}", f"pass@{k}"] if k else [])


def task_report(task_name, results, k):
    """Markdown lines for one task: {arm: [result per seed]}."""
    keys = metric_keys(k)
    lines = [f"## {task_name}", "",
             "| arm | seeds | generated tokens | steps | " + " | ".join(f"{w} {m}" for w in ("final", "best")
                                                                     for m in keys) + " |",
             "|---|---|---|---|" + "---|" * (2 * len(keys))]
    for arm, runs in results.items():
        cells = []
        for which in ("final", "best"):
            for m in keys:
                mu, sd = mean_std([r["test"][which]["overall"][m] for r in runs])
                cells.append(f"{mu:.3f} ± {sd:.3f}" if len(runs) > 1 else f"{mu:.3f}")  # one seed: no spread
        tokens = mean_std([r["generated_tokens"] for r in runs])
        lines.append(f"| {arm} | {len(runs)} | {tokens[0]:,.0f} | {statistics.mean(r['steps'] for r in runs):.1f} | "
                     + " | ".join(cells) + " |")
    base = {r["seed"]: r for r in results.get("grpo_k", [])}
    if base:
        lines += ["", "Paired difference against grpo_k (same seeds; mean, bootstrap 95% interval over seeds), "
                      "final checkpoint:", "", "| arm | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for arm, runs in results.items():
            if arm in ("grpo_k", "untrained"):
                continue
            cells = []
            for m in keys:
                diffs = [r["test"]["final"]["overall"][m] - base[r["seed"]]["test"]["final"]["overall"][m]
                         for r in runs if r["seed"] in base]
                if len(diffs) == 1:
                    cells.append(f"{diffs[0]:+.3f} (one seed)")
                elif diffs:
                    lo, hi = bootstrap_ci(diffs)
                    cells.append(f"{statistics.mean(diffs):+.3f} [{lo:+.3f}, {hi:+.3f}]")
                else:
                    cells.append("-")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    sources = sorted({s for runs in results.values() for r in runs for s in r["test"]["final"]["by_source"]})
    metric = keys[1] if k else "greedy"
    lines += ["", f"Per source, final checkpoint, {metric} (mean over seeds):", "",
              "| arm | " + " | ".join(sources) + " |", "|---|" + "---|" * len(sources)]
    for arm, runs in results.items():
        cells = [f"{statistics.mean(r['test']['final']['by_source'][s][metric] for r in runs):.3f}" for s in sources]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    assigned = sum(r["templates_assigned"] for runs in results.values() for r in runs)
    leaks = [(r["arm"], r["seed"], *leak) for runs in results.values() for r in runs for leak in r["leaks"]]
    lines += ["", f"Leak audit: {assigned} (problem, template) assignments checked, **{len(leaks)} leaks**."]
    lines += [f"- LEAK: {arm} seed {seed}: {pid}: {template!r}" for arm, seed, pid, template in leaks]
    return lines + [""]


def plot_dev(task_name, results, out_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (arm, runs) in enumerate(results.items()):
        for j, r in enumerate(r for r in runs if r["dev"]):
            ax.plot([d["generated_tokens"] for d in r["dev"]], [d["greedy"] for d in r["dev"]], marker=".",
                    color=colors[i % len(colors)], alpha=0.7, label=arm if j == 0 else None)
    ax.set_xlabel("generated tokens (rollouts + GEPA answers + reflections)")
    ax.set_ylabel("dev greedy accuracy")
    ax.set_title(f"{task_name}: every seed of every arm")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=90)
    plt.close(fig)


def write_report(out, all_results, k, command):
    runs = [r for results in all_results.values() for arm, rs in results.items() if arm != "untrained" for r in rs]
    train_h = sum(r["train_seconds"] for r in runs) / 3600
    score_h = sum(r.get("score_seconds", 0.0) for r in runs) / 3600
    unscored = sum("score_seconds" not in r for r in runs)
    lines = ["# P²O against its baselines at equal compute", "", f"Command: `{command}`", "",
             f"Wall time of the {len(runs)} runs in this report, summed: training {train_h:.2f} h, test scoring "
             f"{score_h:.2f} h" + (f" ({unscored} runs scored before scoring was timed)" if unscored else "") + ".", ""]
    for task_name, results in all_results.items():
        if results:
            lines += task_report(task_name, results, k)
            png = os.path.join(out, f"{task_name}-dev-vs-tokens.png")
            plot_dev(task_name, results, png)
            lines += [f"![dev accuracy against generated tokens]({os.path.basename(png)})", ""]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(all_results, f, indent=1)


# ----------------------------------------------------------------------------- main


def tiny_model(out):
    """--quick: a random 2-layer Llama with the default model's tokenizer (created once)."""
    path = os.path.join(out, "tiny-model")
    if not os.path.exists(os.path.join(path, "config.json")):
        tiny_random_model(resolve_model(), path)
    return path


def run_all(out, plans, seeds, shared, model, scorer, keep_checkpoints=False):
    """Train and score every run not finished yet (a run is finished once its result.json exists);
    a scored run's checkpoints are deleted unless keep_checkpoints.
    Seed-major order: a comparison cut short has every arm of the first seeds, not every seed of
    the first arms."""
    for seed in seeds:
        for task_name, (task, test, answers, budget, arms) in plans.items():
            for arm in arms:
                run_dir = os.path.join(out, task_name, arm, f"seed-{seed}")
                if os.path.exists(os.path.join(run_dir, "result.json")):
                    continue
                print(f"{task_name} / {arm} / seed {seed}: training to {budget:,} generated tokens", flush=True)
                settings = arm_settings(arm, task, shared)
                seconds = train_run(run_dir, settings, budget, model, seed)
                r = finish_run(run_dir, arm, seed, settings, budget, seconds, scorer, test, answers)
                if not keep_checkpoints:
                    drop_checkpoints(run_dir)
                greedy = r["test"]["final"]["overall"]["greedy"]
                print(f"{task_name} / {arm} / seed {seed}: {r['generated_tokens']:,} tokens, {r['steps']} steps, "
                      f"{seconds:.0f} s + {r['score_seconds']:.0f} s scoring; test greedy {greedy:.3f}", flush=True)


def collect_results(out, plans, seeds):
    """{task: {arm: [result per finished seed]}}, with the untrained model as the arm "untrained"."""
    results = {}
    for task_name, (task, test, answers, budget, arms) in plans.items():
        results[task_name] = {}
        untrained = os.path.join(out, task_name, "untrained.json")
        if os.path.exists(untrained):
            results[task_name]["untrained"] = [json.load(open(untrained))]
        for arm in arms:
            for seed in seeds:
                done = os.path.join(out, task_name, arm, f"seed-{seed}", "result.json")
                if os.path.exists(done):
                    results[task_name].setdefault(arm, []).append(json.load(open(done)))
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default=None, help=f"comma-separated: {', '.join(TASKS)} (default: all)")
    ap.add_argument("--arms", default=None, help=f"comma-separated (default: each task's own list): {', '.join(ARMS)}")
    ap.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budget", type=int, default=0, help="generated tokens per run (default: each task's own)")
    ap.add_argument("--k", type=int, default=None, help="test samples per problem for avg@k and pass@k (default 16)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--out", default="results/compare")
    ap.add_argument("--quick", action="store_true", help="tiny random model, tiny budget, 1 task, 2 arms x 2 seeds")
    ap.add_argument("--report_only", action="store_true", help="rewrite the report from the finished runs")
    ap.add_argument("--keep_checkpoints", action="store_true", help="keep each run's checkpoints after scoring")
    ap.add_argument("--reflector", default="", help="an OpenAI-compatible server: adds the p2o_teacher arm")
    ap.add_argument("--reflector_model", default="", help="the model name at --reflector ('' = its first)")
    args = ap.parse_args(argv)
    if args.quick:  # one task, 2 arms x 2 seeds, a short epoch (1 problem per source), 2 test samples
        shared, backend, per_source = QUICK, "hf", 1
        defaults = {"tasks": "fictional", "arms": "grpo_k,p2o_human", "seeds": "0,1", "k": 2, "budget": 300}
    else:
        shared, backend, per_source = SHARED, "vllm", None
        defaults = {"tasks": ",".join(TASKS), "arms": "", "seeds": "0,1,2", "k": 16, "budget": 0}
    for key, value in defaults.items():
        if getattr(args, key) in (None, 0):
            setattr(args, key, value)
    if args.reflector:  # Teacher-Ref: the API key stays in the environment (train.py --reflector_api_key_env)
        ARMS["p2o_teacher"] = {"algo": "p2o", "reflector": args.reflector, "reflector_model": args.reflector_model}
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    model = tiny_model(out) if args.quick else args.model
    if os.path.exists(model):  # a local folder named from this shell's folder; train.py runs in the repo's
        model = os.path.abspath(model)
    seeds = [int(s) for s in args.seeds.split(",")]
    scorer = Scorer(backend, args.k, args.temperature, shared["max_tokens"])
    plans = {}  # task -> (task, test problems, training answers, budget, arms)
    for task_name in args.tasks.split(","):
        task = TASKS[task_name]
        per = per_source or task.train_per_source
        if per:  # a shorter epoch: GEPA (at epoch ends) runs within the budget
            task = dataclasses.replace(task, train=source_subset(task.train, per, os.path.join(out, task_name,
                                                                                             "train.jsonl")))
        arms = args.arms.split(",") if args.arms else list(task.arms) + (["p2o_teacher"] if args.reflector else [])
        plans[task_name] = (task, load_jsonl(task.test)[0], {p.id: p.answer for p in load_jsonl(task.train)[0]},
                            args.budget or task.budget, arms)
        if not args.report_only:  # the starting model's scores first (the row every arm starts from)
            os.makedirs(os.path.join(out, task_name), exist_ok=True)
            untrained_result(os.path.join(out, task_name, "untrained.json"), scorer, resolve_model(model),
                             plans[task_name][1])
    if not args.report_only:
        run_all(out, plans, seeds, shared, model, scorer, args.keep_checkpoints)
    given = argv if argv is not None else sys.argv[1:]  # the runs' command: --report_only only rewrote this file
    command = "python experiments/compare.py " + " ".join(a for a in given if a not in ("--report_only",
                                                                                      "--keep_checkpoints"))
    write_report(out, collect_results(out, plans, seeds), args.k, command.strip())
    print(f"wrote {out}/report.md")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # train_run stops train.py too
    sys.exit(main())
