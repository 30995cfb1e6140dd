"""P²O against its baselines at an equal generated-token budget, over seeds, on held-out data: one resumable
command.

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
no arm trains, mines or runs GEPA on, and on its held-out split (untemplated, and templated
with the task's rule) where it has one: greedy, avg@k and pass@k, overall and per source, from
its final checkpoint (and its best-dev one where Task.score_best).

Resumable: a run with result.json is never redone; an interrupted one resumes from its last
checkpoint (train.py --resume=auto); runs already trained are only scored. Each run lives in
OUT/<task>/<arm>/seed-<s>/ (train.py's run folder, plus console.log, result.json and
train_seconds.json: wall time summed over the run's train.py processes). Stopping compare.py
(Ctrl-C or SIGTERM) stops train.py at a checkpoint. Once a run is scored its checkpoints are
deleted (1.6 GB each at 135M: the default comparison would keep ~70 GB) unless
--keep_checkpoints.

Writes OUT/report.md (per task: mean ± sd over seeds of every arm with its compute, the paired
difference of each arm against GRPO (K) with a t-interval over seeds, a hierarchical bootstrap
and a sign-flip p (experiments/report.py), the CRM probe, the leak audit), OUT/results.json
(every number of every run; per-problem rows stay in each run's problems.jsonl) and
OUT/<task>-dev-vs-tokens.png. Every seed is reported; nothing is dropped.

Leak audit: every template assigned to a problem (the GEPA archives of every P²O run) is
checked against that problem's answer with the guard's own test (gepa.leaks_answer: the
answer's value anywhere in the template, digits or words). The report gives the count; it
must be 0.
"""

import argparse
import dataclasses
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data import load_jsonl, write_jsonl  # noqa: E402
from scoring import answer_sets, summarize_records  # noqa: E402
from gepa import leaks_answer  # noqa: E402
from model import resolve_model, tiny_random_model  # noqa: E402
from plot import read_jsonl  # noqa: E402
from runs import GENERATED, write_atomic  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import BASELINE, REGISTRATIONS, futile, read_problems, write_report  # noqa: E402


@dataclass
class Task:
    train: str  # data names or paths (data/__init__.py)
    dev: str
    test: str
    seed_templates: str  # Human-Ref's file
    arms: tuple  # the arms run by default
    budget: int  # generated tokens per run (--max_gen_tokens)
    train_per_source: int = 0  # > 0: the first N training problems of each source (a shorter epoch)
    heldout: str = ""  # a second test set: problems whose answers no training problem has
    templated: bool = False  # also score the held-out set with the seed template in every prompt
    score_best: bool = True  # also score the best-dev checkpoint (where it is not the final one)
    seeds: dict = dataclasses.field(default_factory=dict)  # arm -> seeds, for arms run on more than --seeds
    crm_probe: tuple = ()  # (question, correct templated response): per-token CRM ratios of every run's policy
    seed_free: tuple = ()  # arms whose training does not depend on the seed: two seeds show it (report.py)
    contrasts: tuple = ()  # (arm, other arm) pairs also paired with each other in the report (post hoc)
    greedy_only: tuple = ()  # sets scored by their greedy answers only (no samples)
    gold: str = ""  # a set whose gold answers' log-probs are scored at the end of every run (experiments/gold_logprob.py)
    fact: str = ""  # ... and the log-prob of this string's tokens in each gold answer
    prereg: str = ""  # the task's pre-registration (a confirmatory study): the report tests it (report.confirm_report)
    noise: str = ""  # the untrained model's scoring noise (experiments/scoring_noise.py): the learn threshold's base


BASELINES = ("grpo_k", "grpo_2k", "dapo", "p2o_self", "p2o_human")
CONFIRM_ARMS = ("grpo_k", "p2o_human", "p2o_human_no_crm", "rs_distill")  # docs/PREREGISTRATION.md
CONFIRM_SEEDS = tuple(range(100, 114))  # new seeds: 0-4 made the hypothesis (14 an arm: Deviation 1)
CONFIRM_CONTROL_SEEDS = tuple(range(100, 118))
STRATEGY_ARMS = ("grpo_k", "p2o_human", "p2o_human_no_crm", "rs_distill")  # docs/PREREGISTRATION-v4.md
STRATEGY_SEEDS = tuple(range(200, 212))  # new seeds: 0 and 1 were the training pilot
FIVE_SEEDS = ("grpo_k", "p2o_human", "p2o_human_no_crm", "rs_distill", "sft_gold", "p2o_human_crm_low",
              "p2o_human_crm_soft", "p2o_self_official")  # fictional: the arms run on five seeds
