"""P²O on a hand-written GRPO: the training loop, the file a researcher edits.

    python train.py                                  # short P²O run: default model, built-in task
    python train.py --algo=grpo --group_size=12      # the GRPO 2K baseline (every P²O setting ignored)
    python train.py --crm=False                      # P²O ablation: no Context Ratio Mask (docs/TRAINING.md: all of them)
    python train.py --eps_high=0.28 --dynamic_sampling=True   # DAPO's clip-higher and dynamic sampling
    python train.py --lora_rank=16                   # LoRA adapters on a frozen base (lora.py; lr x lora_lr_scale)
    python train.py --resume=auto --run_name=NAME    # continue the latest checkpoint of a run
    python train.py --config=configs/p2o_official.yaml --dry_run   # the reference code's settings, printed
    torchrun --nproc_per_node=8 train.py --model=...   # every GPU of a node (FSDP2; docs/GPU.md)

Every setting lives in `config.Config`; `--config=FILE` (JSON or YAML, configs/) and then
`--key=value` (or `--key value`, a bare `--flag`) override it. Settings, paths, the model and
the data are checked before anything loads (`train`). The
method: docs/METHOD.md. One step (`train_step`), readable in this file, grpo.py and distill.py:

    collect_groups   B prompts -> K rollouts each (vLLM; a prompt that was hard last epoch gets
                     one GEPA template per rollout) -> rewards -> hard-prompt mining (-> DAPO refill)
    training_rows    group advantages (grpo.group_advantages); templated rollouts re-built under
                     the original prompt (context distillation, distill.distill_row)
    policy_update    CRM weights of every templated row (distill.crm_rows), old / reference
                     log-probs (pre_update_pass), then per micro-batch the loss of grpo.policy_loss
                     over the whole step's denominators (grpo.step_denominators), AdamW
    push_weights     the new weights into the rollout engine (verified)
    step_metrics     -> RunLog (runs.py): TensorBoard, metrics.jsonl, rollouts.jsonl
and when the step's prompts used up an epoch, `end_epoch`: GEPA evolves templates for that
epoch's hard prompts (gepa.py; the reflector is one of rollout.py's) and assigns K of them to
each. Epoch 0 is plain GRPO. A step never mixes two epochs: the last step of an epoch whose size
is not a multiple of B is short (docs/METHOD.md "Epochs").

Outputs go to out_dir/run_name (the folder's files: runs.py). One process, or `torchrun
--nproc_per_node=N train.py ...` for every GPU of a node (train(), dist.py, docs/GPU.md).
Simplifications, on purpose: the reference model exists only when kl_beta > 0 (and is not
sharded); groups whose advantages are all zero are not forwarded when kl_beta == 0 (their
gradient is exactly zero) but their tokens still count in the token-mean denominator; policy
entropy is measured on the rows that were forwarded. The reference code's behaviour: the switches
of docs/METHOD.md §9, all set by `--config=configs/p2o_official.yaml`.
"""

import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

import dist
import distill
import gepa
import grpo
import lora
import shaping
from config import (Config, chat_template_kwargs, check_config, config_help, cpu_precision, cpu_threads,
                    dry_run_report, learning_rate, packed_layout, pick_device, resolve_settings)
from data import PromptStream, load_data
from forward import autocast, group_hidden_means, response_logprobs, row_logprobs, two_context_logprobs
from model import check_models, pad_token_id, resolve_model
from prompts import encode_prompt, gold_text, problem_messages
from rollout import Sample, check_fit, greedy_answers, load_models, make_reflector, remote_reflector
from runs import (DISK_ERRORS, RunLog, StopSignal, budget_spent, check_run_folder, checkpoint, console_line,
                  dev_eval, export, fields_of, forward_tokens, generated_tokens, link_checkpoint, load_rank_state,
                  loss_note, method_metrics, pointer_target, print_summary, quiet_disk_errors, restore_trainer,
                  resume_point, route_library_logs, sampler_mismatch_bound, shaping_metrics, start_branch,
                  step_metrics, time_summary, warmup_factor)
from scoring import ScoringError
from verify import RewardError, reward_scorer, take_failures


# ----------------------------------------------------------------------------- state and records


@dataclass
class LoopState:
    """Everything the loop carries from one step to the next. Saved whole in every checkpoint
    (`fields_of`) and restored with `LoopState(**saved)`: a new field is one edit."""
    step: int = 0
    consumed: int = 0  # position in the PromptStream: prompts handed out so far
    epoch: int = 0  # the epoch whose hard prompts are being collected
    bad_steps: int = 0  # consecutive non-finite steps
    skipped_steps: int = 0
    hard_now: dict = field(default_factory=dict)  # id -> None: this epoch's hard prompts, in order found
    assignment: dict = field(default_factory=dict)  # id -> K templates, from the last GEPA round
    counts: Counter = field(default_factory=Counter)  # rollouts / tokens / reflection calls by category
    gepa_history: list = field(default_factory=list)  # one summary per epoch end
    best_dev: float = -1.0  # best dev greedy accuracy after a training step so far ...
    best_step: int = -1  # ... and its step: ckpt-<best_step> is `best`


@dataclass
class Group:
    problem: object  # data.Problem
    samples: list  # K rollout.Sample
    templates: list  # K templates ('' = none)
    rewards: list  # K floats: the verified reward (mining, DAPO, GEPA and the logs read these)
    bonus: list | None = None  # K floats of reward shaping (shaping.apply_shapers), added where advantages are formed only


ROLLOUT = "rollout"  # Row.kind of a rollout: GRPO's policy term, its denominators and the entropy read these rows only


@dataclass
class Row:
    """One training row: a response and the prompt it is trained under. The step's rows are
    shared by every pass: one that computes something per row puts it on a copy
    (dataclasses.replace; with_data), never on the row itself."""
    prompt_ids: list  # x (or x~ in the no-distillation ablation)
    response_ids: list  # the sampled tokens, with the EOS that ended a finished answer
    advantage: float  # A: the group-normalised shaped reward of a rollout (a method's rows: whatever its term reads)
    tilde_prompt_ids: list | None = None  # x~ of a distilled templated row (for its CRM weights / fix_importance_ratio)
    sampler_logp: list | None = None  # the engine's log-probs of the response, when sampled under prompt_ids
    group: int | None = None  # index of its group in the step (mini-batches never split a group); None: a
    # method's row of no group, dealt to the mini-batches in turn
    reward: float | None = None  # the verified reward of its rollout (not the shaped one; None: not a rollout's)
    problem_id: str | None = None  # data.Problem.id of its prompt
    token_advantage: list | None = None  # [len(response_ids)] added to A token by token (token_advantages)
    crm_weight: torch.Tensor | None = None  # [len(response_ids)], on the copy the CRM pass makes (distill.crm_rows)
    tilde_old_logp: torch.Tensor | None = None  # [len(response_ids)] pi_old(y|x~), on the CRM pass's copy too
    kind: str = ROLLOUT  # a method's auxiliary rows have a kind of their own, read only by its AuxTerm
    data: dict = field(default_factory=dict)  # what a method's term needs of the row; a Pass's output (data[name])


def with_data(row, **values):
    """A copy of `row` with `values` added to its data (the row itself is left as it was)."""
    return dataclasses.replace(row, data={**row.data, **values})


