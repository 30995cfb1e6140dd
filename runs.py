"""Where a run's files live and how they are written: checkpoints, resume, logs, the closing summary.

    runs/<run_name>/
        ckpt-000010/          an HF model folder (eval.py, vLLM and transformers load it as is),
                              or with --lora_rank a PEFT adapter folder (adapter_config.json +
                              adapter_model.safetensors: MBs; eval.py merges it into its base)
                              + train_config.json (the settings, which eval.py inherits)
                              + trainer.pt: config, loop state, optimizer, scheduler, RNG states
                              (under torchrun the optimizer shard and RNG states of rank R
                              are in rank-R.pt beside it)
        latest, best          symlinks to the newest / best-dev checkpoint (model folders too);
                              the newest --keep_checkpoints (2) and `best` are kept
        export-000010/        --export_every: the model alone in bf16 + train_config.json (for eval.py);
                              LoRA: the merged model, and its adapters in export-000010/adapter/
        metrics.jsonl         one line per step        rollouts.jsonl   a sample of groups per step
        dev.jsonl             one line per dev eval    tb/              TensorBoard events
        gepa-epoch-N.json     one GEPA round           abandoned/       what a resume set aside
        wandb/, wandb-id.txt  with --wandb_project: Weights & Biases' local files, the W&B run's id

Crash safety: every file that must be whole is written through a temporary sibling and a
rename (a checkpoint folder, trainer.pt, `latest`, GEPA archives), so a `kill -9` at any moment
leaves the previous version readable. Resuming at step s first makes the run folder a clean
branch (`start_branch`): later checkpoints, later log lines and GEPA archives of epochs not yet
reached move to abandoned/<time>/, so nothing is lost and no step is logged twice.
"""

import dataclasses
import difflib
import errno
import json
import math
import os
import random
import resource
import secrets
import shutil
import signal
import threading
import sys
import tempfile
import time

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

import dist
import lora
from config import learning_rate
from model import atomic_directory, check_weight_files
from plot import plot_run
from scoring import answer_records, summarize_records


TRAIN_CONFIG = "train_config.json"
LORA_EXPORT = "adapter"  # export-NNNNNN/adapter/: a LoRA run's adapters beside the merged model


def fields_of(obj):
    """A dataclass's fields as a dict, values as they are (dataclasses.asdict would rebuild the
    Counter from its items, which counts (key, value) pairs)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def warmup_factor(warmup_steps, from_zero, step):
    """lr multiplier of training step `step` (0-based; every optimizer step of a training step
    uses it): linear warm-up, then 1. Ours reaches lr/warmup at the first step, (s + 1)/warmup;
    verl's starts at 0, s/warmup (warmup_from_zero)."""
    if step >= warmup_steps:
        return 1.0
    return (step + (0 if from_zero else 1)) / warmup_steps


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)  # a full disk, a quota, a read-only folder


def quiet_disk_errors(args, default=threading.excepthook):
    """threading.excepthook: a background writer (TensorBoard's) that hits DISK_ERRORS dies quietly; the main thread
    meets the same error at its next write and main() reports it in one line."""
    if not (isinstance(args.exc_value, OSError) and args.exc_value.errno in DISK_ERRORS):
        default(args)


def checkpoint_step(name, prefix="ckpt"):
    """ckpt-000012 -> 12 (export-000012 -> 12 with prefix="export"); anything else -> None."""
    head, _, number = name.partition("-")
    return int(number) if head == prefix and number.isdigit() else None