TASKS = {
    # the natural task: expected no P²O gain at 135M (no context unlocks its hard levels, docs/EVIDENCE.md)
    "natural": Task("builtin-train", "builtin-dev", "builtin-test", "data/builtin/human_templates.txt",
                    BASELINES, budget=15_000, train_per_source=8),
    # the mechanism test: the conversion rule exists only in a template; GRPO alone gets no signal
    # the five-seed arms first (run_all is seed-major): a comparison cut short has them complete
    "fictional": Task("fictional-train", "fictional-dev", "fictional-test", "data/fictional/facts.txt",
                      FIVE_SEEDS + ("grpo_2k", "dapo", "p2o_self", "p2o_human_no_distill"), budget=30_000,
                      heldout="fictional-heldout", templated=True, score_best=False,
                      seeds={arm: (0, 1, 2, 3, 4) for arm in FIVE_SEEDS} | {"sft_gold": (0, 1)},
                      # 40 training problems, 48 gold rows a step: every step is the whole set, one
                      # optimiser step, so the seed changes only the order of a sum (seeds 0 and 1 alike)
                      seed_free=("sft_gold",),
                      # what the mechanism predicts between arms (docs/EVIDENCE.md), chosen after the runs
                      contrasts=(("p2o_human_no_crm", "p2o_human"), ("p2o_human_crm_low", "p2o_human_no_crm"),
                                 ("p2o_human_crm_low", "p2o_human"), ("p2o_human_crm_soft", "p2o_human"),
                                 ("rs_distill", "p2o_human_no_crm")),
                      crm_probe=("How many snigs are in 2 plonks?",
                                 "2 plonks = 2 × 13 = 26 snigs. The answer is \\boxed{26}.")),
    # the confirmatory study (docs/PREREGISTRATION.md): the fictional task, four arms, new seeds, the
    # held-out gold answers' log-probs as its primary outcome; not among the default tasks
    "confirm": Task("fictional-train", "fictional-dev", "fictional-test", "data/fictional/facts.txt", CONFIRM_ARMS,
                    budget=30_000, heldout="fictional-heldout", templated=True, score_best=False,
                    seeds={arm: CONFIRM_CONTROL_SEEDS if arm == "grpo_k" else CONFIRM_SEEDS for arm in CONFIRM_ARMS},
                    greedy_only=("test", "heldout_templated"), gold="heldout", fact="13",
                    prereg="docs/PREREGISTRATION.md", noise="results/compare/scoring-noise/fictional.json",
                    crm_probe=("How many snigs are in 2 plonks?",
                               "2 plonks = 2 × 13 = 26 snigs. The answer is \\boxed{26}.")),
    # the v4 study (docs/PREREGISTRATION-v4.md): a template that carries a procedure (a negative result's sign),
    # not a fact; the positive problems keep GRPO (K) learning. Not among the default tasks
    "subtract": Task("subtract-train", "subtract-dev", "subtract-test", "data/subtract/strategy.txt", STRATEGY_ARMS,
                     budget=30_000, heldout="subtract-heldout", templated=True, score_best=False,
                     greedy_only=("test", "heldout_templated"), gold="heldout", fact="-",
                     seeds={arm: STRATEGY_SEEDS for arm in STRATEGY_ARMS}, prereg="docs/PREREGISTRATION-v4.md",
                     crm_probe=("What is 24 − 29?", "24 − 29 = -5. The answer is \\boxed{-5}.")),
}
DEFAULT_TASKS = ("natural", "fictional")  # what compare.py runs without --tasks
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
    # CRM dose-response: a band wide enough to keep the fact's token (log c -7.91 > log 1e-4), and soft weights
    "p2o_human_crm_low": {"algo": "p2o", "seed_templates": SEED_TEMPLATES, "crm_low": 1e-4},
    "p2o_human_crm_soft": {"algo": "p2o", "seed_templates": SEED_TEMPLATES, "crm_soft": True},
    # rejection-sampling distillation: the seed template on every prompt from step 1, no GEPA; the
    # correct answers trained under the plain prompt by maximum likelihood (A = r, failures dropped), no CRM
    "rs_distill": {"algo": "grpo", "fixed_template": SEED_TEMPLATES, "adv_norm": "raw",
                   "drop_failed_templated": True, "crm": False},
    # supervised fine-tuning on the gold solutions under the plain prompt: a step of B x K gold rows
    # (as many rows as an RL step), its gold tokens counted against the budget, log-probs at T = 1
    "sft_gold": {"algo": "sft", "prompts_per_step": "BxK", "group_size": 1, "temperature": 1.0},
    # the sibling methods on the reward-shaping hook (docs/METHOD.md §10): CLIPO with the release's constants
    # (no frozen warm-up: a budget of a few steps), and our n-gram agreement bonus
    "grpo_clipo": {"algo": "grpo", "clipo_weight": 0.2},
    "grpo_agreement": {"algo": "grpo", "agreement_bonus": 0.2},
    # Self-Ref with the reference code's reflection prompt (asks for domain facts), as its preset sends it
    "p2o_self_official": {"algo": "p2o", "reflector": "init", "reflect_prompt": "official", "reflect_guards": False,
                          "reflect_temperature": 0.6, "reflect_max_tokens": 256},
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
        if value == "BxK":
            value = settings["prompts_per_step"] * settings["group_size"]
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
        log.write(f"\n# code at commit {code_commit()}\n$ python train.py {' '.join(flags)}\n")
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


