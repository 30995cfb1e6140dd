"""P²O on a hand-written GRPO: the training loop, the file a researcher edits.

    python train.py                                  # short P²O run: default model, built-in task
    python train.py --algo=grpo                      # plain GRPO (every P²O setting ignored)
    python train.py --algo=grpo --group_size=12      # the GRPO 2K baseline
    python train.py --context_distill=False          # P²O ablation: train templated rows under x~
    python train.py --crm=False                      # P²O ablation: no Context Ratio Mask
    python train.py --same_template_per_group=True   # P²O ablation: one template per group
    python train.py --reflector=policy               # reflect with the current weights (default: init)
    python train.py --dynamic_sampling=True          # DAPO dynamic sampling
    python train.py --eps_high=0.28                  # DAPO clip-higher
    python train.py --adv_norm=none --loss_agg=seq-mean-token-sum-norm   # Dr. GRPO
    python train.py --kl_beta=0.01                   # k3 KL to the frozen initial policy
    python train.py --resume=auto --run_name=NAME    # continue the latest checkpoint of a run

Every setting lives in `Config` below; `--key=value` overrides it (types are checked, unknown
keys are an error). One step: sample B prompts -> K rollouts each (vLLM; a prompt that was hard
last epoch gets one GEPA template per rollout) -> verify -> mine hard prompts -> group advantages
-> rebuild templated rows under the original prompt (context distillation) and weight their
tokens with the Context Ratio Mask -> PPO-clip loss over the whole step in micro-batches -> AdamW
-> push the weights into the engine (verified) -> log. At an epoch's end GEPA evolves templates
for that epoch's hard prompts (gepa.py) and assigns K of them to each. Epoch 0 is plain GRPO. Outputs go to out_dir/run_name: TensorBoard events
(tb/), metrics.jsonl (one line per step), rollouts.jsonl (a sample of groups), checkpoints
(ckpt-NNNNNN/ with an HF model folder that eval.py and vLLM load unchanged, and `latest`),
gepa-epoch-N.json (templates, lineage, dev score matrix, acceptance log, assignment), curves.png.

Simplifications, on purpose: one process, one device; the reference model exists only when
kl_beta > 0; groups whose advantages are all zero are not forwarded when kl_beta == 0 (their
gradient is exactly zero) but their tokens still count in the token-mean denominator, as in
the reference implementation; policy entropy is measured on the rows that were forwarded.
"""

import dataclasses
import json
import math
import os
import random
import resource
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

import grpo


