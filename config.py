"""train.py's settings: the command line, --help, and every value checked before anything loads.

`Config` (below) holds the settings of train.py; here they are also read, described and
checked, and turned into what the run needs (device, chat-template arguments, precision):

    cfg = parse_overrides(Config(), ["--lr=1e-6", "--group_size", "12", "--crm"])   # types checked
    check_config(cfg)             # SystemExit naming the flag: "--adv_norm is one of 'group' | 'none', got 'z'"
    print(config_help(Config))    # python train.py --help

Every mistake in a value is one line before anything loads; a misspelt setting names the
nearest ones ("unknown setting --group_sise; did you mean --group_size?"). This module sits
below the models, the engines and a run's files and imports none of them: the checks that need
a model (model.check_models), the data (data.load_data) or a checkpoint (runs.resume_point)
are made where the run starts (train.train), still before anything heavy loads.
"""

import dataclasses
from dataclasses import dataclass
import difflib
import inspect
import json
import math
import os

import torch

import gepa
import grpo
from prompts import FORMATS
from verify import REWARD_ERRORS, load_reward


@dataclass
class Config:
    """Every setting of a run (train.py's). A new one is a field with a default and an inline
    comment: the comment is its --help line (config_help; a field without one fails the --help
    test), and a line `# ---- heading` starts a --help section. A bound or a set of allowed
    values goes in the tables below the class (CHOICES, AT_LEAST, ...), checked by check_config."""
    # ---- model and data
    model: str = "smollm2-135m"  # HF id, local folder, or the shipped default (model.py)
    train_data: str = "builtin-train"  # data name or .jsonl path (data/__init__.py)
    dev_data: str = "builtin-dev"  # periodic evaluation set ('' = none)
    chat_template_kwargs: str = ""  # JSON for the chat template, e.g. '{"enable_thinking": false}' (Qwen3 non-thinking)
    device: str = "auto"  # training device: auto (cuda when available, else cpu) | cpu | cuda
    backend: str = "vllm"  # rollout engine: vllm | hf
    engine_dtype: str = "bfloat16"  # dtype of the rollout engine's weights
    max_model_len: int = 0  # vLLM context (prompt + response tokens); 0: derived from the data (rollout.context_length)
    kv_cache_gib: int = 1  # vLLM-CPU KV cache size in GiB (~23k tokens of the default model per GiB)
    gpu_memory_utilization: float = 0.4  # GPU: share of the GPU vLLM may take; the trainer shares the GPU
    vllm_sleep_level: int = 2  # GPU: while training, 2 = drop vLLM's weights and KV cache (the push refills them), 1 = offload the weights to the host, 0 = off
    enforce_eager: bool = False  # GPU: vLLM without CUDA graphs (starts faster, decodes slower); vLLM-CPU always runs eager
    cpu_threads: int = 0  # GPU: torch CPU threads per process (0 = the cores this process may use / processes on the node); vLLM would leave 1
    algo: str = "p2o"  # p2o | grpo | sft (supervised: each problem's gold solution is its one rollout, A = 1)
    # ---- rollouts
    prompts_per_step: int = 16  # B: prompts per optimizer step (paper 128)
    group_size: int = 6  # K: rollouts per prompt (paper 6; the 2K baseline is 12)
    temperature: float = 0.6  # sampling temperature, also used for training log-probs (paper 0.6)
    top_p: float = 1.0  # nucleus sampling for training rollouts and dev samples (1 = off)
    max_tokens: int = 128  # max response tokens (paper 12,288); also L_max of Dr. GRPO
    dynamic_sampling: bool = False  # DAPO: drop all-equal groups, refill with more prompts
    max_refills: int = 3  # bound on DAPO refill rounds per step
    # ---- loss (grpo.py)
    adv_norm: str = "group"  # group: (r - mean) / (std + 1e-6) | none: r - mean (Dr. GRPO) | raw: r (no baseline)
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    policy_loss: str = "ppo"  # ppo (GRPO/DAPO token PPO-clip) | gspo | gspo_token | cispo (docs/METHOD.md §3)
    eps_low: float = 0.2  # clip below 1: 1 - eps_low (<= 1; CISPO's 1 = no lower bound)
    eps_high: float = 0.2  # clip above 1 (0.28 = DAPO clip-higher; GSPO 4e-4)
    dual_clip: float = 0.0  # 0 = off; c > 1 caps the loss of A < 0 tokens at -A c (3 is usual); ppo only
    kl_beta: float = 0.0  # k3 KL weight to the frozen initial policy (0 as in P²O, DAPO, Dr. GRPO)
    ppo_epochs: int = 1  # passes over each rollout batch (1: the ratio is 1, see grpo.py)
    mini_batches: int = 1  # optimizer steps per pass, each on 1/n of the groups (paper: 128 prompts, mini-batches of 64 -> 2)
    tis_cap: float = 0.0  # truncated importance sampling vs the rollout engine: tokens x min(pi_old/pi_sampler, C); 0 = off
    sampler_correction: str = ""  # engine mismatch: token_tis:C | token_mask:lo,hi | icepop:lo,hi | seq_tis:C | seq_mask:lo,hi | geo_mask:lo,hi
    # ---- P²O: hard-prompt mining, GEPA (gepa.py), context distillation and CRM (distill.py)
    tau: int = 2  # a prompt with fewer than tau successes among its K rollouts is hard (paper 2)
    gepa_min_hard: int = 20  # GEPA runs at an epoch's end only with this many hard prompts (paper 100 on 5K)
    gepa_budget: int = 200  # metric calls per GEPA round, a hard cap (one = one (template, problem) answer)
    gepa_dev_max: int = 300  # hard prompts used as GEPA dev items, at most (paper 300; also capped by the budget)
    gepa_parents: int = 4  # W: parents per GEPA iteration (paper 16)
    gepa_minibatch: int = 3  # b: train items per reflection (paper 3)
    gepa_max_iterations: int = 50  # safety bound on GEPA iterations besides the budget
    max_template_chars: int = 300  # guard: longer templates are rejected (they derail a small model)
    template_max_growth: float = 1.5  # guard: a child may be at most this times longer than a non-empty parent
    guard_copy_words: int = 8  # guard: this many consecutive words of a minibatch problem (or all of a shorter one) = a copy
    reflect_answer_chars: int = 300  # the policy's answer is cut to this many characters in a reflection record
    reflector: str = "init"  # init: frozen starting policy (Self-Ref) | policy | a model path/id or an http(s)://HOST:PORT/v1 OpenAI-compatible server (Teacher-Ref)
    reflector_model: str = ""  # model name at a reflector server ('' = the first it serves)
    reflector_api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the server's API key (never logged)
    reflector_timeout: float = 60.0  # seconds per reflection request to a server
    reflector_retries: int = 3  # retries of a failed request (backoff 1, 2, 4 s); then it is counted and skipped
    reflector_backend: str = "hf"  # engine for a reflector given as a path (a 2nd in-process vLLM is not supported)
    reflect_temperature: float = 0.8  # sampling temperature of the reflector (a new template)
    reflect_max_tokens: int = 120  # a template is at most max_template_chars (~75 tokens)
    reflect_top_p: float = 1.0  # the reflector's nucleus sampling (the official preset: 0.95, Qwen3's generation_config)
    reflect_top_k: int = 0  # the reflector's top-k (0 = off; the official preset: 20, Qwen3's generation_config)
    reflect_chat_template_kwargs: str = ""  # JSON for the reflector's chat template ('' = the engine's own; nothing sent to a server), e.g. '{"enable_thinking": true}'
    same_template_per_group: bool = False  # ablation: one template for all K rollouts of a prompt
    seed_templates: str = ""  # Human-Ref: a file of templates (one per line) that join the empty one in GEPA's starting pool
    fixed_template: str = ""  # algo=grpo: a templates file whose first line templates every rollout from step 1 (no GEPA)
    context_distill: bool = True  # False (ablation): train templated rollouts under x~, not x
    crm: bool = True  # Context Ratio Mask on templated rows (False: ablation; the reference's replace_prompts_when_log_prob)
    crm_low: float = 0.01  # tokens with c_t < crm_low are masked
    crm_high: float = 10.0  # tokens with c_t > crm_high are masked
    crm_soft: bool = False  # scale out-of-band tokens by high/c_t (above) or c_t/low (below) instead of zeroing
    # ---- reference-code parity (zlkqz/P2O; our defaults and the reasons: docs/METHOD.md)
    prompt_format: str = "default"  # default: problem + boxed instruction (+ few-shot for built-in rows) | official: the P²O code's
    dev_holdout: int = 0  # > 0: hold this many train problems out (seeded) as the dev set instead (official code: 500)
    gepa_auto: str = ""  # official budget preset light|medium|heavy|heavy_2|heavy_3|heavy_4|heavy_16, sized by the round's dev set ('' = gepa_budget)
    bare_rollout: bool = False  # one of a templated prompt's K rollouts without a template (official left_1_no_template_rollout)
    drop_failed_templated: bool = False  # failed templated rollouts leave the loss, not the advantages (official drop_failed_template_rollout)
    crm_denominator: str = "all"  # all: masked tokens still count in token-mean (reference) | kept: sum of CRM weights
    fix_importance_ratio: bool = False  # templated rows: pi_old under x~, so rho = pi(y|x) / pi_old(y|x~), PPO-clipped (official fix_importance_ratio)
    reward: str = "ours"  # ours: the final \boxed{} equals the answer | official: exactly one \boxed, numbers within 1e-4 | module:function or file.py:function, any (response, problem) -> float (verify.load_reward)
    reward_timeout: float = 60.0  # seconds a custom --reward may take on one response (0 = no bound); then it has failed
    reward_errors: str = "stop"  # a custom --reward that raises, times out or returns no number: stop (naming the problem) | zero (score 0, counted: reward_failures)
    reflect_prompt: str = "ours"  # ours: a short general instruction | official: GEPA's proposal prompt, asks for domain facts (gepa.py)
    reflect_guards: bool = True  # reject leaking, copying, long, repetitive or duplicate templates (official: none)
    gepa_selection: str = "ours"  # parents: ours (fronts of solved items, pruned, with replacement) | official (zero ties, distinct)
    gepa_accounting: str = "ours"  # ours: every metric call counts, a hard cap | official: iterations 0-1 and child minibatches free
    warmup_from_zero: bool = False  # warm-up's first step at lr 0, then lr s/warmup (verl) instead of lr (s+1)/warmup
    # ---- reward shaping (shaping.py): bonuses added to the verified reward where advantages are formed only
    clipo_weight: float = 0.0  # CLIPO: a correct rollout's bonus max(-w * its InfoNCE loss, -clipo_cap) (0 = off; release 0.2)
    clipo_cap: float = 0.5  # CLIPO: the largest penalty (release 0.5)
    clipo_dim: int = 512  # CLIPO head's output dims (release: 512 GSM8K, 2048 MATH)
    clipo_tau: float = 0.05  # CLIPO InfoNCE temperature (release 0.05)
    clipo_lr: float = 1e-3  # CLIPO head's AdamW lr (release 1e-3; only the head trains on its loss)
    clipo_weight_decay: float = 0.01  # CLIPO head's AdamW weight decay (release 0.01)
    clipo_loss: str = "released"  # released: with the row-max shift and the 1e-8 inside the log | textbook InfoNCE
    frozen_steps: int = 0  # the first N steps update no policy weight (rollouts, shapers, logs run): CLIPO's head warm-up
    agreement_bonus: float = 0.0  # ours: a correct rollout's bonus w * its mean n-gram Jaccard to the other correct (0 = off)
    agreement_cap: float = 0.1  # the agreement bonus's largest value
    agreement_ngram: int = 3  # n of the agreement bonus's token n-grams
    # ---- optimisation
    lr: float = 2e-5  # paper 1e-6 for Qwen3-4B; the 135M default needs a larger step
    warmup_steps: int = 2  # linear warm-up, then constant (paper: 5% warm-up)
    adam_beta1: float = 0.9  # AdamW betas (torch defaults, as verl's)
    adam_beta2: float = 0.999  # AdamW second-moment decay
    adam_eps: float = 1e-8  # AdamW denominator epsilon
    weight_decay: float = 0.0  # AdamW decoupled weight decay (verl: 0.01)
    grad_clip: float = 1.0  # max global grad norm
    micro_batch_size: int = 8  # rows per forward/backward; the loss is still per whole step
    shared_prompt: bool = True  # forward a prompt once for all rows that share it (grpo.pack_rows; exact)
    packed_attention: str = "auto"  # shared_prompt's mask: flex (FlexAttention block mask; CUDA) | dense | auto: flex on CUDA
    head_chunk: int = 1024  # LM-head log-probs this many tokens at a time (grpo.head_logprobs): no [tokens, vocab] logits
    autocast_bf16: bool = True  # bf16 autocast for the training forward (fp32 master weights)
    cpu_fp32_fallback: bool = True  # a CPU without bf16 instructions (no AVX512-BF16/AMX): fp32 engine and forward
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~1/3 more compute
    # ---- LoRA (lora.py): a frozen base in the training dtype, trained fp32 adapters, merged weights pushed
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank instead of every weight (0 = full fine-tuning)
    lora_alpha: int = 32  # adapters scale by lora_alpha / lora_rank (LoRA without regret: 32 at any rank)
    lora_targets: str = "all-linear"  # all-linear: every linear layer of the decoder | a comma list, e.g. q_proj,v_proj
    lora_dropout: float = 0.0  # dropout on the adapters' input, in the training forward only
    lora_lr_scale: float = 10.0  # LoRA trains at lr x this (LoRA without regret: ~10x full fine-tuning's best lr)
    max_bad_steps: int = 3  # consecutive NaN/inf steps before stopping (after saving)
    # ---- schedule and outputs
    epochs: int = 2  # passes over train_data (P²O needs 2: GEPA after epoch 0, templates in epoch 1)
    max_steps: int = 0  # > 0: stop after this many steps instead
    max_gen_tokens: int = 0  # > 0: also stop once this many tokens were generated (rollouts + GEPA answers + reflections)
    eval_every: int = 5  # dev evaluation every N steps (and before and after training)
    eval_k: int = 4  # samples per dev problem for avg@k (greedy is always measured)
    save_every: int = 10  # checkpoint every N steps (and at the end, and on both sides of a GEPA round)
    keep_checkpoints: int = 2  # keep the newest N checkpoints (and best's); 0 = keep all (each holds weights + optimizer state)
    export_every: int = 0  # > 0: every N steps and at the end also write export-NNNNNN/, the model alone in bf16 (for eval.py; kept)
    log_rollouts: int = 4  # groups per step written to rollouts.jsonl
    wandb_project: str = ""  # also log to Weights & Biases under this project ('' = TensorBoard only; WANDB_MODE=offline works)
    seed: int = 0  # prompt order, rollouts, GEPA and dev sampling each derive their own seed from it
    out_dir: str = "runs"  # runs go to out_dir/run_name
    run_name: str = ""  # default: <algo>-<date>-<time>
    resume: str = ""  # a checkpoint folder, or 'auto' = the run's latest
    verbose: bool = False  # True: engine and library logs on the console too (else in <run>/engine.log)


BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}


def split_flags(argv):
    """[--key=value | --key value | --flag] -> [(key, value)], as argparse reads them: a bare
    --flag (followed by nothing or by another --option) is "true"; a value may start with '-'
    (`--lr -1e-6`) but not with '--'."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise SystemExit(f"arguments look like --key=value, --key value or --flag, got {arg!r}")
        if "=" in arg:
            pairs.append(tuple(arg[2:].split("=", 1)))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((arg[2:], argv[i + 1]))
            i += 1
        else:
            pairs.append((arg[2:], None))
        i += 1
    return pairs


def unknown_setting(key, names):
    """The one-line error for a misspelt setting, naming the nearest ones."""
    near = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    near += [n for n in names if len(key) >= 3 and n.startswith(key) and n not in near][:3 - len(near)]
    hint = f"; did you mean {' or '.join(f'--{n}' for n in near)}?" if near else "; see python train.py --help"
    return f"unknown setting --{key}{hint}"


def parse_value(key, kind, value):
    """A flag's text (None: a bare --flag) as a setting of type `kind`."""
    if value is None and kind is not bool:
        raise SystemExit(f"--{key} needs a value (--{key}=VALUE)")
    try:
        if kind is bool:
            if value is not None and value.lower() not in BOOL_WORDS:
                raise ValueError(value)
            return True if value is None else BOOL_WORDS[value.lower()]
        return kind(value)
    except ValueError:
        raise SystemExit(f"--{key} expects a {kind.__name__}, got {value!r}") from None