@dataclass
class AuxTerm:
    """One more term of the step loss: coef x token_loss aggregated (cfg.loss_agg) over the
    response tokens of the rows of `kind`, with ITS OWN denominators (those rows' tokens and
    rows in the whole mini-batch: every micro-batch, every rank). Logged as loss_<name>, the
    unweighted sum of token_loss as <name>_sum and the weight as coef_<name>. Rows of a kind no
    term reads are never forwarded. coef: a number, or a function of the step (metrics.jsonl's
    number, 1 first). temperature: of the log-probs token_loss gets; None: the sampling
    temperature, which terms on the rollouts need (the KL); a supervised term wants 1.0."""
    name: str
    kind: str
    coef: object  # float, or step -> float
    token_loss: object  # (logp [B, T] with grad, b: MicroBatch) -> [B, T]; read on its rows' response tokens only
    temperature: float | None = None

    def coefficient(self, step):
        return float(self.coef(step) if callable(self.coef) else self.coef)


def aux_terms(cfg):
    """The extra loss terms of this run. Shipped: the k3 KL to the frozen reference (kl_beta > 0),
    on every token of every rollout, never CRM-weighted. A method appends its own here."""
    terms = []
    if cfg.kl_beta > 0:
        terms.append(AuxTerm("kl", ROLLOUT, cfg.kl_beta, kl_token_loss))
    return terms


def kl_token_loss(logp, b):
    """The KL term's per-token k3 against the frozen reference's log-probs (pre_update_pass)."""
    if b.ref_logp is None:
        raise ValueError("kl_beta > 0 needs the frozen reference model: pass policy_update a reference "
                         "(rollout.load_models builds it when kl_beta > 0)")
    return grpo.k3_kl(logp, b.ref_logp)


def forwarded(row, terms):
    """THE rule of which rows go through the training forward (read by the update, the FLOPs
    count and, through the kinds, the denominators and the entropy): a rollout whose advantage,
    or some token's advantage term, is not 0 (any other has an exactly zero policy gradient) and
    every row a loss term reads."""
    signal = row.advantage != 0.0 or any(row.token_advantage or ())
    return (row.kind == ROLLOUT and signal) or any(t.kind == row.kind for t in terms)


def row_temperature(kind, terms, cfg):
    """The temperature of a kind's log-probs: the sampling temperature for the rollouts, a term's
    own for the rows only it reads (AuxTerm.temperature); two terms that disagree are an error."""
    wanted = {cfg.temperature if t.temperature is None else t.temperature for t in terms if t.kind == kind}
    if kind == ROLLOUT and wanted - {cfg.temperature}:
        raise ValueError(f"a term on the rollouts reads them at the sampling temperature {cfg.temperature} "
                         f"(GRPO's ratio does), not {sorted(wanted)}")
    if len(wanted) > 1:
        raise ValueError(f"the terms on rows of kind {kind!r} ask for different temperatures {sorted(wanted)}")
    return wanted.pop() if wanted else cfg.temperature


@dataclass
class Pass:
    """A no-grad forward of the pre-update policy besides the training forward: the rows it `reads`
    and the tokens it puts through the policy for each. The FLOPs count (runs.forward_tokens) adds
    up these and the forwarded rows, nothing else. `run` (run, the rows it reads) -> a value per
    row: a method's pass, run before the update, its values on copies of the rows as data[name];
    None: the update runs it."""
    name: str
    reads: object  # row -> bool
    tokens: object  # row -> tokens through the policy for it
    run: object = None


def passes(cfg, terms):
    """The no-grad passes of a step. Shipped (run by the update): the CRM's (x and x~ of each
    distilled templated rollout, also with --crm=False for --fix_importance_ratio), the stored old
    log-probs (ppo_epochs or mini_batches > 1) and the frozen reference's (kl_beta > 0) of the
    forwarded rows. A method appends its own."""
    out = [Pass("crm", lambda r: r.kind == ROLLOUT and r.tilde_prompt_ids is not None,
                lambda r: len(r.prompt_ids) + len(r.tilde_prompt_ids) + 2 * len(r.response_ids))]
    trained = functools.partial(forwarded, terms=terms)
    if cfg.ppo_epochs > 1 or cfg.mini_batches > 1:
        out.append(Pass("old_logp", trained, lambda r: len(r.prompt_ids) + len(r.response_ids)))
    if cfg.kl_beta > 0:
        out.append(Pass("reference", trained, lambda r: len(r.prompt_ids) + len(r.response_ids)))
    return out


@dataclass
class MicroBatch:
    """Right-padded rows and everything the loss needs from the pre-update weights."""
    input_ids: torch.Tensor  # [B, L] prompt + response
    attention: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L-1] bool: position t predicts a response token
    advantages: torch.Tensor  # [B, L-1] A of each row plus its per-token term (Row.token_advantage)
    sampler_logp: torch.Tensor  # [B, L-1] the rollout engine's log-probs (0 where unknown)
    sampler_mask: torch.Tensor  # [B, L-1] bool: positions where sampler_logp is known
    temperature: float = 1.0  # of every log-prob of the batch (row_temperature)
    crm_weight: torch.Tensor | None = None  # [B, L-1] Context Ratio Mask (1 on plain rows); None: no templated row
    old_logp: torch.Tensor | None = None  # [B, L-1] (a later optimizer step of the call needs them)
    tilde_old: tuple | None = None  # fix_importance_ratio: ([B, L-1] pi_old(y|x~), [B, L-1] bool where it replaces old_logp)
    ref_logp: torch.Tensor | None = None  # [B, L-1] frozen reference (kl_beta > 0)
    dummy: bool = False  # torchrun: a stand-in that keeps this rank's forwards in step (loss x 0)
    rows: list = field(default_factory=list)  # the Rows, in batch order (an AuxTerm reads their kind and data)
    packed: grpo.Packed | None = None  # shared_prompt: the same rows with each prompt once, for the forward

    def of_kind(self, kind):
        """[B, 1] bool: the rows of this kind (broadcasts against the [B, L-1] masks)."""
        return torch.tensor([r.kind == kind for r in self.rows], device=self.loss_mask.device)[:, None]


# ----------------------------------------------------------------------------- one step


def generate_groups(engine, problems, assignment, cfg, seed):
    """K rollouts per problem. A problem with assigned templates gets one per rollout (requests
    with the same template are merged into one request with n > 1)."""
    requests = []  # (problem index, template, count)
    for i, p in enumerate(problems):
        templates = assignment.get(p.id) or [""] * cfg.group_size
        for t in dict.fromkeys(templates):  # distinct templates, first-seen order
            requests.append((i, t, templates.count(t)))
    messages = [problem_messages(problems[i], t, cfg.prompt_format) for i, t, _ in requests]
    out = engine.generate(messages, n=[c for _, _, c in requests], temperature=cfg.temperature,
                          top_p=cfg.top_p, max_tokens=cfg.max_tokens, seed=seed, logprobs=True)
    groups = [Group(p, [], [], []) for p in problems]
    for (i, t, _), samples in zip(requests, out):
        groups[i].samples += samples
        groups[i].templates += [t] * len(samples)
    return groups