def code_commit():
    """The commit of the code this process runs ("+changes" when the checkout differs from it): console.log
    records it for every train.py process of a run, result.json for its scoring."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!results") else "")


def add_train_seconds(run_dir, seconds):
    """A run's training wall time summed over its train.py processes (a resumed run has several)."""
    path = os.path.join(run_dir, "train_seconds.json")
    total = json.load(open(path))["seconds"] if os.path.exists(path) else 0.0
    write_json(path, {"seconds": total + seconds})
    return total + seconds


class Scorer:
    """Test scores of checkpoints with one engine, loaded once and pushed each checkpoint's weights.
    A checkpoint's sets [(name, problems, template, k)] are answered together (scoring.answer_sets:
    one engine call for the greedy answers and the samples); the sampling seed is the same
    for every checkpoint, so arms are compared on common random numbers."""

    def __init__(self, backend, temperature, max_tokens, dtype=""):  # "": config.default_engine_dtype
        self.backend, self.temperature, self.max_tokens, self.dtype, self.engine = backend, temperature, max_tokens, \
            dtype, None
        self.loaded = None  # the checkpoint whose weights the engine holds

    def __call__(self, checkpoint, sets, seed=0):
        """-> {set name: {"overall", "by_source"}}, [per-problem row] (problem_rows)."""
        from safetensors.torch import load_file

        from config import default_engine_dtype
        from rollout import make_rollout

        if self.engine is None:
            self.engine = make_rollout(self.backend, checkpoint, seed=seed, dtype=self.dtype or default_engine_dtype())
        elif checkpoint != self.loaded:
            self.engine.push_weights(load_file(os.path.join(checkpoint, "model.safetensors")))
        self.loaded = checkpoint
        answered = answer_sets(self.engine, [(problems, template, k) for _, problems, template, k in sets],
                               temperature=self.temperature, max_tokens=self.max_tokens, progress=False, seed=seed)
        scores, rows = {}, []
        for (name, _, template, k), records in zip(sets, answered):
            overall, by_source = summarize_records(records, k)
            scores[name] = {"overall": overall, "by_source": by_source}
            rows += problem_rows(name, bool(template), k, records)
        return scores, rows


def problem_rows(set_name, templated, k, records):
    """One small row per problem: greedy correct (0/1), correct samples of k, the greedy answer."""
    return [{"set": set_name, "templated": templated, "id": r["id"], "greedy": r["rewards"][0],
             "correct": int(sum(r["sampled"]["rewards"])) if k else 0, "k": k, "greedy_response": r["responses"][0]}
            for r in records]


def score_sets(task, test, heldout, rule, k, k_templated):
    """What a checkpoint is scored on: the test split, the held-out split, and the held-out split
    with the seed template in every prompt (templated tasks); a set in task.greedy_only without samples."""
    sets = [("test", test, "", k)]
    if heldout:
        sets.append(("heldout", heldout, "", k))
        if task.templated:
            sets.append(("heldout_templated", heldout, rule, k_templated))
    return [(name, problems, template, 0 if name in task.greedy_only else n) for name, problems, template, n in sets]