def write_atomic(path, write):
    """Write a file through a temporary sibling and a rename: readers see the old or the new file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


class NonFiniteError(RuntimeError):
    """Weights or optimizer state holding NaN or inf, refused where a checkpoint or export would write them."""


def tensors_in(obj, prefix=""):
    """(name, tensor) of every tensor in nested dicts, lists and tuples (an optimizer's state_dict too)."""
    if torch.is_tensor(obj):
        yield prefix, obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor shard: this rank's part
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from tensors_in(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from tensors_in(value, f"{prefix}[{i}]")


def require_finite(what, *objs):
    """NonFiniteError naming `what` and the first tensors of `objs` (tensors_in) with a NaN or inf."""
    bad = [name for obj in objs for name, t in tensors_in(obj) if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise NonFiniteError(f"{what}: {len(bad)} tensors hold NaN or inf ({', '.join(bad[:3])}"
                             f"{', ...' if len(bad) > 3 else ''}); not written, the earlier checkpoints stand")


def save_checkpoint(run_dir, step, policy, tokenizer, trainer, own=None):
    """ckpt-NNNNNN/ = an HF model folder + trainer.pt (the dict `trainer`), written atomically;
    then `latest` names it. A checkpoint of the same step already on this branch holds the same
    weights: only its trainer.pt is replaced (atomically), e.g. after a GEPA round, which
    changes no weight.

    Under torchrun every rank calls it: the full weights are gathered (a collective), rank R
    writes `own` (its optimizer shard and RNG states) to rank-R.pt inside the unfinished
    folder, then rank 0 writes the model, tokenizer and trainer.pt and renames the folder."""
    name = f"ckpt-{step:06d}"
    path = os.path.join(run_dir, name)
    if not dist.active():
        require_finite(name, trainer, lora.adapter_state(policy) if lora.is_lora(policy) else policy.state_dict())
        if os.path.isdir(path):
            write_train_config(path, trainer["config"])
            write_atomic(os.path.join(path, "trainer.pt"), lambda tmp: torch.save(trainer, tmp))
        else:
            with atomic_directory(path) as tmp:
                if lora.is_lora(policy):
                    lora.save_adapter(policy, lora.adapter_state(policy), tmp)
                else:
                    policy.save_pretrained(tmp, safe_serialization=True)
                tokenizer.save_pretrained(tmp)
                write_train_config(tmp, trainer["config"])
                torch.save(trainer, os.path.join(tmp, "trainer.pt"))
        link_checkpoint(run_dir, "latest", step)
        return path
    # Each dist.section() ends on every rank together, like a barrier; a file that fails to be
    # written on any rank ends every rank with that error instead of leaving them waiting.
    own_file = f"rank-{dist.rank()}.pt"
    with dist.section():  # every rank's shard and (rank 0) the trainer state: a failure ends every rank
        require_finite(f"{name} (rank {dist.rank()})", own, trainer if dist.is_main() else None)
    if os.path.isdir(path):  # one file system: every rank sees the same folders
        with dist.section():
            write_atomic(os.path.join(path, own_file), lambda tmp: torch.save(own, tmp))
        with dist.section():
            if dist.is_main():
                write_train_config(path, trainer["config"])
                write_atomic(os.path.join(path, "trainer.pt"), lambda tmp: torch.save(trainer, tmp))
                link_checkpoint(run_dir, "latest", step)
    else:
        adapted = lora.is_lora(policy)  # a collective either way; rank 0 writes them, from CPU memory
        weights = lora.adapter_state(policy) if adapted else dist.full_state_dict(policy, main_only=True)
        with dist.section():
            require_finite(name, weights if dist.is_main() else None)
        tmp = os.path.join(run_dir, f".partial-{name}")  # a name every rank knows
        with dist.section():
            if dist.is_main():
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
        with dist.section():
            torch.save(own, os.path.join(tmp, own_file))
        with dist.section():
            if dist.is_main():
                if adapted:
                    lora.save_adapter(policy, weights, tmp)
                else:
                    save_model(policy, weights, tmp)
                tokenizer.save_pretrained(tmp)
                write_train_config(tmp, trainer["config"])
                torch.save(trainer, os.path.join(tmp, "trainer.pt"))
                os.rename(tmp, path)
                link_checkpoint(run_dir, "latest", step)
    return path


def save_export(run_dir, step, policy, tokenizer, config):
    """export-NNNNNN/: the model alone, in bf16, with its tokenizer and train_config.json: an HF
    folder for eval.py, vLLM and transformers at a sixth of a checkpoint's size (2 bytes a
    parameter against 4 for the fp32 master weights + 8 for AdamW's moments); written atomically, never pruned. Resuming needs the
    checkpoints; exports are for evaluation. Under torchrun every rank calls it (the weights
    are gathered, a collective) and rank 0 writes. A LoRA policy's export is its merged weights
    (lora.engine_weights) in fp32, as a bf16 copy would round most of a small update back to the
    base, with the adapter folder in adapter/ (what eval.py serves, as vLLM's LoRA on the base)."""
    path = os.path.join(run_dir, f"export-{step:06d}")
    if os.path.isdir(path):  # this branch's weights of that step (start_branch set later ones aside)
        return path
    adapters = lora.adapter_state(policy) if lora.is_lora(policy) else None  # collectives under FSDP2
    if adapters is not None:  # the merged weights, one at a time (every rank consumes them; rank 0 keeps them)
        weights = {k: v.to("cpu") for k, v in lora.engine_weights(policy, torch.float32) if dist.is_main()}
    else:
        weights = dist.full_state_dict(policy, main_only=True) if dist.active() else policy.state_dict()
    dtype = torch.float32 if adapters is not None else torch.bfloat16
    with dist.section():  # the others wait for rank 0's files; if writing them fails, every rank raises the error
        if dist.is_main():
            require_finite(os.path.basename(path), weights, adapters)
            with atomic_directory(path) as tmp:
                save_model(policy, {k: v.to(dtype) for k, v in weights.items()}, tmp, dtype=str(dtype).removeprefix("torch."))
                tokenizer.save_pretrained(tmp)
                write_train_config(tmp, config)
                if adapters is not None:  # beside the merged model, the adapters for peft and vLLM's LoRA loader
                    lora.save_adapter(policy, adapters, os.path.join(tmp, LORA_EXPORT))
    return path


def write_train_config(folder, config):
    """train_config.json: the run's settings, beside the weights of every checkpoint and export
    (eval.py takes the prompt format, chat-template arguments, max_tokens and temperature from it)."""
    write_atomic(os.path.join(folder, TRAIN_CONFIG), lambda tmp: json.dump(config, open(tmp, "w"), indent=1))


def save_model(model, weights, folder, dtype=None):
    """A model's full `weights` (an FSDP-sharded model's too) as an HF folder. fully_shard changes the model's
    class (FSDP<Name>), which save_pretrained would record as the architecture: the original
    class name is written instead, so transformers and vLLM load the folder as usual. A tied
    LM head is the embedding: it is not stored twice (save_pretrained does the same)."""
    if getattr(model.config, "tie_word_embeddings", False):
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    model.save_pretrained(folder, state_dict=weights, safe_serialization=True)
    architecture = next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
    config_file = os.path.join(folder, "config.json")
    config = json.load(open(config_file))
    config["architectures"] = [architecture]
    if dtype:  # the weights' dtype, which loaders with dtype="auto" take
        config["dtype"] = dtype
    write_atomic(config_file, lambda tmp: json.dump(config, open(tmp, "w"), indent=2))


def checkpoint(run):
    """Everything a resume needs of a train.Run (train.start_run reads it back), one folder per step -> its path."""
    t = time.perf_counter()
    own = {"optimizer": dist.optimizer_state(run.optimizer), "rng": rng_state()}
    trainer = {"config": dataclasses.asdict(run.cfg), "loop": fields_of(run.state),
               "scheduler": run.scheduler.state_dict(), "world": run.world, **(own if run.world == 1 else {}),
               "shapers": [s.state_dict() if hasattr(s, "state_dict") else None for s in run.shapers]}
    path = save_checkpoint(run.run_dir, run.state.step, run.policy, run.tokenizer, trainer, own)
    if run.is_main and run.cfg.keep_checkpoints:
        prune_checkpoints(run.run_dir, run.cfg.keep_checkpoints)
    run.seconds["checkpoints"] += time.perf_counter() - t
    return path


def export(run):
    """export-NNNNNN/: this step's model alone in bf16 (runs.save_export), beside the checkpoints."""
    t = time.perf_counter()
    save_export(run.run_dir, run.state.step, run.policy, run.tokenizer, dataclasses.asdict(run.cfg))
    run.seconds["checkpoints"] += time.perf_counter() - t


def dev_eval(run):
    """Greedy and avg@k on a train.Run's dev set (scored by --reward); each rank answers its share and every rank gets the
    same result. A new best (after step 0) is checkpointed and named `best`."""
    cfg, state = run.cfg, run.state
    if not run.dev_set:
        return {}
    t = time.perf_counter()
    mine = answer_records(run.engine, dist.split(run.dev_set, run.rank, run.world), k=cfg.eval_k,
                          temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens, progress=False,
                          seed=cfg.seed * 100_003 + state.step, prompt_format=cfg.prompt_format,
                          reward=cfg.reward)  # the seed + rank in the engine
    overall, _ = summarize_records(dist.unsplit(dist.gather_objects(mine)), cfg.eval_k)
    run.seconds["dev evaluations"] += time.perf_counter() - t
    if run.is_main:
        run.log.dev(state.step, overall)
        tqdm.write(f"dev @ step {state.step}: greedy {overall['greedy']:.3f}" +
                   (f", avg@{cfg.eval_k} {overall[f'avg@{cfg.eval_k}']:.3f}" if cfg.eval_k else "") +
                   (f" (mean rewards: the reward ranges over [{overall['reward_min']:g}, {overall['reward_max']:g}])"
                    if "reward_max" in overall else ""))
    if state.step > 0 and overall["greedy"] > state.best_dev:  # best-dev checkpoint, as the paper reports
        state.best_dev, state.best_step = overall["greedy"], state.step
        checkpoint(run)
        if run.is_main:
            link_checkpoint(run.run_dir, "best", state.step)
    return overall


def load_rank_state(path, rank):
    """rank-R.pt of a checkpoint written under torchrun, or a clear error naming the file."""
    file = os.path.join(path, f"rank-{rank}.pt")
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise SystemExit(f"{file}: missing; this checkpoint was not written by {rank + 1}+ processes") from None
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"{file}: corrupt checkpoint ({type(e).__name__}: {e})") from None


def rng_state():
    """The RNG states a checkpoint saves per rank (python, numpy, torch)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_trainer(saved, own, optimizer, scheduler, warmup, cfg):
    """Put a checkpoint's optimizer, scheduler and RNG states back (`own`: this rank's, from
    trainer.pt in one process, from rank-R.pt under torchrun) -> its loop state (a dict of
    train.LoopState's fields). Settings given on the command line at resume (lr, AdamW's betas,
    eps, weight decay) win over the optimizer's saved copies of them; `warmup`(step) is the
    lr factor of the scheduler's step."""
    dist.load_optimizer_state(optimizer, own["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    lr = learning_rate(cfg)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for g in optimizer.param_groups:
        g.update(lr=lr * warmup(scheduler.last_epoch), initial_lr=lr, eps=cfg.adam_eps,
                 betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    random.setstate(own["rng"]["python"])
    np.random.set_state(own["rng"]["numpy"])
    torch.set_rng_state(own["rng"]["torch"])
    return saved["loop"]


def link_checkpoint(run_dir, link, step):
    """Make run_dir/<link> (latest, best) a relative symlink to the checkpoint ckpt-<step>,
    atomically (a new link renamed over the old one): runs/<run>/latest is a model folder
    wherever a path is taken."""
    path = os.path.join(run_dir, link)
    tmp = f"{path}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(f"ckpt-{step:06d}", tmp)
    os.replace(tmp, path)


def prune_checkpoints(run_dir, keep):
    """Delete all checkpoints of the run but the newest `keep` and the ones `latest` and `best`
    name (those are always kept). Checkpoints are written whole before `latest` moves, so a
    deletion never touches the one a resume would read. Returns the names deleted."""
    names = sorted(n for n in os.listdir(run_dir) if n.startswith("ckpt-") and n[5:].isdigit())
    named = {pointer_target(run_dir, p) for p in ("latest", "best")}
    doomed = [n for n in names[:-keep] if n not in named] if keep > 0 else []
    for name in doomed:
        shutil.rmtree(os.path.join(run_dir, name))
    return doomed


def pointer_target(run_dir, pointer):
    """The checkpoint name `pointer` names (a symlink; a one-line file in runs written before
    pointers were links), or None."""
    path = os.path.join(run_dir, pointer)
    if os.path.islink(path):
        return os.readlink(path)
    if os.path.isfile(path):
        return open(path).read().strip()
    return None


def load_trainer_state(path):
    """trainer.pt of a checkpoint folder, or a clear error naming the file (its weight files too)."""
    file = os.path.join(path, "trainer.pt")
    if os.path.isdir(path):
        check_weight_files(path)
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise SystemExit(f"{file}: not a checkpoint (no trainer.pt)") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is reported, not a traceback
        raise SystemExit(f"{file}: corrupt checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or "loop" not in state:
        raise SystemExit(f"{file}: not a checkpoint of this version of train.py (no loop state)")
    return state


def resolve_resume(cfg):
    """The checkpoint folder to resume from, checked before anything loads. 'auto': the run's
    `latest`, or None when the run folder exists but has no checkpoint yet (stopped before its
    first one): it then starts from scratch. A run folder that does not exist is an error that
    lists the runs that do: a misspelt --run_name must not silently start a long job over."""
    if cfg.resume != "auto":
        path = cfg.resume
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "trainer.pt")) \
                and pointer_target(path, "latest") is not None:
            raise SystemExit(f"--resume={path} is a run folder; resume its newest checkpoint with "
                             f"--resume={os.path.join(path, 'latest')} (or --resume=auto --run_name={os.path.basename(os.path.normpath(path))})")
        if not os.path.isdir(path):
            raise SystemExit(f"--resume={path}: no such checkpoint folder")
        return path
    if not cfg.run_name:
        raise SystemExit("--resume=auto needs --run_name")
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    if not os.path.isdir(run_dir):
        runs = sorted(n for n in os.listdir(cfg.out_dir) if os.path.isdir(os.path.join(cfg.out_dir, n))) \
            if os.path.isdir(cfg.out_dir) else []
        near = difflib.get_close_matches(cfg.run_name, runs, n=1, cutoff=0.6)
        raise SystemExit(f"--resume=auto: no run folder {run_dir}" + (f"; did you mean --run_name={near[0]}?" if near else "")
                         + (f" (runs in {cfg.out_dir}/: {', '.join(runs)})" if runs else f" ({cfg.out_dir}/ holds no runs)"))
    target = pointer_target(run_dir, "latest")
    if target is None:
        print(f"--resume=auto: {run_dir} has no checkpoint yet; starting it from scratch")
        return None
    return os.path.join(run_dir, target)


def resume_point(cfg, given=None):
    """Read a resume once, for the command line and train(cfg) alike -> (cfg, checkpoint folder
    or None, its trainer.pt or None). The checkpoint's settings come back, and the settings
    named in `given` win over them (the command line's flags; for train(cfg), by default every
    field that differs from Config's default). A saved setting this Config no longer has is
    dropped with a note; LoRA's shape (rank, alpha, targets) cannot change on resume."""
    path = resolve_resume(cfg) if cfg.resume else None
    if not path:
        return cfg, None, None
    saved = load_trainer_state(path)
    config_class = type(cfg)  # config.Config
    defaults, known = config_class(), {f.name for f in dataclasses.fields(config_class)}
    if given is None:
        given = {k for k in known if getattr(cfg, k) != getattr(defaults, k)}
    old = {k: v for k, v in saved.get("config", {}).items() if k in known}
    if set(saved.get("config", {})) - known:
        print(f"{path}: saved settings this version does not have, ignored: {sorted(set(saved['config']) - known)}",
              file=sys.stderr)  # stdout may be --dry_run's JSON
    merged = config_class(**{**old, **{k: getattr(cfg, k) for k in given | {"resume"}}})
    for k in ("lora_rank", "lora_alpha", "lora_targets"):  # a checkpoint holds adapters of these, or a full model
        if getattr(merged, k) != old.get(k, getattr(defaults, k)):
            raise SystemExit(f"--resume={path} was trained with --{k}={old.get(k, getattr(defaults, k))}, not "
                             f"{getattr(merged, k)}; to train it otherwise, start a new run with --model={path}")
    return merged, path, saved


LOG_FILES = ("metrics.jsonl", "rollouts.jsonl", "dev.jsonl")


def check_run_folder(cfg, resume_path):
    """Before anything loads: --out_dir can be written, and a new run (no --resume) does not write
    into a folder that holds a run (checkpoints or logged steps): reusing a name is the user's
    choice, made with --resume (=auto of a run with no checkpoint yet starts it over)."""
    out_dir = cfg.out_dir
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        raise SystemExit(f"--out_dir={out_dir}: cannot write there ({e.strerror or e})") from None
    run_dir = os.path.join(out_dir, cfg.run_name) if cfg.run_name else None
    if cfg.resume or resume_path or not run_dir or not os.path.isdir(run_dir):
        return
    steps = [checkpoint_step(n) for n in os.listdir(run_dir) if checkpoint_step(n) is not None]
    logged = os.path.isfile(os.path.join(run_dir, "metrics.jsonl")) and os.path.getsize(
        os.path.join(run_dir, "metrics.jsonl")) > 0
    if steps or logged:
        what = f"checkpoints up to step {max(steps)}" if steps else "logged steps and no checkpoint"
        raise SystemExit(f"--run_name={cfg.run_name}: {run_dir} holds a run ({what}); continue it with "
                         f"--resume=auto --run_name={cfg.run_name}, or give this run another --run_name")


def start_branch(run_dir, step, epoch, resumed_from):
    """Make run_dir a clean branch that continues at `step`: whatever an earlier attempt wrote
    after it (later checkpoints, log lines of later steps, GEPA archives of epochs not yet
    reached) moves to abandoned/<time>/, so nothing is lost and nothing is counted twice.
    Unfinished writes (.partial-*, *.tmp-*, also inside checkpoints) of a killed process are removed."""
    trash = os.path.join(run_dir, "abandoned", time.strftime("%Y%m%d-%H%M%S"))
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if name.startswith(".partial-") or ".tmp-" in name:
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
            continue
        if checkpoint_step(name) is not None:  # a trainer.pt replacement cut by a kill
            for inner in os.listdir(path):
                if ".tmp-" in inner:
                    os.remove(os.path.join(path, inner))
        n, stale = checkpoint_step(name), False
        if n is not None:  # a later checkpoint, or one of this step that is not the resumed one
            stale = n > step or (n == step and os.path.realpath(path) != os.path.realpath(resumed_from or path))
        elif checkpoint_step(name, "export") is not None:
            stale = checkpoint_step(name, "export") > step
        elif name.startswith("gepa-epoch-") and name.endswith(".json"):
            stale = int(name[len("gepa-epoch-"):-len(".json")]) >= epoch
        if stale:
            os.makedirs(trash, exist_ok=True)
            os.rename(path, os.path.join(trash, name))
    kept = [n for n in map(checkpoint_step, os.listdir(run_dir)) if n is not None]
    for name in ("latest", "best"):  # a pointer into what was set aside points nowhere now
        target = pointer_target(run_dir, name)
        if target is not None and checkpoint_step(target) not in kept:
            os.remove(os.path.join(run_dir, name))
            if name == "latest" and kept:  # --resume=auto must still find this branch's newest
                link_checkpoint(run_dir, "latest", max(kept))
    for name in LOG_FILES:
        path = os.path.join(run_dir, name)
        if not os.path.isfile(path):
            continue
        keep, drop = [], []
        for line in open(path):
            try:
                (keep if json.loads(line)["step"] <= step else drop).append(line)
            except (ValueError, KeyError):  # a line cut by a kill
                drop.append(line)
        if drop:
            os.makedirs(trash, exist_ok=True)
            with open(os.path.join(trash, name), "a") as f:
                f.writelines(drop)
            write_atomic(path, lambda tmp: open(tmp, "w").writelines(keep))


def route_library_logs(run_dir, rank=0, name=None):
    """Send vLLM's, transformers' and Python's warnings to <run>/engine.log (engine-rank<R>.log
    under torchrun) instead of the console, which keeps the project's own lines: the config,
    the progress bar, dev evaluations, GEPA summaries and the final summary. Call before the
    engine is created; train.py skips it with --verbose=True. A few lines printed by C++ code
    at engine start-up (thread binding, NUMA) bypass Python's logging and still reach stderr."""
    import logging

    from transformers.utils import logging as hf_logging

    name = name or "engine.log"  # eval.py: <out>.engine.log
    if rank:
        name = name.replace(".log", f"-rank{rank}.log")
    handler = logging.FileHandler(os.path.join(run_dir, name))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # a vLLM imported from now on adds no console handler
    hf_logging.disable_default_handler()
    for name in ("vllm", "py.warnings", "transformers"):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):  # a vLLM imported earlier (a test's engine), an earlier run's file
            logger.removeHandler(old)
            if isinstance(old, logging.FileHandler):
                old.close()
        logger.addHandler(handler)
        logger.propagate = False
    logging.getLogger("vllm").setLevel(logging.INFO)
    logging.captureWarnings(True)
    hf_logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
    return handler


ROLLOUT_COLUMNS = ["step", "id", "answer", "template", "response", "reward"]


def wandb_run_id(run_dir):
    """The Weights & Biases id of this run folder, kept in wandb-id.txt: made the first time, read
    back on a resume, so every attempt of the run logs to the same W&B run."""
    path = os.path.join(run_dir, "wandb-id.txt")
    if os.path.isfile(path):
        return open(path).read().strip()
    run_id = secrets.token_hex(6)  # W&B ids are letters, digits, '-' and '_'

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(run_id + "\n")

    write_atomic(path, write)
    return run_id


def open_wandb(run_dir, step, cfg):
    """The W&B run beside TensorBoard (--wandb_project): named after the run folder, its local files
    in <run_dir>/wandb/, the whole Config as its config. wandb is imported here only, so a run
    without --wandb_project never loads it. WANDB_MODE=offline writes offline-run-*/ folders that
    `wandb sync` uploads later. Returns the run and the table of sampled completions."""
    import wandb

    run = wandb.init(project=cfg.wandb_project, name=os.path.basename(os.path.normpath(run_dir)), dir=run_dir,
                     id=wandb_run_id(run_dir), resume="allow", config=dataclasses.asdict(cfg))
    note = wandb_resume_note(run, step)
    if note:
        print(note)
    # One table for the whole run: each step adds its rows and uploads only those (INCREMENTAL);
    # the W&B page shows all steps' rows in one panel, to filter or group by the step column.
    # Per-step tables would show one step at a time; re-logging a growing table uploads it again
    # every step. The table keeps its rows in memory: as much as rollouts.jsonl holds on disk.
    return run, wandb.Table(columns=ROLLOUT_COLUMNS, log_mode="INCREMENTAL")


def wandb_resume_note(run, step):
    """W&B has no counterpart of TensorBoard's purge: a resumed W&B run keeps its history and
    ignores rows of steps below its newest. Resumed at `step` after an attempt that logged up to
    run.step - 1 > step, the W&B charts keep that attempt's values for the steps in between and
    this branch's appear from run.step on (TensorBoard and the JSONL files hold this branch only).
    The line that says so, or None. Offline, a resumed run starts at 0: nothing is known yet."""
    if run.step <= step + 1:
        return None
    return (f"W&B run {run.id} already has steps up to {run.step - 1}: it keeps those and ignores this "
            f"branch's steps {step + 1}-{run.step - 1} (TensorBoard and the JSONL files have them)")


def rollout_rows(step, groups):
    """A W&B table's rows for the groups rollouts.jsonl receives: one row per sample."""
    return [[step, str(g.problem.id), str(g.problem.answer), template, sample.text, float(reward)]
            for g in groups for sample, template, reward in zip(g.samples, g.templates, g.rewards)]


class RunLog:
    """TensorBoard scalars and the run's JSONL files; with --wandb_project also the same scalars
    (same names, same steps) and the rollouts.jsonl samples as a table in Weights & Biases.
    Opened at a resumed step, TensorBoard purges events after it (start_branch has already cut
    the JSONL files); W&B cannot (wandb_resume_note)."""

    def __init__(self, run_dir, step, cfg):
        self.run_dir, self.cfg = run_dir, cfg
        self.writer = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=step + 1 if step else 0)
        self.writer.add_text("config", "```\n" + json.dumps(dataclasses.asdict(cfg), indent=1) + "\n```", step)
        self.metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.rollouts = open(os.path.join(run_dir, "rollouts.jsonl"), "a")
        self.wandb, self.table = open_wandb(run_dir, step, cfg) if cfg.wandb_project else (None, None)

    def scalars(self, prefix, values, step):
        """The finite numbers of `values` as <prefix>/<key> at `step`, to TensorBoard (and W&B)."""
        logged = {f"{prefix}/{key}": value for key, value in values.items()
                  if isinstance(value, (int, float)) and math.isfinite(value)}
        for key, value in logged.items():
            self.writer.add_scalar(key, value, step)
        if self.wandb and logged:
            self.wandb.log(logged, step=step)

    def step(self, m, groups):
        self.scalars("train", m, m["step"])
        self.metrics.write(json.dumps(m) + "\n")
        self.metrics.flush()
        sampled = groups[:self.cfg.log_rollouts]
        for g in sampled:
            self.rollouts.write(json.dumps({"step": m["step"], "id": g.problem.id, "answer": g.problem.answer,
                                            "templates": g.templates, "responses": [s.text for s in g.samples],
                                            "rewards": g.rewards}) + "\n")
        self.rollouts.flush()
        if self.wandb and sampled:
            for row in rollout_rows(m["step"], sampled):
                self.table.add_data(*row)
            self.wandb.log({"rollouts": self.table}, step=m["step"])

    def dev(self, step, overall):
        self.scalars("dev", overall, step)
        with open(os.path.join(self.run_dir, "dev.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **overall}) + "\n")

    def gepa(self, epoch, step, hard, result=None):
        """An epoch's end under P²O: the hard-set size, and a GEPA round's archive (written
        atomically: gepa-epoch-N.json) and acceptance scalars when one ran (`result`)."""
        self.scalars("p2o", {"hard_set_size": hard}, step)
        if result is None:
            return
        archive = result.to_json()
        write_atomic(os.path.join(self.run_dir, f"gepa-epoch-{epoch}.json"),
                     lambda tmp: json.dump(archive, open(tmp, "w"), indent=1))
        summary = result.summary()
        self.scalars("p2o", {"gepa_acceptance_rate": summary["accepted"] / max(1, summary["proposals"]),
                             "gepa_best_dev_score": summary["best_dev_score"]}, step)

    def dev_records(self):
        path = os.path.join(self.run_dir, "dev.jsonl")
        return [json.loads(line) for line in open(path)] if os.path.isfile(path) else []

    def close(self):
        """Called from train()'s `finally`: an exception on its way out marks the W&B run failed."""
        self.writer.close()
        self.metrics.close()
        self.rollouts.close()
        if self.wandb:
            self.wandb.finish(exit_code=1 if sys.exc_info()[0] else 0)


class StopSignal:
    """SIGINT / SIGTERM: finish the step in flight, save a checkpoint, exit. A second signal stops at once."""

    def __init__(self):
        self.signal = None
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        print(f"\nsignal {signum}: finishing this step, saving a checkpoint, exiting")

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)


# How far the engine's log-probs may sit from the trainer's when both hold the same policy, in
# nats per token at T = 1: kernels and rounding differ on the two sides. 16-bit (a bf16 engine or a
# bf16-autocast trainer): measured 0.04 on SmolLM2-135M (vLLM-CPU bf16 against the autocast trainer,
# tests/test_lora.py) and 0.01-0.03 in the committed bf16 runs at T = 0.6; fp32 on both sides: below
# 1e-3. The bounds are 2.5x and 10x those, divided by T (a log-prob at temperature T is of z / T). A
# step above it means the engine may not hold the pushed policy: a push that loaded nothing, or a LoRA
# merge rounded away in bf16 (docs/GPU.md "Sampler mismatch").
SAMPLER_MISMATCH_BOUND = {16: 0.1, 32: 0.01}


def sampler_mismatch_bound(cfg):
    """SAMPLER_MISMATCH_BOUND for this run's engine and trainer precision, at its sampling temperature."""
    engine = cfg.engine_dtype if cfg.backend == "vllm" else "float32"  # the HF backend generates in fp32
    bits = 32 if engine == "float32" and not cfg.autocast_bf16 else 16  # "auto": the model's own, maybe bf16
    return SAMPLER_MISMATCH_BOUND[bits] / max(cfg.temperature, 1e-6)


def sampler_mismatch(sums, cfg):
    """The step's trainer-vs-engine gap over the tokens it trained whose engine log-prob is known
    (d = log pi_old - log pi_sampler): |d| mean and max, the flag sampler_stale (1.0 when the mean is
    above sampler_mismatch_bound), KL(engine || trainer) by the k1 (-d) and k3 (exp d - 1 - d)
    estimators, the perplexity of those tokens on each side, and with --sampler_correction (or
    --tis_cap) the share of those tokens and responses it truncated or dropped. NaN on a step that
    measured no token."""
    n, get = sums["mismatch_tokens"], lambda key: sums.get(key, 0)
    per = max(n, 1)  # no token measured: every field NaN, below
    out = {"sampler_mismatch_mean": sums["mismatch_abs_sum"] / per, "sampler_mismatch_max": sums["mismatch_abs_max"],
           "sampler_stale": float(sums["mismatch_abs_sum"] / per > sampler_mismatch_bound(cfg)),
           "sampler_kl_k1": get("mismatch_k1_sum") / per, "sampler_kl_k3": get("mismatch_k3_sum") / per,
           "trainer_ppl": math.exp(get("trainer_nll_sum") / per), "sampler_ppl": math.exp(get("sampler_nll_sum") / per)}
    if cfg.sampler_correction or cfg.tis_cap:
        out.update(corrected_token_fraction=get("corrected_tokens") / per,
                   corrected_seq_fraction=get("corrected_seqs") / max(1, get("mismatch_seqs")))
    return out if n else dict.fromkeys(out, float("nan"))


def step_metrics(state, groups, update, info, lr, cfg, terms=()):
    """One line of metrics.jsonl (and the TensorBoard train/* scalars). Each AuxTerm adds loss_<name>
    (its share of the loss), <name>_sum (the raw sum of its token_loss over its tokens, every PPO
    epoch) and coef_<name> (its weight at this step)."""
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [G, K]
    flat = [s for g in groups for s in g.samples]
    lengths = [len(s.response_ids) for s in flat]
    step_tokens = sum(lengths)  # every rollout (a training row, unless --drop_failed_templated drops it)
    templated = [any(g.templates) for g in groups]
    t_rewards = [r for g, t in zip(groups, templated) if t for r in g.rewards]
    p_rewards = [r for g, t in zip(groups, templated) if not t for r in g.rewards]
    s = update.sums
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "step": state.step, "epoch": state.epoch,
        "reward_mean": rewards.mean().item(),
        "accuracy_any": (rewards.max(dim=1).values > 0).float().mean().item(),
        "zero_variance_groups": (rewards.std(dim=1) == 0).float().mean().item() if rewards.shape[1] > 1 else 1.0,
        "groups": len(groups), "refills": info["refills"],
        "response_len_mean": mean(lengths), "response_len_max": max(lengths),
        "truncated": mean([s.finish_reason == "length" for s in flat]),
        "loss": update.loss, "kl": s["kl_sum"] / max(1, step_tokens * cfg.ppo_epochs),
        "clip_fraction": s["clipped_tokens"] / max(1, step_tokens * cfg.ppo_epochs),
        "entropy": s["entropy_sum"] / s["entropy_tokens"] if s["entropy_tokens"] else float("nan"),  # nothing forwarded: NaN
        **{k: v for k, v in s.items() if k.startswith("loss_")},  # loss_policy and each auxiliary term's share
        **{key: value for t in terms for key, value in ((f"{t.name}_sum", s[f"{t.name}_sum"]),
                                                        (f"coef_{t.name}", t.coefficient(state.step)))},
        "grad_norm": update.grad_norm, "lr": lr, "trained_rows": update.trained_rows,
        "templated_row_fraction": mean([bool(t) for g in groups for t in g.templates]),
        "dropped_failed_templated": sum(bool(t) and r <= 0 for g in groups for t, r in zip(g.templates, g.rewards))
        if cfg.drop_failed_templated else 0,
        "reward_templated_groups": mean(t_rewards), "reward_plain_groups": mean(p_rewards),
        "crm_masked_fraction": s["crm_out_of_band_tokens"] / max(1, s["crm_templated_tokens"]),
        "crm_mean_log_ratio": s["crm_log_ratio_sum"] / max(1, s["crm_templated_tokens"]),
        **sampler_mismatch(s, cfg),  # |log pi_old - log pi_sampler|: NaN on a step that trained no token
        "hard_so_far": len(state.hard_now),
        "generated_tokens": generated_tokens(state.counts),  # cumulative: the x axis of a compute-matched comparison
        **{f"time_{k}": info[k] for k in ("generate", "score", "train", "push", "step")},
        "gen_tokens_per_s": sum(lengths) / max(info["generate"], 1e-9), "skipped_steps": state.skipped_steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **({"reward_failures": state.counts["reward_failures"]} if cfg.reward_errors == "zero" else {}),  # cumulative
        "prompt_ids": [g.problem.id for g in groups],
        "counts": dict(state.counts),  # cumulative token and call counts (compare.py's compute columns)
    }


# policy compute; an SFT run's gold tokens stand in for generated ones (its budget counts them)
GENERATED = ("train_tokens", "gepa_dev_tokens", "gepa_minibatch_tokens", "reflection_tokens", "gold_tokens")


def shaping_metrics(groups):
    """What reward shaping did this step (shaping.apply_shapers; logged on every step of a run with shapers):
    shaping_groups: fraction of groups with a non-zero bonus; shaping_bonus_mean: mean bonus over
    every rollout; shaping_order_changed / shaping_order_reversed: fraction of groups in which
    some pair of rollouts compares differently after shaping (a tie broken, or an order made a
    tie or reversed) / in which a strictly ordered pair is reversed. Group normalisation is
    monotone, so these are the changes in the order of the advantages."""
    changed = reversed_ = shaped = 0
    for g in groups:
        bonus = g.bonus or [0.0] * len(g.rewards)
        after = [r + b for r, b in zip(g.rewards, bonus)]
        shaped += any(b != 0 for b in bonus)
        pairs = [(i, j) for i in range(len(after)) for j in range(i + 1, len(after))]
        sign = lambda v, i, j: (v[i] > v[j]) - (v[i] < v[j])  # noqa: E731
        changed += any(sign(g.rewards, i, j) != sign(after, i, j) for i, j in pairs)
        reversed_ += any(sign(g.rewards, i, j) * sign(after, i, j) < 0 for i, j in pairs)
    n, every = len(groups), [b for g in groups for b in (g.bonus or [0.0] * len(g.rewards))]
    return {"shaping_groups": shaped / n, "shaping_bonus_mean": sum(every) / len(every),
            "shaping_order_changed": changed / n, "shaping_order_reversed": reversed_ / n}


def forward_tokens(rows, cfg, is_forwarded, passes):
    """Tokens through the policy in one step's update, for a FLOPs estimate (experiments/compare.py):
    forward + backward (the rows is_forwarded(row) selects: train.forwarded, ppo_epochs times) and
    no-grad forwards, each train.Pass's tokens(row) over the rows it reads (the CRM pass under x
    and x~, stored old log-probs, the reference, a method's own). Counted per row, prompt +
    response: shared-prompt packing's saving is not subtracted. Summed over ranks."""
    trained = sum(len(r.prompt_ids) + len(r.response_ids) for r in rows if is_forwarded(r))
    nograd = sum(p.tokens(r) for p in passes for r in rows if p.reads(r))
    return {"train_fb_tokens": int(dist.all_sum(trained * cfg.ppo_epochs)), "nograd_tokens": int(dist.all_sum(nograd))}


def method_metrics(metrics, *more):
    """The metrics line with each dict of `more` (the shapers', a method's run.scalars) added; a name
    the line already has is an error, not an overwrite."""
    out = dict(metrics)
    for extra in more:
        clash = sorted(set(extra) & set(out))
        if clash:
            raise ValueError(f"metrics {clash} are already in the step's metrics line; name them otherwise")
        out.update(extra)
    return out


def console_line(m, total_steps, terms=()):
    """One console line per step with its main figures: reward, loss and (with terms) each part of it,
    KL to the reference, the engine's gap to the trainer, generation tokens/s, the step's seconds."""
    parts = [f"step {m['step']}/{total_steps}", f"reward {m['reward_mean']:.3f}",
             f"zero-var {m['zero_variance_groups']:.2f}", f"loss {m['loss']:.4g}"]
    if terms:
        parts[-1] += " (" + ", ".join(f"{k[5:]} {v:.3g}" for k, v in m.items() if k.startswith("loss_")) + ")"
    if any(t.name == "kl" for t in terms):
        parts.append(f"kl {m['kl']:.3g}")
    if math.isfinite(m["sampler_mismatch_mean"]):
        parts.append(f"mismatch {m['sampler_mismatch_mean']:.3g}")
    return "  ".join(parts + [f"{m['gen_tokens_per_s']:.0f} tok/s", f"{m['time_step']:.1f} s"])


def loss_note(cfg, terms):
    """What the logged loss is, said at start-up."""
    parts = " + ".join(["loss_policy"] + [f"loss_{t.name}" for t in terms])
    if cfg.ppo_epochs == cfg.mini_batches == 1 and not cfg.fix_importance_ratio:
        return (f"note: loss = {parts}. With one optimizer step per batch the PPO ratio is 1, so loss_policy is "
                "-sum_t(w_t A_t) / D, the advantages summed over the tokens (CRM/TIS weights w), not a fit: its "
                "gradient is the policy gradient (grpo.py)")
    return f"note: loss = {parts}"


def budget_spent(state, cfg):
    """--max_gen_tokens: the run stops at the first step boundary at or past the budget (a
    step or a GEPA round may overshoot it; compare.py reports the actual spend)."""
    return cfg.max_gen_tokens > 0 and generated_tokens(state.counts) >= cfg.max_gen_tokens


def generated_tokens(counts):
    """Tokens the policy (or its frozen copy) generated for training: rollouts, GEPA's answers
    and reflections. Dev evaluations are not counted (every arm of a comparison runs the same)."""
    return sum(counts[k] for k in GENERATED)


def time_summary(seconds, total):
    """'wall time 890 s: generate 293 (33%), train 221 (25%), ...' -- where this run's time went."""
    parts = sorted(seconds.items(), key=lambda kv: -kv[1]) + [("other", total - sum(seconds.values()))]
    return f"wall time {total:.0f} s: " + ", ".join(f"{k} {v:.0f} ({v / max(total, 1e-9):.0%})" for k, v in parts)


def print_summary(run_dir, counts, generated, gepa_history, dev_records, dev_size):
    """The run's closing lines (curves.png is drawn here); `generated`: tokens the policy generated for training."""
    print(f"curves: {plot_run(run_dir)}")
    print(f"compute: {json.dumps(dict(counts))}; GEPA share of generated tokens "
          f"{(generated - counts['train_tokens']) / max(1, generated):.3f}")
    if gepa_history:
        print(f"P²O epochs: {json.dumps(gepa_history)}")
    if counts["reward_failures"]:
        print(f"WARNING: {counts['reward_failures']} calls of the custom --reward failed (raised, timed out or "
              "returned no number) and scored 0 (--reward_errors=zero)")
    if len(dev_records) > 1:  # from dev.jsonl, so a resumed run reports its whole branch
        what = "mean reward (rewards outside [0, 1])" if any("reward_max" in r for r in dev_records) else "accuracy"
        print(f"dev greedy {what}: {dev_records[0]['greedy']:.3f} before (step {dev_records[0]['step']}) -> "
              f"{dev_records[-1]['greedy']:.3f} after (step {dev_records[-1]['step']}; {dev_size} problems)")