def parse_overrides(cfg, argv, given=None):
    """Apply command-line settings (--key=value, --key value, a bare --flag for booleans) to a
    Config, checking names and types; the names set are added to `given` (a set) when given."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    for key, value in split_flags(argv):
        if key not in fields:
            raise SystemExit(unknown_setting(key, sorted(fields)))
        setattr(cfg, key, parse_value(key, type(getattr(cfg, key)), value))
        if given is not None:
            given.add(key)
    return cfg


def read_config_file(path):
    """A settings file -> {name: value}: a JSON object (.json) or a YAML mapping (.yaml/.yml;
    JSON is YAML too). Comments in YAML are the place for each value's source."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise SystemExit(f"--config: cannot read {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise SystemExit(f"--config: {path} line {line}: not UTF-8 text ({raw[e.start:e.start + 1]!r})") from None
    def unique(pairs, where=""):  # a key given twice is a mistake, not "the last one wins"
        keys = [k for k, _ in pairs]
        twice = sorted({str(k) for k in keys if keys.count(k) > 1})
        if twice:
            raise SystemExit(f"--config: {path}{where}: {', '.join(twice)} given more than once")
        return dict(pairs)

    if path.endswith(".json"):
        try:
            settings = json.loads(text, object_pairs_hook=unique)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--config: {path} is not valid JSON: {e}") from None
    else:
        import yaml  # lazy: only a YAML config needs PyYAML

        class Loader(yaml.SafeLoader):
            def construct_mapping(self, node, deep=False):
                first = {}  # a key written twice in one mapping is an error naming both lines
                for k, _ in node.value:
                    if k.tag == "tag:yaml.org,2002:merge":
                        continue
                    key, line = self.construct_object(k, deep=deep), k.start_mark.line + 1
                    if key in first:
                        raise SystemExit(f"--config: {path} line {line}: {key} given more than once (first on "
                                         f"line {first[key]})")
                    first[key] = line
                self.flatten_mapping(node)  # YAML's merge keys (<<): merged first, so the mapping's own keys win
                return dict((self.construct_object(k, deep=deep), self.construct_object(v, deep=deep))
                            for k, v in node.value)

        try:
            settings = yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as e:  # one line naming the file and the place
            raise SystemExit(f"--config: {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if settings is None:  # an empty file (or comments only): no settings
        return {}
    if not isinstance(settings, dict):
        raise SystemExit(f"--config: {path} must hold a mapping of settings (name: value), got {type(settings).__name__}")
    return settings


def apply_config_file(cfg, path, given=None):
    """Set a config file's settings on a Config: names checked like flags; a value of the
    field's type is taken as it is (an int for a float field too), text is read as a flag's
    text would be (YAML reads 1e-6 as text), a mapping or list for a text field becomes its
    JSON (chat_template_kwargs: {enable_thinking: false})."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    for key, value in read_config_file(path).items():
        if key not in fields:
            raise SystemExit(f"--config: {path}: {unknown_setting(str(key), sorted(fields))}")
        kind = type(getattr(cfg, key))
        if isinstance(value, str) and kind is not str:
            try:
                value = parse_value(key, kind, value)
            except SystemExit as e:
                raise SystemExit(f"--config: {path}: {e}") from None
        elif isinstance(value, (dict, list)) and kind is str:
            value = json.dumps(value)
        elif kind is float and type(value) is int:
            value = float(value)
        elif type(value) is not kind:
            raise SystemExit(f"--config: {path}: {key} expects a {kind.__name__}, got {value!r}")
        setattr(cfg, key, value)
        if given is not None:
            given.add(key)
    return cfg


def resolve_settings(cfg, argv):
    """The command line -> (cfg, given, dry_run). --config=FILE is applied first, wherever it
    stands, then every other flag over it; `given` names every setting the file or a flag set
    (on resume they win over the checkpoint's). --dry_run: print the result and stop (train.main)."""
    given, rest, config_path, dry_run = set(), [], None, False
    for key, value in split_flags(argv):
        if key == "config":
            if config_path is not None or not value:
                raise SystemExit("--config takes one file (--config=FILE); put every setting in it, or override with flags")
            config_path = value
        elif key == "dry_run":
            dry_run = parse_value(key, bool, value)
        else:
            rest.append(f"--{key}" if value is None else f"--{key}={value}")
    if config_path:
        apply_config_file(cfg, config_path, given)
    return parse_overrides(cfg, rest, given), given, dry_run


def dry_run_report(cfg):
    """--dry_run: the settings checked (not the model or the data), then printed as JSON on
    stdout, which --config reads back: `python train.py ... --dry_run > run.json`."""
    check_config(cfg)
    print(json.dumps(dataclasses.asdict(cfg), indent=1))


def config_help(config_class):
    """`python train.py --help`: every field of Config with its type, default and the
    comment beside it in the class, under the class's own section headings."""
    entries, defaults = [], config_class()  # (heading, None, None) | (--name=default, type, comment)
    for line in inspect.getsource(config_class).splitlines()[1:]:
        text = line.strip()
        name, colon, rest = text.partition(":")
        if text.startswith("# ----"):
            entries.append((text.strip("# -") + ":", None, None))
        elif colon and name.isidentifier() and "=" in rest:
            value = getattr(defaults, name)
            entries.append((f"--{name}={value}", type(value).__name__, rest.split("  # ", 1)[1] if "  # " in rest else ""))
    width = max(len(e[0]) for e in entries if e[1])
    lines = ["usage: python train.py [--config=FILE] [--key=value | --key value | --flag ...] [--dry_run]   "
             "(every GPU of a node: torchrun --nproc_per_node=N train.py ...)",
             "--config=FILE: a JSON or YAML file of settings (configs/); flags override it. --dry_run: print the "
             "resolved settings as JSON and exit without loading anything.",
             "The settings of config.Config with their defaults; the method and its formulas: docs/METHOD.md."]
    for flag, kind, comment in entries:
        lines += ["", flag] if kind is None else [f"  {flag:<{width}}  {kind:<5}  {comment}".rstrip()]
    return "\n".join(lines)


# Every enumerated and bounded setting, checked by check_config before anything loads.
CHOICES = {  # setting -> its allowed values; by Config's sections
    # model and data
    "device": ("auto", "cpu", "cuda"),
    "backend": ("vllm", "hf"),
    "engine_dtype": ("bfloat16", "float16", "float32", "auto"),
    "vllm_sleep_level": (0, 1, 2),
    "algo": ("p2o", "grpo", "sft"),
    # loss
    "adv_norm": ("group", "none", "raw"),
    "loss_agg": grpo.LOSS_AGGS,
    "policy_loss": tuple(grpo.POLICY_LOSSES),
    # P²O and reference-code parity
    "reflector_backend": ("hf", "vllm"),
    "crm_denominator": ("all", "kept"),
    "prompt_format": FORMATS,
    "gepa_auto": ("", *gepa.AUTO_CANDIDATES),
    "reflect_prompt": gepa.REFLECT_PROMPTS,
    "gepa_selection": gepa.SELECTIONS,
    "gepa_accounting": gepa.ACCOUNTINGS,
    # reward shaping, optimisation
    "clipo_loss": ("released", "textbook"),
    "reward_errors": REWARD_ERRORS,
    "packed_attention": ("auto", "flex", "dense"),
}
AT_LEAST = {  # setting -> its smallest allowed value; by Config's sections
    # model and data, rollouts
    "max_model_len": 0, "kv_cache_gib": 1, "cpu_threads": 0,
    "prompts_per_step": 1, "group_size": 1, "max_tokens": 1, "max_refills": 0,
    # loss
    "eps_low": 0.0, "eps_high": 0.0, "dual_clip": 0.0, "kl_beta": 0.0, "ppo_epochs": 1, "mini_batches": 1,
    "tis_cap": 0.0,
    # P²O
    "tau": 0, "gepa_min_hard": 1, "gepa_budget": 1, "gepa_dev_max": 1, "gepa_parents": 1, "gepa_minibatch": 1,
    "gepa_max_iterations": 1, "max_template_chars": 1, "template_max_growth": 1.0, "guard_copy_words": 1,
    "reflect_answer_chars": 0, "reflector_retries": 0, "reflect_temperature": 0.0, "reflect_max_tokens": 1,
    "reflect_top_k": 0, "dev_holdout": 0, "reward_timeout": 0.0,
    # reward shaping
    "clipo_weight": 0.0, "clipo_cap": 0.0, "clipo_dim": 1, "clipo_tau": 0.0, "clipo_lr": 0.0,
    "clipo_weight_decay": 0.0, "frozen_steps": 0, "agreement_bonus": 0.0, "agreement_cap": 0.0,
    "agreement_ngram": 1,
    # optimisation, LoRA
    "lr": 0.0, "warmup_steps": 0, "adam_beta1": 0.0, "adam_beta2": 0.0, "weight_decay": 0.0,
    "micro_batch_size": 1, "head_chunk": 1, "lora_rank": 0, "lora_dropout": 0.0, "max_bad_steps": 1,
    # schedule and outputs
    "epochs": 1, "max_steps": 0, "max_gen_tokens": 0, "eval_every": 0, "eval_k": 0, "save_every": 0,
    "keep_checkpoints": 0, "export_every": 0, "log_rollouts": 0,
}
POSITIVE = (  # > 0
    "temperature", "top_p", "reflect_top_p", "gpu_memory_utilization", "crm_low", "crm_high", "adam_eps",
    "grad_clip", "reflector_timeout", "lora_alpha", "lora_lr_scale", "clipo_tau",
)
BELOW_ONE = ("adam_beta1", "adam_beta2", "lora_dropout")  # < 1
AT_MOST_ONE = ("eps_low", "top_p", "reflect_top_p", "gpu_memory_utilization")  # <= 1


def check_config(cfg):
    """Every setting's value, before anything loads: one line naming the flag, no traceback. What
    needs a model, the data or the reward's first call is checked where the run starts (train.train)."""
    for f in dataclasses.fields(cfg):  # NaN passes every range check below, inf most of them
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise SystemExit(f"--{f.name} must be a finite number, got {value}")
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise SystemExit(f"--{name} is one of {' | '.join(map(repr, allowed))}, got {getattr(cfg, name)!r}")
    for name, low in AT_LEAST.items():
        if getattr(cfg, name) < low:
            raise SystemExit(f"--{name} must be >= {low}, got {getattr(cfg, name)}")
    for names, bad, rule in ((POSITIVE, lambda v: v <= 0, "> 0"), (BELOW_ONE, lambda v: v >= 1, "< 1"),
                             (AT_MOST_ONE, lambda v: v > 1, "<= 1")):
        for name in names:
            if bad(getattr(cfg, name)):
                raise SystemExit(f"--{name} must be {rule}, got {getattr(cfg, name)}")
    if 0 < cfg.dual_clip <= 1:
        raise SystemExit(f"--dual_clip is 0 (off) or > 1, got {cfg.dual_clip}")
    if cfg.crm_low >= cfg.crm_high:
        raise SystemExit(f"--crm_low ({cfg.crm_low}) must be below --crm_high ({cfg.crm_high})")
    if cfg.fix_importance_ratio and not cfg.context_distill:
        raise SystemExit("--fix_importance_ratio acts on distilled rows; it needs --context_distill=True")
    if cfg.crm_denominator == "kept" and cfg.loss_agg != "token-mean":
        raise SystemExit("--crm_denominator=kept needs --loss_agg=token-mean")
    check_objective(cfg)
    if cfg.lora_rank and not cfg.lora_targets.strip():
        raise SystemExit("--lora_targets is all-linear or a comma list of linear layers (e.g. q_proj,v_proj), got ''")
    try:
        load_reward(cfg.reward)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not cfg.reflector:
        raise SystemExit("--reflector is init | policy | a model path/id | an http(s):// server, got ''")
    chat_template_kwargs(cfg)
    reflector_chat_kwargs(cfg)
    pick_device(cfg.device)
    if cfg.fixed_template:
        if cfg.algo != "grpo":
            raise SystemExit(f"--fixed_template needs --algo=grpo (p2o's GEPA assigns its own; sft samples nothing), "
                             f"got --algo={cfg.algo}")
        try:
            gepa.read_seed_templates(cfg.fixed_template, cfg.max_template_chars)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--fixed_template: {e}") from None
    seeds = []
    if cfg.seed_templates:
        try:
            seeds = gepa.read_seed_templates(cfg.seed_templates, cfg.max_template_chars)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--seed_templates: {e}") from None
    if cfg.algo == "p2o":
        try:  # a budget that cannot pay for one proposal would fail only at the first epoch's end
            gepa.dev_cap(cfg, len(seeds))
        except ValueError as e:
            raise SystemExit(f"--gepa_budget: {e}") from None


def check_objective(cfg):
    """--policy_loss with the loss settings it meets: each combination either has a defined meaning
    (docs/METHOD.md §3, "Objectives and sampler corrections") or is one line here."""
    try:
        correction = grpo.parse_correction(cfg.sampler_correction, cfg.tis_cap)
    except ValueError as e:
        raise SystemExit(f"--sampler_correction: {e}") from None
    if cfg.sampler_correction and cfg.tis_cap:
        raise SystemExit(f"--tis_cap={cfg.tis_cap:g} and --sampler_correction={cfg.sampler_correction}: one correction "
                         f"at a time (--tis_cap=C is --sampler_correction=token_tis:C)")
    loss = cfg.policy_loss
    if loss != "ppo" and cfg.dual_clip:
        raise SystemExit(f"--dual_clip caps PPO's token loss; --policy_loss={loss} has none to cap: --dual_clip=0")
    if loss.startswith("gspo") and cfg.fix_importance_ratio:
        raise SystemExit(f"--policy_loss={loss} with --fix_importance_ratio: one ratio a response would mix pi(y|x) and "
                         "pi_old(y|x~) over its tokens; use --policy_loss=ppo or --fix_importance_ratio=False")
    if loss in grpo.SEQUENCE_RATIO:
        distills = cfg.crm and cfg.context_distill and (cfg.algo == "p2o" or cfg.fixed_template)
        level = grpo.SAMPLER_CORRECTIONS[correction[0]][2] if correction else None
        if distills or level == "token":
            what = "the Context Ratio Mask" if distills else \
                f"a token-level correction ({cfg.sampler_correction or f'--tis_cap={cfg.tis_cap:g}'})"
            raise SystemExit(f"--policy_loss={loss} takes one ratio a response, whose gradient runs through every "
                             f"token: {what} would weight tokens it cannot hold back. Use --policy_loss=gspo_token "
                             "(the same objective, a gradient path per token)" +
                             (", or --crm=False" if distills else ", or a sequence-level correction (seq_tis, seq_mask, "
                              "geo_mask)"))


def json_object_setting(flag, text):
    """A setting holding a JSON object, as a dict ({} when empty); anything else is a one-line
    error naming --flag."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise SystemExit(f"--{flag} must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"--{flag} must be a JSON object, got {text!r}")
    return value


def chat_template_kwargs(cfg):
    """--chat_template_kwargs as a dict ({} when empty); a clear error for anything but a JSON
    object. `cfg`: a Config or anything with that attribute (eval.py's arguments)."""
    return json_object_setting("chat_template_kwargs", cfg.chat_template_kwargs)


def reflector_chat_kwargs(cfg):
    """--reflect_chat_template_kwargs as a dict, or None when empty: the reflector then keeps its
    engine's chat_template_kwargs (Self-Ref and Policy-Ref: --chat_template_kwargs), and nothing
    is sent to a server. E.g. '{"enable_thinking": true}' -> {"enable_thinking": True}."""
    text = cfg.reflect_chat_template_kwargs
    return json_object_setting("reflect_chat_template_kwargs", text) if text.strip() else None


def pick_device(name):
    """auto -> cuda when available, else cpu. Training keeps fp32 master weights and runs its
    forward under bf16 autocast (autocast_bf16) on either device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise SystemExit(f"--device is auto | cpu | cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device=cuda, but torch sees no CUDA device")
    return torch.device(name)


SHARED_PROMPT_CUDA_MAX = 4096  # response tokens a packed micro-batch may hold on CUDA under a dense mask


def packed_layout(cfg, device_type):
    """(shared_prompt, packed_attention) for this device, and why shared_prompt was turned off
    (None if it was not). packed_attention auto: flex on CUDA, dense elsewhere; flex needs CUDA
    (torch's FlexAttention has no backward on the CPU). A dense [L, L] mask keeps CUDA's SDPA
    off its fused kernels: measured on an H200 with 8 x 64-1,024-token answers, packing under it
    was 1.32x slower than rows (docs/GPU.md), so on CUDA it is kept only up to
    SHARED_PROMPT_CUDA_MAX response tokens a micro-batch. The CPU keeps packing (there the dense
    mask is the faster layout)."""
    attention = cfg.packed_attention
    if attention == "auto":
        attention = "flex" if device_type == "cuda" else "dense"
    if attention == "flex" and device_type != "cuda":
        raise SystemExit("--packed_attention=flex needs CUDA (torch's FlexAttention has no backward on the CPU); "
                         "use dense or auto")
    packed = cfg.micro_batch_size * cfg.max_tokens
    if device_type == "cuda" and cfg.shared_prompt and attention == "dense" and packed > SHARED_PROMPT_CUDA_MAX:
        return False, attention, (
            f"a packed micro-batch would hold up to {cfg.micro_batch_size} x {cfg.max_tokens} = {packed} response "
            f"tokens under a dense [L, L] mask, over the {SHARED_PROMPT_CUDA_MAX} allowed on CUDA (docs/GPU.md); "
            "--packed_attention=flex skips the masked tiles")
    return cfg.shared_prompt, attention, None


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX512-BF16, x86 AMX, Arm BF16 (Linux's names)


def bf16_is_emulated(device_type, cpuinfo="/proc/cpuinfo"):
    """True on a CPU without bf16 instructions (none of BF16_CPU_FLAGS in Linux's /proc/cpuinfo).
    There torch's and vLLM's bf16 kernels convert to fp32 and back: generation was 8x slower than
    in fp32 on a 2-core AMD EPYC (docs/TRAINING.md). False on CUDA and where the flags cannot be
    read (macOS, Windows): the settings then stay as given."""
    if device_type != "cpu":
        return False
    try:
        with open(cpuinfo) as f:
            words = set(f.read().split())
    except OSError:
        return False
    return not words & set(BF16_CPU_FLAGS)


def default_engine_dtype():
    """An engine's dtype where none was given (eval.py, compare.py's scorer: the engine runs on
    CUDA when there is one): bfloat16, or float32 where bf16 is emulated (bf16_is_emulated)."""
    return "float32" if bf16_is_emulated(pick_device("auto").type) else "bfloat16"


def cpu_precision(cfg, device_type, emulated=None):
    """(engine_dtype, autocast_bf16, note or None). With cpu_fp32_fallback, where bf16 is emulated
    (bf16_is_emulated; `emulated` overrides the check) a bfloat16 engine becomes float32 and the
    training forward leaves bf16 autocast; the note says so. Anywhere else: the settings as given."""
    if emulated is None:
        emulated = bf16_is_emulated(device_type)
    uses_bf16 = cfg.engine_dtype == "bfloat16" or cfg.autocast_bf16
    if not (cfg.cpu_fp32_fallback and uses_bf16 and emulated and device_type == "cpu"):
        return cfg.engine_dtype, cfg.autocast_bf16, None
    engine = "float32" if cfg.engine_dtype == "bfloat16" else cfg.engine_dtype
    return engine, False, (f"this CPU has no bf16 instructions (AVX512-BF16, AMX), where bf16 is emulated and "
                           f"several times slower: --engine_dtype={engine} --autocast_bf16=False "
                           "(--cpu_fp32_fallback=False keeps bf16)")


def cpu_threads(setting, cores=None, local_world=None):
    """torch's CPU threads for a GPU process: `setting` when > 0, else this process's cores
    (its CPU affinity) shared among the node's processes (LOCAL_WORLD_SIZE, set by torchrun).
    vLLM cuts torch to one thread when OMP_NUM_THREADS is unset, and torchrun sets it to 1:
    either way the trainer's CPU work (push checksums of CPU tensors, the CPU snapshot) would
    run on one core of a node that has dozens."""
    if setting > 0:
        return setting
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world is None else local_world
    return max(1, cores // max(1, local_world))


def learning_rate(cfg):
    """The optimizer's lr: --lr, times --lora_lr_scale when LoRA trains (adapters need a larger step)."""
    return cfg.lr * (cfg.lora_lr_scale if cfg.lora_rank else 1.0)