@dataclass
class Config:
    # ---- model and data
    model: str = "smollm2-135m"  # HF id, local folder, or the shipped default (model.py)
    train_data: str = "builtin-train"  # data name or .jsonl path (data/__init__.py)
    dev_data: str = "builtin-dev"  # periodic evaluation set ('' = none)
    backend: str = "vllm"  # rollout engine: vllm | hf
    engine_dtype: str = "bfloat16"  # dtype of the rollout engine's weights
    algo: str = "p2o"  # p2o | grpo
    # ---- rollouts
    prompts_per_step: int = 16  # B: prompts per optimizer step (paper 128)
    group_size: int = 6  # K: rollouts per prompt (paper 6; the 2K baseline is 12)
    temperature: float = 0.6  # sampling temperature, also used for training log-probs (paper 0.6)
    top_p: float = 1.0
    max_tokens: int = 128  # max response tokens (paper 12,288); also L_max of Dr. GRPO
    dynamic_sampling: bool = False  # DAPO: drop all-equal groups, refill with more prompts
    max_refills: int = 3  # bound on DAPO refill rounds per step
    # ---- loss (grpo.py)
    adv_norm: str = "group"  # group: (r - mean) / (std + 1e-6) | none: r - mean (Dr. GRPO)
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    eps_low: float = 0.2  # PPO clip below 1
    eps_high: float = 0.2  # PPO clip above 1 (0.28 = DAPO clip-higher)
    dual_clip: float = 0.0  # 0 = off; c > 1 caps the loss of A < 0 tokens at -A c (3 is usual)
    kl_beta: float = 0.0  # k3 KL weight to the frozen initial policy (0 as in P²O, DAPO, Dr. GRPO)
    ppo_epochs: int = 1  # optimizer steps per rollout batch (1: the ratio is 1, see grpo.py)
    # ---- P²O: hard-prompt mining, GEPA (gepa.py), context distillation and CRM (distill.py)
    tau: int = 2  # a prompt with fewer than tau successes among its K rollouts is hard (paper 2)
    gepa_min_hard: int = 20  # GEPA runs at an epoch's end only with this many hard prompts (paper 100 on 5K)
    gepa_budget: int = 200  # metric calls per GEPA round (one = one (template, problem) answer)
    gepa_dev_max: int = 300  # hard prompts used as GEPA dev items, at most (paper 300)
    gepa_parents: int = 4  # W: parents per GEPA iteration (paper 16)
    gepa_minibatch: int = 3  # b: train items per reflection (paper 3)
    gepa_max_iterations: int = 50  # safety bound on GEPA iterations besides the budget
    max_template_chars: int = 300  # guard: longer templates are rejected (they derail a small model)
    template_max_growth: float = 1.5  # guard: a child may be at most this times longer than a non-empty parent
    guard_copy_words: int = 8  # guard: this many consecutive words of a minibatch problem (or all of a shorter one) = a copy
    reflect_answer_chars: int = 300  # the policy's answer is cut to this many characters in a reflection record
    reflector: str = "init"  # init: frozen starting policy (Self-Ref) | policy | a model path/id (Teacher-Ref)
    reflector_backend: str = "hf"  # engine for a reflector given as a path (a 2nd in-process vLLM is not supported)
    reflect_temperature: float = 0.8
    reflect_max_tokens: int = 120  # a template is at most max_template_chars (~75 tokens)
    same_template_per_group: bool = False  # ablation: one template for all K rollouts of a prompt
    context_distill: bool = True  # False (ablation): train templated rollouts under x~, not x
    crm: bool = True  # Context Ratio Mask on templated rows (False: ablation)
    crm_low: float = 0.01  # tokens with c_t < crm_low are masked
    crm_high: float = 10.0  # tokens with c_t > crm_high are masked
    crm_soft: bool = False  # scale out-of-band tokens by bound / c_t instead of zeroing them
    crm_denominator: str = "all"  # all: masked tokens still count in token-mean (reference) | kept
    # ---- optimisation
    lr: float = 2e-5  # paper 1e-6 for Qwen3-4B; the 135M default needs a larger step
    warmup_steps: int = 2  # linear warm-up, then constant (paper: 5% warm-up)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm
    micro_batch_size: int = 8  # rows per forward/backward; the loss is still per whole step
    autocast_bf16: bool = True  # bf16 autocast for the training forward (fp32 master weights)
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~1/3 more compute
    max_bad_steps: int = 3  # consecutive NaN/inf steps before stopping (after saving)
    # ---- schedule and outputs
    epochs: int = 2  # passes over train_data (P²O needs 2: GEPA after epoch 0, templates in epoch 1)
    max_steps: int = 0  # > 0: stop after this many steps instead
    eval_every: int = 5  # dev evaluation every N steps (and before and after training)
    eval_k: int = 4  # samples per dev problem for avg@k (greedy is always measured)
    save_every: int = 10  # checkpoint every N steps (and at the end)
    log_rollouts: int = 4  # groups per step written to rollouts.jsonl
    seed: int = 0
    out_dir: str = "runs"
    run_name: str = ""  # default: grpo-<date>-<time>
    resume: str = ""  # a checkpoint folder, or 'auto' = the run's latest