def gold_groups(tokenizer, chat_kwargs, engine, problems, assignment, cfg, seed):
    """--algo=sft: instead of sampling, each problem's gold response (gold_text) and EOS is its one rollout."""
    groups = []
    for p in problems:
        if not p.solution:
            raise SystemExit(f"--algo=sft: training problem {p.id} has no solution")
        text = gold_text(p)
        response = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        prompt = encode_prompt(tokenizer, problem_messages(p, fmt=cfg.prompt_format), chat_kwargs)
        groups.append(Group(p, [Sample(prompt, response, text, "stop")], [""], []))
    return groups


def collect_groups(engine, stream, state, cfg, reward_fn, generate=generate_groups):
    """This step's groups: generate, score, mine hard prompts (judged on the rollouts they
    actually got, templated ones included); DAPO refills while groups carry no signal. Prompts
    come from one epoch only: the epoch's last step may be short, and a refill stops at its end.
    Under torchrun each rank generates and scores its share of the prompts (dist.split) with
    its own engine and seed; the shares are then gathered, so every rank holds all groups in
    order and mines, refills and counts exactly as one process would.
    Returns (groups, {"refills", "generate", "score"}); advances state.consumed."""
    groups, info, need = [], {"refills": 0, "generate": 0.0, "score": 0.0}, cfg.prompts_per_step
    epoch = stream.epoch_of(state.consumed)
    while True:
        problems = stream.take(state.consumed, need)
        state.consumed += len(problems)
        t = time.perf_counter()
        seed = (cfg.seed * 100_003 + state.step) * 10_000 + info["refills"] * 1_000  # exact resume; the engine adds its rank
        local = generate(engine, dist.split(problems, dist.rank(), dist.world()), state.assignment, cfg, seed)
        info["generate"] += time.perf_counter() - t
        t = time.perf_counter()
        for g in local:
            g.rewards = [reward_fn(s.text, g.problem) for s in g.samples]
        new = dist.unsplit(dist.gather_objects(local))  # all groups, in prompt order, on every rank
        failures = dist.all_sum(take_failures())  # --reward_errors=zero: custom-reward calls scored 0
        if failures:
            state.counts["reward_failures"] += failures
        info["score"] += time.perf_counter() - t
        if cfg.algo == "sft" and not all(r > 0 for g in new for r in g.rewards):
            raise SystemExit(f"--algo=sft: the gold solution of {next(g for g in new if 0 in g.rewards).problem.id} "
                             f"does not score under --reward={cfg.reward}")
        state.counts["train_rollouts"] += sum(len(g.samples) for g in new)
        state.counts["gold_tokens" if cfg.algo == "sft" else "train_tokens"] += sum(
            len(s.response_ids) for g in new for s in g.samples)
        state.counts["rollout_prefill_tokens"] += sum(len(g.samples[g.templates.index(t)].prompt_ids) for g in new
                                                      for t in set(g.templates)) if cfg.algo != "sft" else 0
        for g in new:
            if cfg.algo == "p2o" and sum(g.rewards) < cfg.tau:
                state.hard_now[g.problem.id] = None
        if not cfg.dynamic_sampling:
            return new, info
        groups += [g for g in new if len(set(g.rewards)) > 1][:need]  # DAPO: keep varied groups
        need = cfg.prompts_per_step - len(groups)
        if need <= 0 or info["refills"] >= cfg.max_refills or stream.epoch_of(state.consumed) > epoch:
            return groups or new, info  # nothing varied at all: an update of zero
        info["refills"] += 1


def shaped_rewards(g):
    """What a group's advantages are formed from: its verified rewards plus its shaping bonus."""
    return list(g.rewards) if g.bonus is None else [r + b for r, b in zip(g.rewards, g.bonus)]


def rollout_features(run, groups):
    """Per group [K, H]: its rollouts' pooled final hidden states (forward.group_hidden_means),
    from the pre-update policy under the ORIGINAL prompt x (templated rollouts too, so that a
    group's rollouts are comparable)."""
    cfg = run.cfg
    x = {g.problem.id: encode_prompt(run.tokenizer, problem_messages(g.problem, fmt=cfg.prompt_format), run.chat_kwargs)
         for g in groups}
    run.state.counts["nograd_tokens"] += sum(len(x[g.problem.id]) + len(s.response_ids) for g in groups for s in g.samples)
    with autocast(cfg, next(run.policy.parameters()).device):
        return group_hidden_means(run.policy, groups, lambda g: x[g.problem.id], run.pad_id, cfg.micro_batch_size,
                                  cfg.shared_prompt)


def make_shapers(cfg, policy):
    """This run's reward shapers, in the order shaping.apply_shapers calls them (shaping.py): CLIPO
    (--clipo_weight > 0) and our agreement bonus (--agreement_bonus > 0). A method appends its own."""
    shapers = []
    if cfg.clipo_weight > 0:
        shapers.append(shaping.Clipo(policy.config.hidden_size, cfg.clipo_dim, cfg.clipo_tau, cfg.clipo_weight,
                                     cfg.clipo_cap, cfg.clipo_lr, cfg.clipo_weight_decay,
                                     released=cfg.clipo_loss == "released", seed=cfg.seed))
    if cfg.agreement_bonus > 0:
        shapers.append(functools.partial(shaping.agreement, weight=cfg.agreement_bonus, cap=cfg.agreement_cap,
                                         n=cfg.agreement_ngram))
    return shapers


def training_rows(groups, cfg, tokenizer, chat_kwargs=None):
    """Rows of every rollout: advantages normalised inside each group (templated or not); a
    templated rollout is trained under the ORIGINAL prompt x with its response ids unchanged
    (context distillation) and keeps x~ for its CRM weights. Under torchrun, the rows of this
    rank's whole groups (dist.split: groups rank, rank + world, ...), tagged with their
    index among all the step's groups."""
    rewards = torch.tensor([shaped_rewards(g) for g in groups], dtype=torch.float32)  # [G, K]
    adv = grpo.group_advantages(rewards, "raw" if cfg.algo == "sft" else cfg.adv_norm)  # [G, K]
    rows = []
    for gi, (g, group_adv) in enumerate(zip(groups, adv.tolist())):
        if gi % dist.world() != dist.rank():
            continue
        distilled = any(g.templates) and cfg.context_distill
        plain_ids = encode_prompt(tokenizer, problem_messages(g.problem, fmt=cfg.prompt_format), chat_kwargs) \
            if distilled else None
        for s, t, a, r in zip(g.samples, g.templates, group_adv, g.rewards):
            if t and cfg.drop_failed_templated and r <= 0:
                continue  # it still counted in the group's advantages above
            if t and distilled:
                prompt_ids, response_ids = distill.distill_row(plain_ids, s)
                tilde = s.prompt_ids if cfg.crm or cfg.fix_importance_ratio else None
                rows.append(Row(prompt_ids, response_ids, a, tilde, group=gi, reward=r, problem_id=g.problem.id))
            else:  # plain rows, and (ablation) templated rows trained under x~
                rows.append(Row(s.prompt_ids, s.response_ids, a, sampler_logp=s.logprobs, group=gi, reward=r,
                                problem_id=g.problem.id))
    return rows


def auxiliary_rows(run, groups, step):
    """Rows a method adds to the step besides the rollouts, with a Row.kind of its own that only
    its AuxTerm (aux_terms) reads; GRPO's term, denominators and entropy never see them. A row
    of a group (group=gi) joins that group's mini-batch; a row of none (group=None) is dealt to
    the mini-batches in turn. Under torchrun return this rank's share (a group's rows where
    gi % world == rank, as training_rows). `step`: the step's number in metrics.jsonl. None
    ship: docs/METHOD.md §10 adds a method here in a few lines."""
    return []