def gold_scores(run_dir, checkpoint, task, sets):
    """The task's gold log-probs (experiments/gold_logprob.py) of a checkpoint on its gold set:
    per-problem rows to run_dir/gold.jsonl, the summary returned ({} when the task has none), with
    one per source where the set has several."""
    if not task.gold:
        return {}
    from experiments.gold_logprob import score_checkpoint, summary

    problems = next(problems for name, problems, _, _ in sets if name == task.gold)
    rows = score_checkpoint(checkpoint, problems, task.fact)
    write_jsonl_rows(os.path.join(run_dir, "gold.jsonl"), rows)
    source = {p.id: p.source for p in problems}
    sources = list(dict.fromkeys(source.values()))
    by_source = {src: summary([r for r in rows if source[r["id"]] == src]) for src in sources}
    return {task.gold: summary(rows) | ({"by_source": by_source} if len(sources) > 1 else {})}


def untrained_result(run_dir, scorer, model, sets, probe=None, task=None):
    """The starting model's scores (once per task, in run_dir): the row every arm starts from."""
    path = os.path.join(run_dir, "result.json")
    if not os.path.exists(path):
        os.makedirs(run_dir, exist_ok=True)
        scores, rows = scorer(model, sets)
        write_jsonl_rows(os.path.join(run_dir, "problems.jsonl"), [{**r, "checkpoint": "final"} for r in rows])
        if probe:
            write_json(os.path.join(run_dir, "crm_tokens.json"), crm_probe(model, *probe))
        result = {"arm": "untrained", "seed": None, "generated_tokens": 0, "steps": 0, "train_seconds": 0.0,
                  "test": {"final": scores["test"], "best": scores["test"]}, "sets": {"final": scores},
                  "dev": [], "templates_assigned": 0, "leaks": [], "flops": 0.0}
        if task is not None and task.gold:
            result["gold"] = gold_scores(run_dir, model, task, sets)
        write_json(path, result)
    return json.load(open(path))


def write_jsonl_rows(path, rows):
    """Atomically, one JSON object a line."""
    def write(tmp):
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    write_atomic(path, write)


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


def finish_run(run_dir, arm, seed, settings, budget, wall, scorer, sets, answers, task, base):
    """Score the final (and, where the task asks, the best-dev) checkpoint on every set, probe the
    CRM ratios, audit the templates; write problems.jsonl, then result.json (its presence marks
    the run finished). A final checkpoint whose weights equal the starting model's (no update
    ever had a gradient) takes the untrained model's scores and per-problem rows, said so in
    result.json["scored_as"]."""
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    tokens_at = {m["step"]: m["generated_tokens"] for m in metrics}
    dev = [{**d, "generated_tokens": tokens_at.get(d["step"], 0)} for d in read_jsonl(os.path.join(run_dir, "dev.jsonl"))]
    final = os.path.realpath(os.path.join(run_dir, "latest"))
    best = os.path.realpath(os.path.join(run_dir, "best")) if os.path.exists(os.path.join(run_dir, "best")) else final
    if not task.score_best:
        best = final
    t = time.perf_counter()
    scored_as = "own"
    if same_weights(final, base["model"]):
        scored_as = "untrained (the final weights equal the starting model's)"
        scores = {"final": base["result"]["sets"]["final"]}
        rows = [{**r, "checkpoint": "final"} for r in read_jsonl(os.path.join(base["dir"], "problems.jsonl"))]
    else:
        scores, rows = {}, []
        for which, path in (("final", final), ("best", best)):
            if which == "best" and path == final:
                break
            scores[which], got = scorer(path, sets if which == "final" else sets[:1])
            rows += [{**r, "checkpoint": which} for r in got]
    score_seconds = time.perf_counter() - t
    write_jsonl_rows(os.path.join(run_dir, "problems.jsonl"), rows)
    if task.crm_probe:
        write_json(os.path.join(run_dir, "crm_tokens.json"),
                   crm_probe(final, *task.crm_probe, first_template(task.seed_templates)))
    gold = gold_scores(run_dir, final, task, sets)
    assigned, leaks = leak_audit(run_dir, answers)
    last = metrics[-1] if metrics else {}
    settings = {k: repo_relative(v) for k, v in settings.items()}
    test = {"final": scores["final"]["test"], "best": scores.get("best", scores["final"])["test"]}
    result = {"arm": arm, "seed": seed, "settings": settings, "budget": budget, "scored_at_commit": code_commit(),
              "generated_tokens": last.get("generated_tokens", 0), "steps": last.get("step", 0),
              "train_seconds": wall, "score_seconds": score_seconds, "scored_as": scored_as,
              "final_checkpoint": os.path.basename(final), "best_checkpoint": os.path.basename(best),
              "test": test, "sets": scores, "dev": dev, "templates_assigned": assigned, "leaks": leaks,
              "counts": last.get("counts", {}), "flops": flops(last.get("counts", {}), base["params"]),
              "shaping": shaping_summary(metrics)} | ({"gold": gold} if gold else {})
    write_json(os.path.join(run_dir, "result.json"), result)
    return result