def parse_overrides(cfg, argv):
    """Apply --key=value overrides to a Config, checking names and types."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise SystemExit(f"arguments look like --key=value, got {arg!r}")
        key, value = arg[2:].split("=", 1)
        if key not in fields:
            raise SystemExit(f"unknown setting {key!r}; settings: {', '.join(fields)}")
        kind = type(getattr(cfg, key))
        try:
            if kind is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                parsed = value.lower() in ("true", "1")
            else:
                parsed = kind(value)
        except ValueError:
            raise SystemExit(f"--{key} expects a {kind.__name__}, got {value!r}") from None
        setattr(cfg, key, parsed)
    return cfg


# ----------------------------------------------------------------------------- data stream


class PromptStream:
    """Prompts in a fresh seeded order every epoch, as one endless stream. Its whole state is
    `consumed` (prompts handed out so far), which makes resuming exact."""

    def __init__(self, problems, seed, consumed=0):
        self.problems, self.seed, self.consumed = problems, seed, consumed
        self._order = {}

    def epoch_of(self, position):
        return position // len(self.problems)

    def take(self, n):
        out = []
        for _ in range(n):
            epoch, i = divmod(self.consumed, len(self.problems))
            if epoch not in self._order:
                self._order = {epoch: random.Random(self.seed * 7919 + epoch).sample(
                    range(len(self.problems)), len(self.problems))}
            out.append(self.problems[self._order[epoch][i]])
            self.consumed += 1
        return out


# ----------------------------------------------------------------------------- model helpers


def response_logprobs(model, input_ids, attention, loss_mask, temperature, with_entropy=False):
    """Log-probs of the response tokens, computing the LM head only where loss_mask is set.
    input_ids/attention [B, L]; loss_mask [B, L-1] -> logp [B, L-1] (0 off the mask), entropy."""
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention).last_hidden_state
    selected = hidden[:, :-1][loss_mask]  # [N, H]: positions that predict a response token
    logits = model.get_output_embeddings()(selected)  # [N, V]
    targets = input_ids[:, 1:][loss_mask]  # [N]
    logp = torch.zeros(loss_mask.shape, dtype=torch.float32, device=input_ids.device)
    logp[loss_mask] = grpo.token_logprobs(logits.unsqueeze(0), targets.unsqueeze(0), temperature)[0]
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = grpo.entropy(logits.detach(), temperature)  # [N]
    return logp, ent


def save_checkpoint(run_dir, step, model, tokenizer, optimizer, scheduler, state, cfg):
    """ckpt-NNNNNN/ (HF model folder + trainer.pt), written atomically; then `latest` -> it."""
    from model import atomic_directory

    name = f"ckpt-{step:06d}"
    path = os.path.join(run_dir, name)
    if os.path.isdir(path):
        return path
    with atomic_directory(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save({
            "config": dataclasses.asdict(cfg), "step": step, "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), **state,
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state()},
        }, os.path.join(tmp, "trainer.pt"))
    with open(os.path.join(run_dir, "latest.tmp"), "w") as f:
        f.write(name + "\n")
    os.replace(os.path.join(run_dir, "latest.tmp"), os.path.join(run_dir, "latest"))
    return path


def load_trainer_state(path):
    """trainer.pt of a checkpoint folder, or a clear error naming the file."""
    file = os.path.join(path, "trainer.pt")
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise SystemExit(f"{file}: not a checkpoint (no trainer.pt)") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is reported, not a traceback
        raise SystemExit(f"{file}: corrupt checkpoint ({type(e).__name__}: {e})") from None


def resolve_resume(cfg):
    if cfg.resume != "auto":
        return cfg.resume
    latest = os.path.join(cfg.out_dir, cfg.run_name, "latest")
    if not os.path.isfile(latest):
        raise SystemExit(f"--resume=auto: {latest} does not exist")
    return os.path.join(cfg.out_dir, cfg.run_name, open(latest).read().strip())


# ----------------------------------------------------------------------------- one step's pieces


@dataclass
class Group:
    problem: object  # data.Problem
    samples: list  # K rollout.Sample
    templates: list  # K templates ('' = none)
    rewards: list  # K floats


def generate_groups(engine, problems, assignment, cfg, seed):
    """K rollouts per problem. A problem with assigned templates gets one per rollout (requests
    with the same template are merged into one request with n > 1)."""
    from prompts import problem_messages

    requests = []  # (problem index, template, count)
    for i, p in enumerate(problems):
        templates = assignment.get(p.id) or [""] * cfg.group_size
        for t in dict.fromkeys(templates):  # distinct templates, first-seen order
            requests.append((i, t, templates.count(t)))
    messages = [problem_messages(problems[i], t) for i, t, _ in requests]
    out = engine.generate(messages, n=[c for _, _, c in requests], temperature=cfg.temperature,
                          top_p=cfg.top_p, max_tokens=cfg.max_tokens, seed=seed)
    groups = [Group(p, [], [], []) for p in problems]
    for (i, t, _), samples in zip(requests, out):
        groups[i].samples += samples
        groups[i].templates += [t] * len(samples)
    return groups


def response_slices(mask):
    """Row-major offsets of each row's response tokens in logp[mask]: mask [B, T] -> [B + 1]."""
    return [0] + torch.cumsum(mask.sum(1), 0).tolist()