def token_advantages(run, groups, rows, step):
    """A method's per-token advantage term: {index in rows: one value per response token}, added
    to the row's A token by token (Row.token_advantage): it goes through PPO-clip, the CRM weights
    and TIS as A does, and a rollout whose A is 0 is forwarded when its term is not. The rows
    carry their verified reward and problem id, and each method Pass's values (data[name]).
    `step`: as auxiliary_rows'. None ship: docs/METHOD.md §10."""
    return {}


def with_token_advantages(rows, terms):
    """The rows with {index: per-token values} (token_advantages) on copies; a length that is not
    the response's, or a term on a row that is not a rollout, is an error naming the row."""
    rows = list(rows)
    for i, values in terms.items():
        r = rows[i]
        if r.kind != ROLLOUT or len(values) != len(r.response_ids):
            raise ValueError(f"token_advantages: row {i} ({r.kind}, problem {r.problem_id}) has "
                             f"{len(r.response_ids)} response tokens; got {len(values)} values"
                             + ("" if r.kind == ROLLOUT else " for a row that is not a rollout"))
        rows[i] = dataclasses.replace(r, token_advantage=[float(v) for v in values])
    return rows


def run_passes(run, rows, step_passes):
    """Each method Pass (one with a `run`) over the rows it reads, its values on copies of them."""
    for p in step_passes:
        if p.run is None:
            continue
        read = [i for i, r in enumerate(rows) if p.reads(r)]
        values = p.run(run, [rows[i] for i in read])
        if len(values) != len(read):
            raise ValueError(f"pass {p.name!r} returned {len(values)} values for {len(read)} rows")
        rows = list(rows)
        for i, v in zip(read, values):
            rows[i] = with_data(rows[i], **{p.name: v})
    return rows


def pre_update_pass(rows, policy, reference, cfg, pad_id, terms=()):
    """Rows -> right-padded micro-batches (grpo.micro_chunks, each of one temperature: row_temperature)
    holding what the loss needs besides the training forward: the rows' advantages (A plus the
    per-token term), CRM weights and engine log-probs laid out on the batch, and from no-grad
    forwards with the pre-update weights, old log-probs (only when a later optimizer step of this
    call needs them) and the frozen reference's (kl_beta > 0)."""
    kinds = {k: row_temperature(k, terms, cfg) for k in dict.fromkeys([ROLLOUT] + [r.kind for r in rows])}
    chunks = [(c, temp) for temp in dict.fromkeys(kinds.values())
              for c in grpo.micro_chunks([r for r in rows if kinds[r.kind] == temp], cfg.micro_batch_size,
                                         cfg.shared_prompt)]
    batches, device = [], next(policy.parameters()).device
    with torch.no_grad(), autocast(cfg, device):
        for i in range(dist.all_max(len(chunks))):  # FSDP lock-step: as many micro-batches on every rank
            chunk, temp = chunks[i] if i < len(chunks) else ([Row([pad_id], [pad_id], 0.0)], cfg.temperature)  # a stand-in, weight 0
            prompts, responses = [r.prompt_ids for r in chunk], [r.response_ids for r in chunk]
            ids, attention, response_mask = (t.to(device) for t in grpo.make_batch(prompts, responses, pad_id))
            mask = response_mask[:, 1:]  # [B, L-1]
            advantages = grpo.scatter_rows([r.token_advantage for r in chunk], mask)[0] + torch.tensor(
                [[r.advantage] for r in chunk], device=device)
            b = MicroBatch(ids, attention, mask, advantages, *grpo.scatter_rows([r.sampler_logp for r in chunk], mask),
                           temperature=temp, dummy=i >= len(chunks), rows=chunk)
            if any(r.crm_weight is not None for r in chunk):
                b.crm_weight = grpo.scatter_rows([r.crm_weight for r in chunk], mask, fill=1.0)[0]
            if any(r.tilde_old_logp is not None for r in chunk):
                b.tilde_old = grpo.scatter_rows([r.tilde_old_logp for r in chunk], mask)
            if cfg.shared_prompt:
                b.packed = grpo.pack_rows(prompts, responses, pad_id).to(device)
            if cfg.ppo_epochs > 1 or cfg.mini_batches > 1:
                b.old_logp = response_logprobs(policy, ids, attention, mask, temp, packed=b.packed,
                                               chunk=cfg.head_chunk)[0]
            if reference is not None:  # LoRA: the policy itself with its adapters off
                with lora.adapters_off(reference):
                    b.ref_logp = response_logprobs(reference, ids, attention, mask, temp, packed=b.packed,
                                                   chunk=cfg.head_chunk)[0]
            batches.append(b)
    return batches


def micro_batch_loss(policy, b, cfg, part, terms, with_entropy, coefs=None):
    """The training forward of one micro-batch and its share of the step loss: GRPO's policy
    term (grpo.policy_loss) on the rollout rows over the mini-batch's rollout denominators, plus
    each AuxTerm on its own rows over its own denominators (`part`: a Part), weighted by
    coefs[name] (default: AuxTerm.coefficient(1))."""
    with autocast(cfg, b.input_ids.device):
        logp, ent = response_logprobs(policy, b.input_ids, b.attention, b.loss_mask, b.temperature, with_entropy,
                                      b.packed, cfg.head_chunk)
    old_logp = b.old_logp
    if b.tilde_old is not None:  # fix_importance_ratio: a templated row's old policy is pi_old(y|x~)
        old_logp = torch.where(b.tilde_old[1], b.tilde_old[0], logp.detach() if old_logp is None else old_logp)
    rollout = b.loss_mask & b.of_kind(ROLLOUT)  # [B, L-1]
    loss, sums = grpo.policy_loss(
        logp, old_logp, b.advantages, rollout, part.denominators, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
        dual_clip=cfg.dual_clip, loss_agg=cfg.loss_agg, max_len=cfg.max_tokens, crm_weight=b.crm_weight,
        sampler_logp=b.sampler_logp, sampler_mask=b.sampler_mask & rollout, objective=cfg.policy_loss,
        correction=grpo.parse_correction(cfg.sampler_correction, cfg.tis_cap))
    sums = Counter(sums, loss_policy=loss.item())
    for term in terms:
        if b.dummy or not b.of_kind(term.kind).any():  # none of its rows here (their share would be 0)
            sums.update({f"loss_{term.name}": 0.0, f"{term.name}_sum": 0.0})
            continue
        mask, d = (b.loss_mask & b.of_kind(term.kind)).to(logp.dtype), part.aux[term.kind]
        token_loss = term.token_loss(logp, b)  # [B, L-1]
        coef = coefs[term.name] if coefs else term.coefficient(1)
        value = coef * grpo.aggregate(token_loss, mask, cfg.loss_agg, d.tokens, d.rows, cfg.max_tokens)
        loss = loss + value
        sums.update({f"loss_{term.name}": value.item(), f"{term.name}_sum": (token_loss.detach() * mask).sum().item()})
    if ent is not None:  # the policy's entropy on the rollouts' tokens (ent follows loss_mask's order)
        ent = ent[rollout[b.loss_mask]]
        sums.update(entropy_sum=ent.sum().item(), entropy_tokens=ent.numel())
    if b.dummy:  # torchrun: a stand-in that keeps the ranks' forwards and backwards in step
        return loss * 0.0, {"mismatch_abs_max": 0.0}
    return loss, sums