def shaping_summary(metrics):
    """What reward shaping did over a run (train.py's shaping_* metrics; {} for an arm without it):
    per step, the fraction of groups shaped and of groups whose advantage order changed or
    reversed, the mean bonus; here their means over the steps, and the steps."""
    steps = [m for m in metrics if "shaping_groups" in m]
    keys = ("shaping_groups", "shaping_order_changed", "shaping_order_reversed", "shaping_bonus_mean")
    return {k: sum(m[k] for m in steps) / len(steps) for k in keys} | {"steps": len(steps)} if steps else {}


def same_weights(checkpoint, model):
    """True when the checkpoint's tensors equal the model's (compared in float32)."""
    from safetensors import safe_open

    paths = [sorted(glob.glob(os.path.join(p, "*.safetensors"))) for p in (checkpoint, model)]
    if not all(paths):
        return False
    tensors = []
    for files in paths:
        out = {}
        for path in files:
            with safe_open(path, "pt") as f:
                out.update({k: f.get_tensor(k).float() for k in f.keys()})
        tensors.append(out)
    a, b = tensors
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def param_count(model):
    """Parameters of a model folder's safetensors (a tied embedding counted once)."""
    from safetensors import safe_open

    total = 0
    for path in glob.glob(os.path.join(model, "*.safetensors")):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                total += math.prod(f.get_slice(k).get_shape())
    return total


def flops(counts, params):
    """Training compute of a run from train.py's token counts: 2N FLOPs per token through a forward
    (generation's prompts and answers -- rollouts, GEPA's answers, reflections --, the CRM pass
    and other no-grad forwards) and 6N per token trained (forward + backward), N = parameters
    (the tied embedding once: it is the output layer's matmul). The attention's context term
    (under 5% at these lengths) is left out."""
    forward = sum(v for k, v in counts.items() if k.endswith("prefill_tokens"))
    forward += sum(counts.get(k, 0) for k in GENERATED if k != "gold_tokens") + counts.get("nograd_tokens", 0)
    return 2.0 * params * forward + 6.0 * params * counts.get("train_fb_tokens", 0)


