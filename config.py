"""train.py's settings: the command line, --help, and every value checked before anything loads.

`train.Config` (the top of train.py) holds the settings; here they are read, described and
checked, and turned into what the run needs (device, chat-template arguments, vLLM's context,
a held-out dev set):

    cfg = parse_overrides(Config(), ["--lr=1e-6", "--group_size", "12", "--crm"])   # types checked
    check_config(cfg)             # SystemExit naming the flag: "--adv_norm is one of 'group' | 'none', got 'z'"
    train_set, dev_set = load_data(cfg)   # every row validated
    print(config_help(Config))    # python train.py --help

Every mistake is one line before any model loads: a misspelt setting names the nearest ones
("unknown setting --group_sise; did you mean --group_size?"), a model path that is not a model
folder or a hub id that is neither cached nor reachable is reported without a download
(model.check_model), a bad data file names its row.
"""

import dataclasses
import difflib
import inspect
import json
import os
import random
import sys

import torch

import gepa
import grpo
from data import DataError, load_jsonl
from model import check_model
from prompts import FORMATS, problem_messages
from rollout import encode_prompt
from verify import load_reward


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
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SystemExit(f"--config: cannot read {path}: {e.strerror}") from None
    if path.endswith(".json"):
        try:
            settings = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--config: {path} is not valid JSON: {e}") from None
    else:
        import yaml  # lazy: only a YAML config needs PyYAML

        try:
            settings = yaml.safe_load(text)
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
    check_config(cfg, models=False)
    print(json.dumps(dataclasses.asdict(cfg), indent=1))