@dataclass
class Part:
    """One optimizer step's rows (a mini-batch of whole groups), ready for the update."""
    batches: list  # MicroBatch of the forwarded rows (`forwarded`)
    denominators: grpo.Denominators  # the rollout rows' (GRPO's policy term)
    aux: dict  # row kind -> grpo.Denominators of that kind's rows (each AuxTerm's own)
    trained: int  # rows forwarded


@dataclass
class Update:
    """What one policy update did."""
    finite: bool  # False: skipped, no trace left in the weights or the optimizer
    loss: float  # loss of an optimizer step, mean over the call's steps (PPO epochs x mini-batches)
    grad_norm: float  # before clipping, last optimizer step
    trained_rows: int  # rows forwarded (`forwarded`)
    sums: Counter  # clipped_tokens, loss_policy / loss_<term> / <term>_sum, entropy_sum / entropy_tokens (first epoch), crm_*


def prepare_mini_batches(policy, reference, rows, cfg, *, pad_id, n_groups, terms):
    """The call's mini-batches (grpo.mini_batch_rows), each a Part, and the CRM sums. The CRM pass covers
    every templated rollout of a mini-batch, also those of groups that are not forwarded
    (all-zero advantages): the kept denominator and the logged masked fraction count them. Its
    weights and x~ log-probs go on copies of the rows. Every sum is global (dist.all_sum). Only
    rows of kind ROLLOUT count in GRPO's denominators."""
    parts, sums = [], Counter()
    old_logprobs = functools.partial(row_logprobs, policy, pad_id=pad_id, temperature=cfg.temperature,
                                     shared=cfg.shared_prompt, chunk=cfg.head_chunk)
    loose = dist.gather_objects(sum(r.group is None for r in rows))  # rows of no group, on each rank
    for part in grpo.mini_batch_rows(rows, n_groups, cfg.mini_batches, first=sum(loose[:dist.rank()])):
        at = [i for i, r in enumerate(part) if r.kind == ROLLOUT]
        rollouts = [part[i] for i in at]
        with torch.no_grad(), autocast(cfg, next(policy.parameters()).device):
            plain, tilde = two_context_logprobs(old_logprobs, [r.prompt_ids for r in rollouts],
                                                [r.tilde_prompt_ids for r in rollouts],
                                                [r.response_ids for r in rollouts], cfg.micro_batch_size)
        weights, crm = distill.crm_rows(plain, tilde, cfg.crm_low, cfg.crm_high, cfg.crm_soft)
        if not cfg.crm:  # the pass ran for fix_importance_ratio's old log-probs alone
            weights, crm = [None] * len(rollouts), distill.CrmSums()
        for i, w, old in zip(at, weights, tilde):
            part[i] = dataclasses.replace(part[i], crm_weight=w, tilde_old_logp=old if cfg.fix_importance_ratio else None)
        trained = [r for r in part if forwarded(r, terms)]
        denominators = grpo.step_denominators(
            dist.all_sum(sum(len(r.response_ids) for r in rollouts)), dist.all_sum(len(rollouts)),
            dist.all_sum(crm.templated_tokens), dist.all_sum(crm.weight_sum), cfg.crm_denominator)
        aux = {}
        for kind in dict.fromkeys(t.kind for t in terms):
            of_kind = [r for r in part if r.kind == kind]
            tokens, n = dist.all_sum(sum(len(r.response_ids) for r in of_kind)), dist.all_sum(len(of_kind))
            aux[kind] = grpo.Denominators(max(tokens, 1), max(n, 1), max(tokens, 1))  # none of its rows: a term of 0
        parts.append(Part(pre_update_pass(trained, policy, reference, cfg, pad_id, terms), denominators, aux,
                          len(trained)))
        sums.update({f"crm_{k}": v for k, v in fields_of(crm).items()})
    return parts, sums


def policy_update(policy, reference, optimizer, rows, cfg, *, pad_id, n_groups=None, terms=None, step=1):
    """ppo_epochs passes over the step's rows; each pass takes one AdamW step per mini-batch of
    whole groups (mini_batches; default 1: one step on all rows). Each optimizer step's loss is
    token-mean over ITS whole mini-batch, whatever the micro-batch split; after the first step
    the PPO ratio is taken against the log-probs stored before the update. A non-finite loss or
    gradient in any step restores the weights and optimizer state of before the call.
    terms: the AuxTerms (default aux_terms(cfg)), weighted at `step` (AuxTerm.coefficient).

    Under torchrun `rows` are this rank's share and n_groups counts the step's groups on all
    ranks. The denominators (tokens, rows, CRM weight mass) are global sums, so each rank's
    loss is its share of the single-process loss and the summed gradients (dist.shard) are the
    single-process gradient; the finiteness decision and the logged sums are global too."""
    n_groups = n_groups or max((r.group for r in rows if r.group is not None), default=0) + 1
    terms = aux_terms(cfg) if terms is None else terms
    coefs = {t.name: t.coefficient(step) for t in terms}
    if len(coefs) < len(terms) or "policy" in coefs:
        raise ValueError(f"AuxTerm names {[t.name for t in terms]}: each once, and not 'policy' (loss_policy is GRPO's)")
    parts, sums = prepare_mini_batches(policy, reference, rows, cfg, pad_id=pad_id, n_groups=n_groups, terms=terms)
    snapshot = dist.cpu_snapshot(policy, optimizer) if cfg.ppo_epochs * len(parts) > 1 else None
    losses, grad_norm, n_trained = [], 0.0, dist.all_sum(sum(p.trained for p in parts))
    device = next(policy.parameters()).device
    for epoch in range(cfg.ppo_epochs):
        for part in parts:
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            # one autocast region for all micro-batches: each weight is cast to bf16 once a step, not
            # once a micro-batch. Not under FSDP, where that cache would hold every layer's gathered weights
            with autocast(cfg, device) if not dist.active() else contextlib.nullcontext():
                for b in part.batches:
                    loss, s = micro_batch_loss(policy, b, cfg, part, terms, epoch == 0, coefs)
                    loss.backward()
                    loss_sum += loss.item()
                    sums["mismatch_abs_max"] = max(sums["mismatch_abs_max"], s.pop("mismatch_abs_max"))
                    sums.update(s)
            grad_norm = dist.clip_grad_norm(policy, cfg.grad_clip) if part.batches else 0.0  # global norm
            loss_sum = dist.all_sum(loss_sum)
            losses.append(loss_sum)
            if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                if snapshot is not None:  # undo this call's earlier optimizer steps
                    dist.restore_snapshot(policy, optimizer, snapshot)
                return Update(False, loss_sum, grad_norm, n_trained, update_sums(sums, len(losses)))
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # the gradients (fp32, a model's worth) are not held through the push
    return Update(True, sum(losses) / len(losses), grad_norm, n_trained, update_sums(sums, len(losses)))


def update_sums(sums, steps):
    """Summed over ranks; each term's loss (loss_*) as the mean over the call's optimizer steps, as Update.loss."""
    sums = dist.sum_counters(sums, ("mismatch_abs_max",))
    return Counter({k: v / steps if k.startswith("loss_") else v for k, v in sums.items()})


# ----------------------------------------------------------------------------- GEPA at an epoch's end