def crm_probe(model, question, response, rule):
    """experiments/crm_tokens.py's per-token table for the probe (question, response) under the
    task's rule as the template, on one policy: [{token, logp_plain, logp_templated, log_c, masked}]."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from experiments.crm_tokens import token_ratios

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    rows = token_ratios(policy, tokenizer, question, response, rule)
    return [{"token": t, "logp_plain": p, "logp_templated": q, "log_c": c, "masked": m} for t, p, q, c, m in rows]


def first_template(path):
    """The first template of a seed-templates file (the task's rule)."""
    from gepa import read_seed_templates

    return read_seed_templates(os.path.join(ROOT, path), 10_000)[0]


def drop_checkpoints(run_dir):
    """Delete a scored run's checkpoints and their links; result.json keeps their scores and names."""
    for name in ("latest", "best"):  # a symlink, or a one-line file in runs older than links
        if os.path.lexists(os.path.join(run_dir, name)):
            os.remove(os.path.join(run_dir, name))
    for path in glob.glob(os.path.join(run_dir, "ckpt-*")):
        shutil.rmtree(path)


# ----------------------------------------------------------------------------- main


def tiny_model(out):
    """--quick: a random 2-layer Llama with the default model's tokenizer (created once)."""
    path = os.path.join(out, "tiny-model")
    if not os.path.exists(os.path.join(path, "config.json")):
        tiny_random_model(resolve_model(), path)
    return path


@dataclass
class Plan:
    """One task of a comparison: what its runs train on and are scored on."""
    task: Task
    sets: list  # [(name, problems, template, k)] (score_sets)
    answers: dict  # training problem id -> answer (the leak audit)
    budget: int
    arms: list
    seeds: dict  # arm -> seeds


def run_all(out, plans, shared, model, scorer, keep_checkpoints=False, commit=False):
    """Train and score every run not finished yet (a run is finished once its result.json exists);
    a scored run's checkpoints are deleted unless keep_checkpoints; commit: each finished run's
    folder is committed to git at once (commit_run).
    Order: the arms a task runs on more seeds (Task.seeds) first, then the others; within each,
    seed-major, so a comparison cut short has every arm of the first seeds, not every seed of
    the first arms."""
    jobs = sorted(((arm not in plan.task.seeds, seed, i, task_name, arm) for task_name, plan in plans.items()
                   for i, arm in enumerate(plan.arms) for seed in plan.seeds[arm]))
    bases = {}
    for _, seed, _, task_name, arm in jobs:
        plan = plans[task_name]
        run_dir = os.path.join(out, task_name, arm, f"seed-{seed}")
        if os.path.exists(os.path.join(run_dir, "result.json")):
            continue
        if plan.task.prereg and futile(arm, [load_run(d) for d in finished_runs(out, task_name, arm)],
                                       plan.task.seeds.get(arm), REGISTRATIONS[plan.task.prereg].gepa_arms):
            print(f"{task_name} / {arm}: stopped by the futility rule ({plan.task.prereg})", flush=True)
            continue
        print(f"{task_name} / {arm} / seed {seed}: training to {plan.budget:,} generated tokens", flush=True)
        settings = arm_settings(arm, plan.task, shared)
        base = bases[task_name] = bases.get(task_name) or untrained_base(out, task_name, model)
        seconds = train_run(run_dir, settings, plan.budget, model, seed)
        r = finish_run(run_dir, arm, seed, settings, plan.budget, seconds, scorer, plan.sets, plan.answers,
                       plan.task, base)
        if not keep_checkpoints:
            drop_checkpoints(run_dir)
        if commit:
            commit_run(run_dir, f"{task_name} / {arm} / seed {seed}: {r['generated_tokens']:,} generated tokens, "
                                f"{r['steps']} steps")
        scores = "; ".join(f"{name} greedy {v['overall']['greedy']:.3f}" for name, v in r["sets"]["final"].items())
        print(f"{task_name} / {arm} / seed {seed}: {r['generated_tokens']:,} tokens, {r['steps']} steps, "
              f"{seconds:.0f} s + {r['score_seconds']:.0f} s scoring; {scores}", flush=True)


def commit_run(run_dir, message, tries=10, repo=None):
    """git add + commit of one run's folder only (what .gitignore leaves of it), so a long study
    keeps every finished run even if the session ends; other staged or changed files are not
    committed. Retried while another git command holds the index lock. The repository is the one
    that holds the folder once links are followed (repo=None), so a study run from a frozen
    checkout whose results/ links to the working repository's commits there."""
    run_dir = os.path.realpath(run_dir)
    if repo is None:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=run_dir, capture_output=True, text=True)
        repo = top.stdout.strip() or ROOT
    for attempt in range(tries):
        add = subprocess.run(["git", "add", "--", run_dir], cwd=repo, capture_output=True, text=True)
        if add.returncode == 0 and subprocess.run(["git", "diff", "--cached", "--quiet", "--", run_dir],
                                                  cwd=repo).returncode == 0:
            return True  # nothing new in it (committed before)
        name = os.path.relpath(run_dir, repo)
        done = add.returncode == 0 and subprocess.run(
            ["git", "commit", "-q", "-m", f"{name}: {message}", "--", run_dir], cwd=repo,
            capture_output=True, text=True).returncode == 0
        if done:
            return True
        time.sleep(2 + attempt)
    print(f"{run_dir}: not committed (git failed {tries} times); commit it by hand", flush=True)
    return False


def finished_runs(out, task_name, arm):
    """The run folders of an arm that have their result.json."""
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(out, task_name, arm, "seed-*", "result.json")))


def untrained_base(out, task_name, model):
    """The starting model and its scored run (untrained_result), for finish_run's equal-weights case."""
    run_dir = os.path.join(out, task_name, "untrained")
    path = resolve_model(model)
    return {"dir": run_dir, "model": path, "params": param_count(path),
            "result": json.load(open(os.path.join(run_dir, "result.json")))}