def gepa_round(cfg, epoch, hard_problems, engine, policy, model_path, counts, reward_fn, reflect_override=None):
    """Run GEPA on this epoch's hard prompts with the current policy answering; return the result."""
    import gepa
    from prompts import problem_messages
    from rollout import make_rollout

    def answer_fn(pairs, kind):
        msgs = [problem_messages(item, t) for t, item in pairs]
        out = engine.generate(msgs, n=1, temperature=0.0, max_tokens=cfg.max_tokens)
        counts[f"{kind}_rollouts"] += len(pairs)
        counts[f"{kind}_tokens"] += sum(len(g[0].response_ids) for g in out)
        return [g[0].text for g in out]

    reflector_engine, swap = engine, None
    if reflect_override is None and cfg.reflector == "init":  # Self-Ref: the frozen starting weights, swapped into the engine
        from transformers import AutoModelForCausalLM
        swap = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    elif reflect_override is None and cfg.reflector != "policy":  # Teacher-Ref: another local model
        from model import resolve_model
        reflector_engine = make_rollout(cfg.reflector_backend, resolve_model(cfg.reflector))

    def reflect_fn(prompts):
        if reflect_override is not None:  # tests: a scripted reflector
            counts["reflection_calls"] += len(prompts)
            return reflect_override(prompts)
        current = {k: v.detach().clone() for k, v in policy.state_dict().items()} if swap else None
        if swap:
            engine.push_weights(swap)
        try:
            # the answer is prefilled with the opening delimiter and stops at the closing one: a
            # small reflector rarely produces the delimiters by itself
            out = reflector_engine.generate(
                [[{"role": "user", "content": p}, {"role": "assistant", "content": gepa.DELIM_OPEN}] for p in prompts],
                n=1, temperature=cfg.reflect_temperature, max_tokens=cfg.reflect_max_tokens,
                seed=cfg.seed * 7 + counts["reflection_calls"], stop=[gepa.DELIM_CLOSE])
        finally:
            if swap:
                engine.push_weights(current)
        counts["reflection_calls"] += len(prompts)
        counts["reflection_tokens"] += sum(len(g[0].response_ids) for g in out)
        return [(gepa.DELIM_OPEN + g[0].text, g[0].finish_reason == "stop") for g in out]

    gcfg = gepa.GepaConfig(budget=cfg.gepa_budget, dev_max=cfg.gepa_dev_max, parents_per_iter=cfg.gepa_parents,
                           minibatch=cfg.gepa_minibatch, max_template_chars=cfg.max_template_chars)
    return gepa.run_gepa(hard_problems, answer_fn, reflect_fn, gcfg, random.Random(cfg.seed * 7919 + epoch),
                         k=cfg.group_size, same_for_group=cfg.same_template_per_group, reward_fn=reward_fn)


# ----------------------------------------------------------------------------- the loop