def gepa_round(cfg, epoch, hard_problems, engine, reflector, counts, reward_fn):
    """GEPA on an epoch's hard prompts (rank 0: the search, the archive and the reflector): the
    current policy answers greedily, each call shared over every rank's engine (the other ranks
    are in dist.serve(rollout.greedy_answers(...))); the `reflector` (rollout.py's, or anything with
    reflect(prompts) -> [(text, finished) | None], or such a function) proposes templates.
    Answers and reflection calls are counted in `counts`. Returns gepa.GepaResult."""
    def answer(pairs, kind):
        out = dist.shared_map(greedy_answers(engine, cfg.max_tokens),
                              [problem_messages(item, t, cfg.prompt_format) for t, item in pairs])
        counts[f"{kind}_rollouts"] += len(pairs)
        counts[f"{kind}_tokens"] += sum(n for _, n, _ in out)
        counts[f"{kind}_prefill_tokens"] += sum(n for _, _, n in out)
        return [text for text, _, _ in out]

    def reflect(prompts):
        out = reflect_fn(prompts)
        counts["reflection_calls"] += len(prompts)
        return out

    reflect_fn = getattr(reflector, "reflect", reflector)  # a reflector object, or a function of the prompts

    rng = random.Random(f"gepa/{cfg.seed}/{epoch}")  # independent of the prompt order's seed
    seeds = gepa.read_seed_templates(cfg.seed_templates, cfg.max_template_chars) if cfg.seed_templates else ()
    return gepa.run_gepa(hard_problems, answer, reflect, cfg, rng, reward_fn=reward_fn, seeds=seeds)


def self_ref_weights(run):
    """(policy weights, starting weights) that Self-Ref pushes back / swaps in on rank 0 (a collective
    under FSDP: the gather to rank 0's CPU). Full training: the state dict and None (make_reflector
    loads them); LoRA: lora.weight_streams, merged and adapters off, with no copy in one process;
    none at all for an engine that serves the adapters (it reflects with its base: rollout.AdaptersOff)."""
    if run.cfg.lora_rank and getattr(run.engine, "lora_rank", 0):
        return None, None
    gathered = dist.full_state_dict(run.policy, main_only=True) if dist.active() or not run.cfg.lora_rank else None
    return lora.weight_streams(run.policy, gathered) if run.cfg.lora_rank else (gathered, None)


def end_epoch(run, search=True):
    """The epoch in state.epoch is over (search=False: the run is, and no GEPA round follows).
    P²O: with at least gepa_min_hard hard prompts, GEPA evolves templates for them (rank 0 searches
    and reflects; every rank's engine answers a share of each call) and assigns K of them to each
    for the next epoch; a round is minutes of compute, so it is checkpointed on both sides. Then
    the loop state rank 0 leaves is every rank's, and the next epoch starts collecting hard prompts."""
    cfg, state = run.cfg, run.state
    due = search and cfg.algo == "p2o" and len(state.hard_now) >= cfg.gepa_min_hard
    if due:
        checkpoint(run)
    t = time.perf_counter()
    self_ref = due and run.reflector is None and cfg.reflector == "init"  # the policy goes back after each reflection
    weights, initial = self_ref_weights(run) if self_ref else (None, None)
    if run.is_main and cfg.algo == "p2o":
        with dist.leading():  # the other ranks answer until rank 0's part ends; if it fails, they raise its error
            summary, result = {"epoch": state.epoch, "hard": len(state.hard_now), "ran": False}, None
            if due:
                tqdm.write(f"epoch {state.epoch}: {len(state.hard_now)} hard prompts -> GEPA")
                reflector = run.reflector or make_reflector(cfg, run.engine, run.model_path, weights, state.counts,
                                                            initial)
                result = gepa_round(cfg, state.epoch, [run.by_id[i] for i in state.hard_now], run.engine,
                                    reflector, state.counts, run.reward_fn)
                summary.update(ran=True, seconds=time.perf_counter() - t, **result.summary())
                tqdm.write(f"GEPA: {json.dumps(summary)}")
            run.log.gepa(state.epoch, state.step, len(state.hard_now), result)
            state.assignment = result.assignment if result else {}
            state.gepa_history.append(summary)
    elif cfg.algo == "p2o":
        dist.serve(greedy_answers(run.engine, cfg.max_tokens))  # this rank's share of each of rank 0's answer calls
    state.hard_now, state.epoch = {}, state.epoch + 1
    for key, value in dist.broadcast_object(fields_of(state)).items():  # rank 0's, on every rank
        setattr(state, key, value)
    run.seconds["GEPA"] += time.perf_counter() - t
    if due:
        checkpoint(run)


# ----------------------------------------------------------------------------- the loop


@dataclass
class Run:
    """What start_run() sets up once and every phase of the loop reads: settings, process
    layout, data, models, optimizer, the loop state and (rank 0) the log."""
    cfg: Config
    rank: int
    world: int
    is_main: bool  # rank 0: logs and writes files
    run_dir: str
    train_set: list
    dev_set: list
    by_id: dict  # problem id -> train problem
    stream: PromptStream
    total_steps: int
    model_path: str  # the starting weights (Self-Ref reflector, KL reference)
    chat_kwargs: dict
    policy: object
    reference: object  # frozen initial policy (kl_beta > 0; LoRA: the policy, read with adapters off) or None
    tokenizer: object
    engine: object
    pad_id: int
    optimizer: object
    scheduler: object
    state: LoopState
    log: object  # RunLog on rank 0, None elsewhere
    reward_fn: object  # reward_fn(text, problem) -> float, for rollouts and GEPA's answers alike
    reflector: object = None  # a given reflector (tests: a scripted one); None: make_reflector each GEPA round
    started: float = 0.0  # time.perf_counter() at the start of start_run
    seconds: Counter = field(default_factory=Counter)  # wall time of this process by phase (the summary's line)
    terms: list = field(default_factory=list)  # AuxTerms of the loss (aux_terms)
    shapers: list = field(default_factory=list)  # reward shapers (make_shapers)
    passes: list = field(default_factory=list)  # the step's no-grad passes (passes)
    scalars: dict = field(default_factory=dict)  # a method's own numbers for this step's metrics line (rank 0's)