def collect_results(out, plans):
    """{task: {arm: [result per finished seed]}}, with the untrained model as the arm "untrained"
    (untrained/result.json; untrained.json in comparisons run before per-problem results)."""
    results = {}
    for task_name, plan in plans.items():
        results[task_name] = {}
        if os.path.exists(os.path.join(out, task_name, "untrained", "result.json")):
            results[task_name]["untrained"] = [load_run(os.path.join(out, task_name, "untrained"))]
        elif os.path.exists(os.path.join(out, task_name, "untrained.json")):
            results[task_name]["untrained"] = [json.load(open(os.path.join(out, task_name, "untrained.json")))]
        for arm in plan.arms:
            for seed in plan.seeds[arm]:
                run_dir = os.path.join(out, task_name, arm, f"seed-{seed}")
                if os.path.exists(os.path.join(run_dir, "result.json")):
                    results[task_name].setdefault(arm, []).append(load_run(run_dir))
    return results


def run_command(task_name, runs, shared, budget):
    """The compare.py command that made a task's runs: a --set for every setting that all of them
    share beyond `shared` (e.g. engine_dtype on a CPU without bf16), --budget if not the task's."""
    common, budgets = None, set()
    for r in runs:
        own = {key: value for key, value in r["settings"].items() if key not in ARMS.get(r["arm"], {})
               and key not in ("train_data", "dev_data") and str(shared.get(key)) != str(value)}
        common = own if common is None else {key: v for key, v in common.items() if str(own.get(key)) == str(v)}
        budgets.add(r["budget"])
    extra = "".join(f" --set={key}={value}" for key, value in sorted((common or {}).items()))
    extra += f" --budget={budgets.pop()}" if len(budgets) == 1 and budgets != {budget} else ""
    return f"python experiments/compare.py --tasks={task_name}{extra}"


def noise_rate(path):
    """The untrained model's highest held-out avg@k over its scoring seeds (scoring_noise.py's JSON)."""
    with open(os.path.join(ROOT, path)) as f:
        spread = json.load(f)["spread"]["heldout"]
    return next(v["max"] for key, v in spread.items() if key.startswith("avg@"))


def load_run(run_dir):
    """A finished run's result.json, with its per-problem rows ("problems", report.read_problems)
    and CRM probe ("probe") attached where it has them."""
    result = json.load(open(os.path.join(run_dir, "result.json")))
    result["problems"] = read_problems(os.path.join(run_dir, "problems.jsonl"))
    probe = os.path.join(run_dir, "crm_tokens.json")
    if os.path.exists(probe):
        result["probe"] = json.load(open(probe))
    return result


def registered_runs(results, plan):
    """Whether a task's finished runs include one of its registered (arm, seed) runs: a folder with none (a
    pilot's, other seeds) gets no registered analysis."""
    return any(r["seed"] in plan.task.seeds.get(arm, ()) for arm, runs in results.items() if arm != "untrained"
               for r in runs)