def config_help(config_class):
    """`python train.py --help`: every field of train.Config with its type, default and the
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
             "The settings of train.Config with their defaults; the method and its formulas: docs/METHOD.md."]
    for flag, kind, comment in entries:
        lines += ["", flag] if kind is None else [f"  {flag:<{width}}  {kind:<5}  {comment}".rstrip()]
    return "\n".join(lines)


# Every enumerated and bounded setting, checked by check_config before anything loads.
CHOICES = {
    "device": ("auto", "cpu", "cuda"), "backend": ("vllm", "hf"), "reflector_backend": ("hf", "vllm"),
    "engine_dtype": ("bfloat16", "float16", "float32", "auto"), "algo": ("p2o", "grpo", "sft"),
    "adv_norm": ("group", "none", "raw"), "loss_agg": grpo.LOSS_AGGS, "crm_denominator": ("all", "kept"),
    "prompt_format": FORMATS, "gepa_auto": ("", *gepa.AUTO_CANDIDATES), "vllm_sleep_level": (0, 1, 2),
    "reflect_prompt": gepa.REFLECT_PROMPTS, "gepa_selection": gepa.SELECTIONS,
    "gepa_accounting": gepa.ACCOUNTINGS, "packed_attention": ("auto", "flex", "dense"),
    "clipo_loss": ("released", "textbook"),
}
AT_LEAST = {  # setting -> smallest allowed value
    "max_model_len": 0, "kv_cache_gib": 1, "prompts_per_step": 1, "group_size": 1, "max_tokens": 1,
    "max_refills": 0, "eps_low": 0.0, "eps_high": 0.0, "dual_clip": 0.0, "kl_beta": 0.0, "ppo_epochs": 1,
    "mini_batches": 1, "tis_cap": 0.0, "tau": 0, "gepa_min_hard": 1, "gepa_budget": 1, "gepa_dev_max": 1,
    "gepa_parents": 1, "gepa_minibatch": 1, "gepa_max_iterations": 1, "max_template_chars": 1,
    "template_max_growth": 1.0, "guard_copy_words": 1, "reflect_answer_chars": 0, "reflector_retries": 0,
    "reflect_temperature": 0.0, "reflect_max_tokens": 1, "reflect_top_k": 0, "dev_holdout": 0, "lr": 0.0,
    "warmup_steps": 0, "adam_beta1": 0.0, "adam_beta2": 0.0, "weight_decay": 0.0, "micro_batch_size": 1,
    "clipo_weight": 0.0, "clipo_cap": 0.0, "clipo_dim": 1, "clipo_tau": 0.0, "clipo_lr": 0.0, "clipo_weight_decay": 0.0,
    "frozen_steps": 0, "agreement_bonus": 0.0, "agreement_cap": 0.0, "agreement_ngram": 1, "max_bad_steps": 1, "head_chunk": 1, "epochs": 1, "max_steps": 0, "max_gen_tokens": 0, "eval_every": 0,
    "eval_k": 0, "save_every": 0,
    "keep_checkpoints": 0, "export_every": 0, "log_rollouts": 0, "cpu_threads": 0, "lora_rank": 0, "lora_dropout": 0.0,
}
POSITIVE = ("temperature", "top_p", "reflect_top_p", "gpu_memory_utilization", "crm_low", "crm_high", "adam_eps",
            "grad_clip", "reflector_timeout", "lora_alpha", "lora_lr_scale", "clipo_tau")  # > 0
BELOW_ONE = ("eps_low", "adam_beta1", "adam_beta2", "lora_dropout")  # < 1
AT_MOST_ONE = ("top_p", "reflect_top_p", "gpu_memory_utilization")  # <= 1


def check_config(cfg, models=True):
    """Every setting's value, before any model loads: one line naming the flag, no traceback;
    then (models) that --model and --reflector can be loaded."""
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
    if not models:
        return
    check_model(cfg.model)  # after the settings: one HTTP request for an uncached hub id
    if cfg.reflector not in ("init", "policy") and not cfg.reflector.startswith(("http://", "https://")):
        check_model(cfg.reflector, "--reflector")


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


def context_length(cfg, tokenizer, problems, chat_kwargs):
    """vLLM's max_model_len: --max_model_len, or (0) the longest prompt the run can send plus
    its answer. Training and GEPA prompts: the longest data prompt + the longest template
    (gepa.max_template_length, counted as one token a character, plus the blank line) +
    max_tokens. P²O reflection prompts (either --reflect_prompt): the meta-prompt with the
    longest problems and answers of the data (gepa.longest_reflection_prompt) under the
    reflector's chat template arguments (reflector_chat_kwargs, else chat_kwargs), plus the parts
    cut to a length in characters, one token each (gepa.reflection_cut_chars: the parent template,
    the answers and extracted answers), + reflect_max_tokens."""
    if cfg.max_model_len:
        return cfg.max_model_len
    longest_prompt = max(len(encode_prompt(tokenizer, problem_messages(p, fmt=cfg.prompt_format), chat_kwargs))
                         for p in problems)
    need = longest_prompt + gepa.max_template_length(cfg) + 2 + cfg.max_tokens
    if cfg.algo == "p2o":
        messages = gepa.longest_reflection_prompt(cfg, problems)  # with its framing (ours: the prefill)
        reflect_kwargs = reflector_chat_kwargs(cfg)
        kwargs = chat_kwargs if reflect_kwargs is None else reflect_kwargs
        need = max(need, len(encode_prompt(tokenizer, messages, kwargs)) + gepa.reflection_cut_chars(cfg)
                   + cfg.reflect_max_tokens)
    return need


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


def load_data(cfg):
    """(train set, dev set), every row validated before any model loads: a bad file is one line
    naming the flag, the file and the row."""
    sets = []
    for flag in ("train_data", "dev_data"):
        try:
            sets.append(load_jsonl(getattr(cfg, flag))[0] if getattr(cfg, flag) else [])
        except DataError as e:
            raise SystemExit(f"--{flag}: {e}") from None
    if cfg.dev_holdout:
        sets = hold_out(sets[0], cfg.dev_holdout, cfg.seed)
    return sets


def hold_out(problems, n, seed):
    """(train, dev): n problems drawn (seeded, own stream) as an in-distribution dev set, the rest to train."""
    if not 0 < n < len(problems):
        raise SystemExit(f"--dev_holdout={n} must be between 1 and {len(problems) - 1} (the train set has {len(problems)})")
    order = random.Random(f"holdout/{seed}").sample(range(len(problems)), len(problems))
    held = set(order[:n])
    return [p for i, p in enumerate(problems) if i not in held], [problems[i] for i in sorted(held)]


def resume_point(cfg, given=None):
    """Read a resume once, for the command line and train(cfg) alike -> (cfg, checkpoint folder
    or None, its trainer.pt or None). The checkpoint's settings come back, and the settings
    named in `given` win over them (the command line's flags; for train(cfg), by default every
    field that differs from Config's default). A saved setting this Config no longer has is
    dropped with a note; LoRA's shape (rank, alpha, targets) cannot change on resume."""
    from runs import load_trainer_state, resolve_resume  # lazy: runs imports the logging stack

    path = resolve_resume(cfg) if cfg.resume else None
    if not path:
        return cfg, None, None
    saved = load_trainer_state(path)
    config_class = type(cfg)  # train.Config
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


def reward_scorer(cfg, problems):
    """--reward as check_fn(response, problem) -> verify.Verdict, tried once on the first problem's
    gold answer (boxed) so that a function that raises or returns no number is one line at start-up."""
    check_fn = load_reward(cfg.reward)
    if problems:
        try:
            check_fn(f"The answer is \\boxed{{{problems[0].answer}}}.", problems[0])
        except (ValueError, RuntimeError) as e:
            raise SystemExit(f"{e} (tried at start-up on its gold answer)") from None
    return check_fn