def start_run(cfg, data, resume_path, saved, engine, reward_fn, reflector, context=None):
    """Join the process group, make the run folder, load the models for `data` (load_data's sets;
    `context`: vLLM's, as check_fit measured it), build the optimizer and put back a checkpoint's
    state (resume_point read it) -> Run."""
    started = time.perf_counter()
    # a day: in a GEPA round the other ranks wait while rank 0 reflects
    rank, world, device = dist.setup(pick_device(cfg.device).type, timeout_minutes=24 * 60)
    is_main = dist.is_main()
    if saved and saved.get("world", 1) != world:
        raise SystemExit(f"{resume_path} was written by {saved.get('world', 1)} processes; resume with as many "
                         f"(now {world}): the optimizer state is sharded by process")
    # packed_attention stays as given (auto: a resume on another device chooses again; load_models asks)
    cfg.shared_prompt, _, reason = packed_layout(cfg, device.type)
    cfg.engine_dtype, cfg.autocast_bf16, note = cpu_precision(cfg, device.type)  # saved so: a resume keeps it
    if is_main and reason:
        print(f"--shared_prompt=False: {reason}")
    if is_main and note:
        print(note)
    cfg.run_name = cfg.run_name or dist.broadcast_object(f"{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    if is_main:
        os.makedirs(run_dir, exist_ok=True)
        print(json.dumps(dataclasses.asdict(cfg), indent=1) + (f"\n{world} processes" if world > 1 else ""))
    if not cfg.verbose:
        dist.barrier()  # rank 0 made the run folder
        route_library_logs(run_dir, rank)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    train_set, dev_set = data
    model_path = resolve_model(cfg.model)
    if device.type == "cuda":  # fp32 master weights: let the fp32 matmuls outside autocast use TF32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    chat_kwargs = chat_template_kwargs(cfg)
    policy, reference, tokenizer, engine = load_models(cfg, model_path, resume_path or model_path, engine, device,
                                                       train_set + dev_set, chat_kwargs, context)
    if device.type == "cuda":  # vLLM left torch one CPU thread (checksums, the CPU snapshot, tokenising)
        torch.set_num_threads(cpu_threads(cfg.cpu_threads))
    trained = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters; the base has no state
    optimizer = torch.optim.AdamW(trained, lr=learning_rate(cfg), betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                                  fused=device.type == "cuda" or None)  # CUDA: no full-size foreach temporary
    if is_main and cfg.lora_rank:
        print(f"{lora.describe(policy)}; lr {learning_rate(cfg):g}")
    warmup = functools.partial(warmup_factor, cfg.warmup_steps, cfg.warmup_from_zero)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)

    state = LoopState()  # all of it is in every checkpoint, so a resumed run continues exactly
    if cfg.fixed_template:  # rejection-sampling distillation's one template, on every prompt from step 1
        fixed = gepa.read_seed_templates(cfg.fixed_template, cfg.max_template_chars)[0]
        state.assignment = {p.id: [fixed] * cfg.group_size for p in train_set}
    shapers = make_shapers(cfg, policy)
    if saved:
        own = load_rank_state(resume_path, rank) if world > 1 else saved
        state = LoopState(**restore_trainer(saved, own, optimizer, scheduler, warmup, cfg))
        for shaper, shaper_state in zip(shapers, saved.get("shapers", [])):  # identical on every rank: saved once
            if shaper_state is not None:
                shaper.load_state_dict(shaper_state)
        if is_main:
            print(f"resuming from {resume_path} at step {state.step}")
    if is_main:
        start_branch(run_dir, state.step if saved else -1, state.epoch, resume_path)  # a fresh run keeps nothing
        if state.best_step >= 0:
            link_checkpoint(run_dir, "best", state.best_step)
    log = RunLog(run_dir, state.step, cfg) if is_main else None
    if is_main and cfg.algo == "p2o" and remote_reflector(cfg) and reflector is None:  # fail now, not at an epoch's end
        print(f"reflector: {make_reflector(cfg, None, None, None, Counter()).model} at {cfg.reflector}")
    dist.barrier()
    stream, terms = PromptStream(train_set, cfg.seed), aux_terms(cfg)
    return Run(cfg=cfg, rank=rank, world=world, is_main=is_main, run_dir=run_dir, train_set=train_set,
               dev_set=dev_set, by_id={p.id: p for p in train_set}, stream=stream,
               total_steps=cfg.max_steps or cfg.epochs * stream.steps_per_epoch(cfg.prompts_per_step),
               model_path=model_path, chat_kwargs=chat_kwargs, policy=policy, reference=reference,
               tokenizer=tokenizer, engine=engine, pad_id=pad_token_id(tokenizer), optimizer=optimizer,
               scheduler=scheduler, state=state, log=log, reward_fn=reward_fn, reflector=reflector, started=started,
               seconds=Counter({"start-up": time.perf_counter() - started}), terms=terms, shapers=shapers,
               passes=passes(cfg, terms))


def train_step(run):
    """One step: collect groups -> training rows -> policy update -> verified push -> metrics."""
    cfg, state, engine = run.cfg, run.state, run.engine
    t0 = time.perf_counter()
    generate = functools.partial(gold_groups, run.tokenizer, run.chat_kwargs) if cfg.algo == "sft" else generate_groups
    groups, info = collect_groups(engine, run.stream, state, cfg, run.reward_fn, generate)
    t = time.perf_counter()
    if hasattr(engine, "sleep"):  # GPU: the trainer gets vLLM's memory until the push (the shapers' forward too)
        engine.sleep()
    shaped = shaping.apply_shapers(run.shapers, groups, functools.partial(rollout_features, run, groups))
    shaped = {**shaped, **shaping_metrics(groups)} if run.shapers else {}
    step = state.step + 1  # this step's number in metrics.jsonl: what a method's hooks and coefficients read
    run.scalars.clear()  # a method's hooks may log numbers of this step here
    rows = training_rows(groups, cfg, run.tokenizer, run.chat_kwargs) + auxiliary_rows(run, groups, step)
    if state.step < cfg.frozen_steps:  # the policy waits (CLIPO: while its head warms up); the lr schedule too
        update = Update(True, float("nan"), 0.0, 0, Counter())
    else:
        rows = run_passes(run, rows, run.passes)  # a method's no-grad passes; their values on copies of the rows
        rows = with_token_advantages(rows, token_advantages(run, groups, rows, step))
        state.counts.update(forward_tokens(rows, cfg, functools.partial(forwarded, terms=run.terms), run.passes))
        update = policy_update(run.policy, run.reference, run.optimizer, rows, cfg, pad_id=run.pad_id,
                               n_groups=len(groups), terms=run.terms, step=step)
    info["train"] = time.perf_counter() - t
    lr = run.optimizer.param_groups[0]["lr"]  # the lr this update used
    state.step += 1
    t = time.perf_counter()
    if update.finite and state.step > cfg.frozen_steps:
        state.bad_steps = 0
        run.scheduler.step()
    if (update.finite and update.trained_rows) or getattr(engine, "sleep_level", 0) == 2:  # level 2 dropped its weights
        lora.push_policy(engine, run.policy)  # the weights, or a LoRA policy's adapters; verified: raises on a mismatch
    if not update.finite:  # a NaN/inf loss or gradient: the update left no trace; count it
        state.bad_steps += 1
        state.skipped_steps += 1
        if run.is_main:
            tqdm.write(f"step {state.step}: non-finite loss/grad (loss {update.loss}, grad {update.grad_norm}); skipped")
    info["push"], info["step"] = time.perf_counter() - t, time.perf_counter() - t0
    m = method_metrics(step_metrics(state, groups, update, info, lr, cfg, run.terms), shaped, run.scalars)
    if m["sampler_stale"] == 1.0 and run.is_main:  # the samples came from the engine after the last push
        tqdm.write(f"step {state.step}: WARNING the engine's log-probs are {m['sampler_mismatch_mean']:.3g} nats/token "
                   f"from the trainer's (bound {sampler_mismatch_bound(cfg):.3g}): it may not hold the pushed policy")
    for phase in ("generate", "score", "train", "push"):
        run.seconds[phase] += info[phase]
    if run.is_main:
        run.log.step(m, groups)
    return m, info


def epoch_over(run):
    return run.stream.epoch_of(run.state.consumed) > run.state.epoch


def closing_dev_eval(run):
    """The dev records of the run (rank 0; [] elsewhere), the last step's evaluated if it was not yet."""
    records = run.log.dev_records() if run.is_main else []
    if run.dev_set and dist.broadcast_object(not (records and records[-1]["step"] == run.state.step)):
        dev_eval(run)
        records = run.log.dev_records() if run.is_main else []
    return records