def write_reports(args, out, plans, explicit_seeds):
    """write_report for the finished runs of every planned task."""
    results = collect_results(out, plans)
    given = f" --arms={args.arms}" if args.arms else ""  # what the command was given beyond the defaults
    given += f" --seeds={args.seeds}" if explicit_seeds and not args.quick else ""
    folder = repo_relative(out)  # a folder of the repository other than results/compare: named
    given += f" --out={folder}" if not os.path.isabs(folder) and folder != os.path.join("results", "compare") else ""
    commands = {task_name: run_command(task_name, [r for arm, rs in results[task_name].items() if arm != "untrained"
                                                   for r in rs], SHARED, plan.budget) + given
                for task_name, plan in plans.items() if not args.quick}
    # --quick: a tiny random model's seeds need not score alike, so no arm is taken as seed-free there
    write_report(out, results, args.k, commands, args.k_templated,
                 {} if args.quick else {task_name: plan.task.seed_free for task_name, plan in plans.items()},
                 {task_name: sum(arm != BASELINE for arm in plan.arms) for task_name, plan in plans.items()},
                 {task_name: plan.task.contrasts for task_name, plan in plans.items()},
                 {task_name: ({arm: plan.task.seeds[arm] for arm in plan.task.arms}, plan.task.prereg,
                              noise_rate(plan.task.noise) if plan.task.noise else None)  # the registered plan,
                  # whatever --arms and --seeds say
                  for task_name, plan in plans.items()
                  if plan.task.prereg and (args.quick or registered_runs(results[task_name], plan))},
                 {task_name: (plan.task.fact or "13", plan.task.crm_probe[0])  # the made-up units' fact by default
                  for task_name, plan in plans.items() if plan.task.crm_probe})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default=None, help=f"comma-separated: {', '.join(TASKS)} (default: "
                                                  f"{','.join(DEFAULT_TASKS)})")
    ap.add_argument("--arms", default=None, help=f"comma-separated (default: each task's own list): {', '.join(ARMS)}")
    ap.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2, and each task's own for its arms "
                                                  "run on more)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budget", type=int, default=0, help="generated tokens per run (default: each task's own)")
    ap.add_argument("--k", type=int, default=None, help="test samples per problem for avg@k and pass@k (default 16)")
    ap.add_argument("--k_templated", type=int, default=None, help="samples per problem of the templated held-out "
                                                                  "score (default 8)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a train.py setting for every run, e.g. --set=engine_dtype=float32 --set=autocast_bf16=False "
                         "on a CPU without bf16 (engine_dtype also sets the scoring engine's)")
    ap.add_argument("--out", default="results/compare")
    ap.add_argument("--quick", action="store_true", help="tiny random model, tiny budget, 1 task, 3 arms x 2 seeds")
    ap.add_argument("--report_only", action="store_true", help="rewrite the report from the finished runs")
    ap.add_argument("--keep_checkpoints", action="store_true", help="keep each run's checkpoints after scoring")
    ap.add_argument("--commit", action="store_true", help="git-commit each run's folder as soon as it is finished")
    ap.add_argument("--reflector", default="", help="an OpenAI-compatible server: adds the p2o_teacher arm")
    ap.add_argument("--reflector_model", default="", help="the model name at --reflector ('' = its first)")
    args = ap.parse_args(argv)
    explicit_seeds = args.seeds is not None
    if args.quick:  # one task, 3 arms x 2 seeds, a short epoch (1 problem per source), 2 test samples
        shared, backend, per_source = QUICK, "hf", 1
        defaults = {"tasks": "fictional", "arms": "" if args.tasks and args.tasks != "fictional" else
                    "grpo_k,p2o_human,sft_gold", "seeds": "0,1", "k": 2, "k_templated": 2, "budget": 300}
        explicit_seeds = True
    else:
        shared, backend, per_source = SHARED, "vllm", None
        defaults = {"tasks": ",".join(DEFAULT_TASKS), "arms": "", "seeds": "0,1,2", "k": 16, "k_templated": 8,
                    "budget": 0}
    for key, value in defaults.items():
        if getattr(args, key) in (None, 0):
            setattr(args, key, value)
    extra = dict(item.split("=", 1) for item in args.set)
    shared = {**shared, **extra}
    if args.reflector:  # Teacher-Ref: the API key stays in the environment (train.py --reflector_api_key_env)
        ARMS["p2o_teacher"] = {"algo": "p2o", "reflector": args.reflector, "reflector_model": args.reflector_model}
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    model = tiny_model(out) if args.quick else args.model
    if os.path.exists(model):  # a local folder named from this shell's folder; train.py runs in the repo's
        model = os.path.abspath(model)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    scorer = Scorer(backend, args.temperature, shared["max_tokens"], extra.get("engine_dtype", ""))
    plans = {}
    for task_name in args.tasks.split(","):
        task = TASKS[task_name]
        per = per_source or task.train_per_source
        if per:  # a shorter epoch: GEPA (at epoch ends) runs within the budget
            task = dataclasses.replace(task, train=source_subset(task.train, per, os.path.join(out, task_name,
                                                                                             "train.jsonl")))
        arms = args.arms.split(",") if args.arms else list(task.arms) + (["p2o_teacher"] if args.reflector else [])
        rule = first_template(task.seed_templates)
        sets = score_sets(task, load_jsonl(task.test)[0], load_jsonl(task.heldout)[0] if task.heldout else [], rule,
                          args.k, args.k_templated)
        plans[task_name] = Plan(task, sets, {p.id: p.answer for p in load_jsonl(task.train)[0]},
                                args.budget or task.budget, arms,
                                {arm: seeds if explicit_seeds else task.seeds.get(arm, seeds) for arm in arms})
        legacy = os.path.exists(os.path.join(out, task_name, "untrained.json"))  # scored before per-problem rows
        if not args.report_only and not legacy:  # the starting model's scores first (the row every arm starts from)
            untrained_result(os.path.join(out, task_name, "untrained"), scorer, resolve_model(model), sets,
                             task.crm_probe and (*task.crm_probe, rule), task)
            if args.commit:
                commit_run(os.path.join(out, task_name, "untrained"), "the starting model, scored")
    if not args.report_only:
        run_all(out, plans, shared, model, scorer, args.keep_checkpoints, args.commit)
    write_reports(args, out, plans, explicit_seeds)
    print(f"wrote {out}/report.md")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # train_run stops train.py too
    sys.exit(main())