def train(cfg, engine=None, reward_fn=None, reflect_fn=None):
    """Run P²O (or GRPO with algo=grpo) with `cfg`. For tests: `engine` (an existing rollout
    engine holding cfg.model's weights), `reward_fn(text, problem) -> float` (default
    verify.reward; GEPA scores with the same function) and `reflect_fn(prompts) -> [(text,
    finished)]` (a scripted reflector)."""
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import distill
    from data import load_jsonl
    from eval import evaluate
    from model import resolve_model
    from prompts import problem_messages
    from rollout import HFRollout, encode_prompt, make_rollout
    from verify import reward as verify_reward

    if cfg.algo not in ("p2o", "grpo"):
        raise SystemExit(f"--algo must be p2o or grpo, got {cfg.algo!r}")
    if cfg.crm_denominator not in ("all", "kept") or (cfg.crm_denominator == "kept" and cfg.loss_agg != "token-mean"):
        raise SystemExit("--crm_denominator is all | kept, and kept needs --loss_agg=token-mean")
    reward_fn = reward_fn or (lambda text, problem: verify_reward(text, problem.answer))
    resume_state = None
    if cfg.resume:
        path = resolve_resume(cfg)
        resume_state = load_trainer_state(path)
        print(f"resuming from {path} at step {resume_state['step']}")
    cfg.run_name = cfg.run_name or f"{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    os.makedirs(run_dir, exist_ok=True)
    print(json.dumps(dataclasses.asdict(cfg), indent=1))
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    # ---- data
    train_set, _ = load_jsonl(cfg.train_data)
    dev_set = load_jsonl(cfg.dev_data)[0] if cfg.dev_data else []
    by_id = {p.id: p for p in train_set}
    stream = PromptStream(train_set, cfg.seed, resume_state["consumed"] if resume_state else 0)
    steps_per_epoch = max(1, len(train_set) // cfg.prompts_per_step)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch

    # ---- models: the policy (fp32 master weights), the optional reference, the rollout engine
    model_path = resolve_model(cfg.model)
    weights_path = path if resume_state else model_path
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    policy = AutoModelForCausalLM.from_pretrained(weights_path, dtype=torch.float32)
    policy.train()
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = None
    if cfg.kl_beta > 0:
        reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        reference.requires_grad_(False)
    if engine is None:
        if cfg.backend == "hf":
            engine = HFRollout(None, model=policy, tokenizer=tokenizer)  # shares the weights
        else:
            engine = make_rollout(cfg.backend, weights_path, dtype=cfg.engine_dtype, seed=cfg.seed,
                                  max_model_len=2048)
    elif resume_state:
        engine.push_weights(policy.state_dict())
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))

    # ---- loop state; all of it is in every checkpoint, so a resumed run continues exactly
    step, bad_steps, skipped_steps = 0, 0, 0
    counts = Counter()  # rollouts / tokens / reflection calls by category
    hard_now = {}  # id -> None: prompts found hard in the current epoch (insertion-ordered)
    assignment = {}  # id -> K templates, from the last GEPA round (used during this epoch)
    epoch = 0
    gepa_history = []
    if resume_state:
        optimizer.load_state_dict(resume_state["optimizer"])
        scheduler.load_state_dict(resume_state["scheduler"])
        step, skipped_steps = resume_state["step"], resume_state["skipped_steps"]
        counts = Counter(resume_state["counts"])
        hard_now = dict.fromkeys(resume_state["hard_now"])
        assignment, epoch = resume_state["assignment"], resume_state["epoch"]
        gepa_history = resume_state["gepa_history"]
        random.setstate(resume_state["rng"]["python"])
        np.random.set_state(resume_state["rng"]["numpy"])
        torch.set_rng_state(resume_state["rng"]["torch"])

    writer = SummaryWriter(os.path.join(run_dir, "tb"))
    writer.add_text("config", "```\n" + json.dumps(dataclasses.asdict(cfg), indent=1) + "\n```", step)
    metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
    rollouts_file = open(os.path.join(run_dir, "rollouts.jsonl"), "a")

    def state():
        return {"consumed": stream.consumed, "skipped_steps": skipped_steps, "counts": dict(counts),
                "hard_now": list(hard_now), "assignment": assignment, "epoch": epoch,
                "gepa_history": gepa_history}

    def checkpoint():
        return save_checkpoint(run_dir, step, policy, tokenizer, optimizer, scheduler, state(), cfg)

    def dev_eval():
        if not dev_set:
            return {}
        overall, _, _ = evaluate(engine, dev_set, k=cfg.eval_k, temperature=cfg.temperature,
                                 top_p=cfg.top_p, max_tokens=cfg.max_tokens, progress=False)
        for key, value in overall.items():
            writer.add_scalar(f"dev/{key}", value, step)
        with open(os.path.join(run_dir, "dev.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **overall}) + "\n")
        tqdm.write(f"dev @ step {step}: greedy {overall['greedy']:.3f}" +
                   (f", avg@{cfg.eval_k} {overall[f'avg@{cfg.eval_k}']:.3f}" if cfg.eval_k else ""))
        return overall

    stop = {"signal": None}

    def on_signal(signum, frame):
        if stop["signal"] is not None:  # second signal: give up immediately
            raise KeyboardInterrupt
        stop["signal"] = signum
        print(f"\nsignal {signum}: finishing this step, saving a checkpoint, exiting")

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    print("note: with ppo_epochs=1 the PPO ratio is exactly 1, so the logged loss is ~0 while its "
          "gradient is the policy gradient (see grpo.py)")
    start_eval = dev_eval() if step == 0 else {}
    bar = tqdm(total=total_steps, initial=step, desc=cfg.algo, dynamic_ncols=True)
    try:
        while step < total_steps and stop["signal"] is None:
            t0 = time.perf_counter()
            # ---- generate: K rollouts per prompt, templated for last epoch's hard prompts
            #      (DAPO: refill with more prompts while groups carry no signal)
            groups, refills, gen_time, score_time = [], 0, 0.0, 0.0
            need = cfg.prompts_per_step
            while True:
                problems = stream.take(need)
                tg = time.perf_counter()
                new = generate_groups(engine, problems, assignment, cfg,  # per-step seeds: exact resume
                                      seed=(cfg.seed * 100_003 + step) * 10_000 + refills * 1_000)
                gen_time += time.perf_counter() - tg
                counts["train_rollouts"] += sum(len(g.samples) for g in new)
                counts["train_tokens"] += sum(len(s.response_ids) for g in new for s in g.samples)
                # ---- score, and mine hard prompts (judged on the rollouts they actually got)
                ts = time.perf_counter()
                for g in new:
                    g.rewards = [reward_fn(s.text, g.problem) for s in g.samples]
                    if cfg.algo == "p2o" and sum(g.rewards) < cfg.tau:
                        hard_now[g.problem.id] = None
                score_time += time.perf_counter() - ts
                if not cfg.dynamic_sampling:
                    groups = new
                    break
                groups += [g for g in new if len(set(g.rewards)) > 1][:need]  # DAPO: keep varied groups
                need = cfg.prompts_per_step - len(groups)
                if need <= 0 or refills >= cfg.max_refills:
                    groups = groups or new  # nothing varied at all: an update of zero
                    break
                refills += 1

            # ---- advantages (each group normalised alone, templated or not)
            rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [G, K]
            adv = grpo.group_advantages(rewards, cfg.adv_norm)  # [G, K]

            # ---- rows: templated rollouts re-built under the original prompt (context distillation)
            rows = []  # (train prompt ids, response ids, advantage, templated prompt ids or None)
            for gi, g in enumerate(groups):
                if any(g.templates) and cfg.context_distill:  # the original prompt x, tokenised once
                    plain_ids = encode_prompt(tokenizer, problem_messages(g.problem))
                for k, (s, t) in enumerate(zip(g.samples, g.templates)):
                    if t and cfg.context_distill:
                        prompt_ids, response_ids = distill.distill_row(plain_ids, s)
                        rows.append((prompt_ids, response_ids, adv[gi, k].item(), s.prompt_ids if cfg.crm else None))
                    else:  # plain rows, and (ablation) templated rows trained under x~
                        rows.append((s.prompt_ids, s.response_ids, adv[gi, k].item(), None))
            step_tokens = sum(len(r[1]) for r in rows)
            step_rows = len(rows)
            train_rows = [r for r in rows if r[2] != 0.0 or cfg.kl_beta > 0]
            train_rows.sort(key=lambda r: len(r[0]) + len(r[1]))  # less padding per micro-batch

            # ---- train: PPO-clip loss over the whole step, accumulated over micro-batches
            tt = time.perf_counter()
            batches = []
            for i in range(0, len(train_rows), cfg.micro_batch_size):
                mb = train_rows[i:i + cfg.micro_batch_size]
                ids, attn, resp = grpo.make_batch([r[0] for r in mb], [r[1] for r in mb], pad_id)
                batches.append({"ids": ids, "attn": attn, "mask": resp[:, 1:], "adv": torch.tensor([r[2] for r in mb]),
                                "responses": [r[1] for r in mb], "templated": [r[3] for r in mb],
                                "old": None, "ref": None, "tilde": None})
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=cfg.autocast_bf16):
                for b in batches:
                    if cfg.ppo_epochs > 1:
                        b["old"] = response_logprobs(policy, b["ids"], b["attn"], b["mask"], cfg.temperature)[0]
                    if reference is not None:
                        b["ref"] = response_logprobs(reference, b["ids"], b["attn"], b["mask"], cfg.temperature)[0]
                    t_idx = [j for j, x in enumerate(b["templated"]) if x is not None]
                    if t_idx:  # CRM: old log-probs of the same response tokens under x~
                        responses = [b["responses"][j] for j in t_idx]
                        tids, tattn, tresp = grpo.make_batch([b["templated"][j] for j in t_idx], responses, pad_id)
                        tmask = tresp[:, 1:]
                        tflat = response_logprobs(policy, tids, tattn, tmask, cfg.temperature)[0][tmask]
                        tstarts = response_slices(tmask)
                        b["tilde"] = {j: tflat[tstarts[q]:tstarts[q + 1]] for q, j in enumerate(t_idx)}
            stats = Counter()
            denominator = step_tokens if cfg.crm_denominator == "all" else 1.0  # kept: rescaled below
            grad_norm, finite = 0.0, True
            for epoch_i in range(cfg.ppo_epochs):
                optimizer.zero_grad(set_to_none=True)
                masked_tokens = 0
                for b in batches:
                    mask = b["mask"]
                    with torch.autocast("cpu", torch.bfloat16, enabled=cfg.autocast_bf16):
                        logp, ent = response_logprobs(policy, b["ids"], b["attn"], mask, cfg.temperature,
                                                      with_entropy=epoch_i == 0)
                    old_logp = logp.detach() if b["old"] is None else b["old"]
                    token_loss, clipped = grpo.ppo_clip_token_loss(
                        logp, old_logp, b["adv"], cfg.eps_low, cfg.eps_high, cfg.dual_clip)
                    weight = None
                    if b["tilde"]:  # Context Ratio Mask on the templated rows
                        starts = response_slices(mask)
                        flat_old = old_logp[mask]
                        flat_tilde = flat_old.clone()
                        is_t = torch.zeros_like(flat_old, dtype=torch.bool)
                        for j, tl in b["tilde"].items():
                            flat_tilde[starts[j]:starts[j + 1]] = tl
                            is_t[starts[j]:starts[j + 1]] = True
                        w_flat, log_c = distill.crm_weights(flat_old, flat_tilde, cfg.crm_low, cfg.crm_high, cfg.crm_soft)
                        weight = torch.ones_like(logp)
                        weight[mask] = w_flat
                        if epoch_i == 0:
                            cs = distill.crm_stats(w_flat, log_c, is_t)
                            stats["crm_templated_tokens"] += cs["templated_tokens"]
                            stats["crm_masked_tokens"] += cs["crm_masked_fraction"] * cs["templated_tokens"]
                            stats["crm_log_ratio_sum"] += cs["crm_mean_log_ratio"] * cs["templated_tokens"]
                        masked_tokens += int((w_flat == 0).sum())
                    if b["ref"] is not None:
                        kl = grpo.k3_kl(logp, b["ref"])
                        token_loss = token_loss + cfg.kl_beta * kl
                        stats["kl"] += (kl * mask).sum().item() / step_tokens
                    loss = grpo.aggregate(token_loss, mask.float(), cfg.loss_agg, denominator,
                                          step_rows, cfg.max_tokens, weight)
                    loss.backward()
                    stats["loss"] += loss.item()
                    stats["clipped"] += (clipped & mask).sum().item()
                    if ent is not None:
                        stats["entropy"] += ent.sum().item()
                        stats["ent_tokens"] += ent.numel()
                if cfg.crm_denominator == "kept" and batches:  # token-mean over the tokens CRM kept
                    kept = max(1, step_tokens - masked_tokens)
                    for prm in policy.parameters():
                        if prm.grad is not None:
                            prm.grad /= kept
                    stats["loss"] /= kept
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip).item() \
                    if batches else 0.0
                finite = math.isfinite(stats["loss"]) and math.isfinite(grad_norm)
                if not finite:
                    break
                optimizer.step()
            train_time = time.perf_counter() - tt
            lr = scheduler.get_last_lr()[0]

            step += 1
            if not finite:  # a NaN/inf loss or gradient: skip the update, count it
                optimizer.zero_grad(set_to_none=True)
                bad_steps += 1
                skipped_steps += 1
                print(f"step {step}: non-finite loss/grad (loss {stats['loss']}, grad {grad_norm}); skipped")
                if bad_steps >= cfg.max_bad_steps:
                    raise RuntimeError(f"{bad_steps} consecutive non-finite steps; stopped after "
                                       f"saving {checkpoint()}")
            else:
                bad_steps = 0
                scheduler.step()

            # ---- push the new weights into the rollout engine (verified inside)
            tp = time.perf_counter()
            if finite and batches:
                engine.push_weights(policy.state_dict())
            push_time = time.perf_counter() - tp

            # ---- log
            flat = [s for g in groups for s in g.samples]
            lengths = [len(s.response_ids) for s in flat]
            templated = [any(g.templates) for g in groups]
            t_rewards = [r for g, t in zip(groups, templated) if t for r in g.rewards]
            p_rewards = [r for g, t in zip(groups, templated) if not t for r in g.rewards]
            m = {
                "step": step, "epoch": epoch,
                "reward_mean": rewards.mean().item(),
                "accuracy_any": (rewards.max(dim=1).values > 0).float().mean().item(),
                "zero_variance_groups": (rewards.std(dim=1) == 0).float().mean().item() if rewards.shape[1] > 1 else 1.0,
                "groups": len(groups), "refills": refills,
                "response_len_mean": sum(lengths) / len(lengths), "response_len_max": max(lengths),
                "truncated": sum(s.finish_reason == "length" for s in flat) / len(flat),
                "loss": stats["loss"] / cfg.ppo_epochs, "kl": stats["kl"] / cfg.ppo_epochs,
                "clip_fraction": stats["clipped"] / max(1, step_tokens * cfg.ppo_epochs),
                "entropy": stats["entropy"] / max(1, stats["ent_tokens"]),
                "grad_norm": grad_norm, "lr": lr, "trained_rows": len(train_rows),
                "templated_row_fraction": sum(bool(t) for g in groups for t in g.templates) / len(flat),
                "reward_templated_groups": sum(t_rewards) / len(t_rewards) if t_rewards else float("nan"),
                "reward_plain_groups": sum(p_rewards) / len(p_rewards) if p_rewards else float("nan"),
                "crm_masked_fraction": stats["crm_masked_tokens"] / max(1, stats["crm_templated_tokens"]),
                "crm_mean_log_ratio": stats["crm_log_ratio_sum"] / max(1, stats["crm_templated_tokens"]),
                "hard_so_far": len(hard_now),
                "time_generate": gen_time, "time_score": score_time, "time_train": train_time,
                "time_push": push_time, "time_step": time.perf_counter() - t0,
                "gen_tokens_per_s": sum(lengths) / max(gen_time, 1e-9), "skipped_steps": skipped_steps,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "prompt_ids": [g.problem.id for g in groups],
            }
            for key, value in m.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    writer.add_scalar(f"train/{key}", value, step)
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()
            for g in groups[:cfg.log_rollouts]:
                rollouts_file.write(json.dumps({"step": step, "id": g.problem.id, "answer": g.problem.answer,
                                                "templates": g.templates, "responses": [s.text for s in g.samples],
                                                "rewards": g.rewards}) + "\n")
            rollouts_file.flush()
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", zero_var=f"{m['zero_variance_groups']:.2f}",
                            gen=f"{gen_time:.1f}s", train=f"{train_time:.1f}s")

            # ---- end of an epoch: GEPA on this epoch's hard prompts -> next epoch's templates
            if stream.epoch_of(stream.consumed) > epoch:
                if cfg.algo == "p2o":
                    writer.add_scalar("p2o/hard_set_size", len(hard_now), epoch)
                    summary = {"epoch": epoch, "hard": len(hard_now), "ran": False}
                    if len(hard_now) >= cfg.gepa_min_hard and step < total_steps:
                        tqdm.write(f"epoch {epoch}: {len(hard_now)} hard prompts -> GEPA")
                        tg = time.perf_counter()
                        result = gepa_round(cfg, epoch, [by_id[i] for i in hard_now], engine, policy,
                                            model_path, counts, reward_fn, reflect_fn)
                        archive = result.to_json()
                        with open(os.path.join(run_dir, f"gepa-epoch-{epoch}.json"), "w") as f:
                            json.dump(archive, f, indent=1)
                        assignment = result.assignment
                        proposals = sum(e["outcome"] != "skipped_all_correct" for e in result.log)
                        accepted = sum(e["outcome"] == "accepted" for e in result.log)
                        summary.update(ran=True, seconds=time.perf_counter() - tg, pool=len(result.pool),
                                       accepted=accepted, proposals=proposals, rejections=dict(result.rejections),
                                       best_dev_score=archive["best_dev_score"], chosen=len(result.chosen),
                                       assigned=len(assignment), metric_calls=result.metric_calls)
                        writer.add_scalar("p2o/gepa_acceptance_rate", accepted / max(1, proposals), epoch)
                        writer.add_scalar("p2o/gepa_best_dev_score", archive["best_dev_score"], epoch)
                        tqdm.write(f"GEPA: {json.dumps(summary)}")
                    else:
                        assignment = {}
                    gepa_history.append(summary)
                hard_now = {}
                epoch = stream.epoch_of(stream.consumed)

            if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
                dev_eval()
            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint()
        final_path = checkpoint()
        if stop["signal"] is not None:
            print(f"stopped by signal {stop['signal']}; checkpoint {final_path}")
            return {"step": step, "checkpoint": final_path, "interrupted": True}
        end_eval = dev_eval()
    finally:
        bar.close()
        writer.close()
        metrics_file.close()
        rollouts_file.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    from plot import plot_run

    print(f"curves: {plot_run(run_dir)}")
    gepa_tokens = counts["gepa_minibatch_tokens"] + counts["gepa_dev_tokens"] + counts["reflection_tokens"]
    all_tokens = gepa_tokens + counts["train_tokens"]
    print(f"compute: {json.dumps(dict(counts))}; GEPA share of generated tokens "
          f"{gepa_tokens / max(1, all_tokens):.3f}")
    if gepa_history:
        print(f"P²O epochs: {json.dumps(gepa_history)}")
    if start_eval and end_eval:
        print(f"dev greedy accuracy: {start_eval['greedy']:.3f} before -> {end_eval['greedy']:.3f} after "
              f"({len(dev_set)} problems)")
    return {"step": step, "checkpoint": final_path, "start_eval": start_eval, "end_eval": end_eval,
            "policy": policy, "counts": counts, "gepa_history": gepa_history}


def main(argv):
    cfg = parse_overrides(Config(), argv)
    if cfg.resume:  # the checkpoint's settings, then the command line's on top
        saved = load_trainer_state(resolve_resume(cfg))["config"]
        cfg = parse_overrides(Config(**{**saved, "resume": cfg.resume}), argv)
    train(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