def save_done(run, done, error):
    """A user's reward stopped the run (--reward_errors=stop): the last completed step's checkpoint, its path in
    error.checkpoint (else None; error.latest: the run's last checkpoint, if any). Rewards are called before a step's
    update (rollouts, GEPA, the dev set), so the policy is still that of `done` whenever the step count has not
    moved; the step in flight is dropped. Under torchrun the failing rank alone is here (a checkpoint is
    collective): nothing is saved, and the last saved checkpoint stands."""
    error.checkpoint = None
    if not dist.active() and run.state.step == done.step > 0:
        run.state = done
        error.checkpoint = checkpoint(run)
    latest = pointer_target(run.run_dir, "latest")
    error.latest = os.path.join(run.run_dir, latest) if latest else None


def train(cfg, engine=None, reward_fn=None, reflector=None, given=None):
    """Run P²O (or GRPO with algo=grpo) with `cfg`; with cfg.resume, from a checkpoint whose
    saved settings apply except those in `given` (default: the fields of cfg that differ from
    Config's; see resume_point). For tests and forks: `engine` (a rollout engine holding cfg.model's
    weights), `reward_fn(text, problem) -> float` for the rollouts and GEPA (default: --reward's;
    the dev set is scored by --reward), `reflector` (reflect(prompts) -> [(text, finished) | None]).

    Under torchrun the same loop runs on N processes: the policy is sharded (FSDP2), each rank
    generates its share of a step's prompts with its own engine, every rank then holds all groups
    (mining, DAPO refills and accounting agree everywhere), trains on its share with global loss
    denominators and pushes the gathered weights into its engine. Rank 0 alone runs GEPA, logs
    and writes files; the loop state it leaves is broadcast to the others."""
    cfg, resume_path, saved = resume_point(cfg, given)  # each check is one line, before anything heavy loads:
    check_config(cfg)  # the settings,
    check_models(cfg)  # the model and reflector (no download),
    data = load_data(cfg)  # every data row, and below the reward on the first gold answer
    check_run_folder(cfg, resume_path)  # --out_dir writable; a run's name reused only by --resume
    context = check_fit(cfg, data[0] + data[1], chat_template_kwargs(cfg))  # LoRA targets; the context, measured once
    check_fn = reward_scorer(cfg, data[0])  # --reward: one scorer for rollouts, GEPA, the dev set (and eval.py)
    reward_fn = reward_fn or (lambda text, problem: check_fn(text, problem).reward)
    run = start_run(cfg, data, resume_path, saved, engine, reward_fn, reflector, context)
    state, is_main, stop = run.state, run.is_main, StopSignal()
    if is_main:
        print(loss_note(cfg, run.terms))
    if state.step == 0:
        dev_eval(run)
    by_tokens = cfg.max_gen_tokens > 0  # a token budget ends the run: count tokens, so the ETA means something
    bar = tqdm(total=cfg.max_gen_tokens if by_tokens else run.total_steps, unit="tok" if by_tokens else "step",
               initial=generated_tokens(state.counts) if by_tokens else state.step, desc=cfg.algo,
               dynamic_ncols=True, disable=not is_main)
    records, done = [], copy.deepcopy(state)  # done: the loop state of the last completed step
    try:
        while state.step < run.total_steps and not budget_spent(state, cfg) \
                and not dist.all_max(int(stop.signal is not None)):
            if epoch_over(run):
                end_epoch(run)
            m, info = train_step(run)
            done = copy.deepcopy(state)
            bar.update(generated_tokens(state.counts) - bar.n if by_tokens else 1)
            if is_main:
                tqdm.write(console_line(m, run.total_steps, run.terms))
            if state.bad_steps >= cfg.max_bad_steps:
                raise RuntimeError(f"{state.bad_steps} consecutive non-finite steps; stopped after saving "
                                   f"{checkpoint(run)}")
            if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < run.total_steps:
                dev_eval(run)
            if cfg.save_every and state.step % cfg.save_every == 0:
                checkpoint(run)
            if cfg.export_every and state.step % cfg.export_every == 0:
                export(run)
        if state.step >= run.total_steps and epoch_over(run):
            end_epoch(run, search=False)  # the last epoch's hard set, recorded; no GEPA round after the run
        final_path = checkpoint(run)
        if cfg.export_every and state.step % cfg.export_every:  # the last step's weights, for evaluation
            export(run)
        if dist.all_max(int(stop.signal is not None)):  # every rank takes the same branch
            if is_main:
                print(f"stopped by signal {stop.signal}; checkpoint {final_path}")
            return {"step": state.step, "checkpoint": final_path, "interrupted": True,
                    "signal": stop.signal or signal.SIGTERM}  # a rank another rank's signal stopped
        records = closing_dev_eval(run)
    except BaseException as e:
        if isinstance(e, (RewardError, ScoringError)):  # a user's reward stopped the run (--reward_errors=stop)
            save_done(run, done, e)
        dist.share_failure(e)  # the other ranks' errors name this one, or this rank's names an earlier one's
        raise
    finally:
        bar.close()
        if dist.active() and hasattr(run.engine, "close"):  # vLLM's subgroups go before the group itself
            run.engine.close()
        dist.teardown()  # before the log's upload: a rank that failed leaves the group, and the others learn at once
        if run.log:
            run.log.close()
        stop.restore()  # last: torchrun's SIGTERM, sent when another rank exits, must not cut this rank's cleanup short
    if is_main:
        print_summary(run.run_dir, state.counts, generated_tokens(state.counts), state.gepa_history, records,
                      len(run.dev_set))
        print(time_summary(run.seconds, time.perf_counter() - run.started))
    return {"step": state.step, "checkpoint": final_path, "policy": run.policy, "counts": state.counts,
            "gepa_history": state.gepa_history, "dev": records, "state": state, "shapers": run.shapers}


def main(argv):
    threading.excepthook = quiet_disk_errors
    if {"-h", "--help"} & set(argv):
        print(config_help(Config))
        return
    cfg, given, dry_run = resolve_settings(Config(), argv)  # on resume, the file's and the flags' settings win
    if dry_run:
        dry_run_report(resume_point(cfg, given)[0])
        return
    try:
        out = train(cfg, given=given)
    except (RewardError, ScoringError) as e:  # the user's reward is untrusted code: one line naming the problem
        saved = f"the last completed step saved in {e.checkpoint}" if getattr(e, "checkpoint", None) \
            else f"its last checkpoint {e.latest} stands" if getattr(e, "latest", None) else "no checkpoint yet"
        sys.exit(f"{e}; the run stopped ({saved}; --reward_errors=zero scores such calls 0)")
    except OSError as e:  # a full disk, a quota, a folder made read-only mid-run: every file is written atomically
        if e.errno not in DISK_ERRORS:
            raise
        name = os.fsdecode(e.filename) if e.filename else "a run file"
        sys.exit(f"cannot write {name}: {e.strerror}; the run stopped, its last checkpoint stands")
    if out.get("interrupted"):  # saved, but not complete: a scheduler or `train && eval` must not see success
        sys.exit(128 + out["signal"])  # as a shell reports a signal's end (docs/TRAINING.md, "Exit status")


if __name__ == "__main__":
    main(sys.argv[1:])
