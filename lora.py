"""LoRA for the trainer: a frozen base, trained adapters, merged weights for the engine, PEFT folders.

    policy = add_adapters(policy, rank=32, alpha=32, targets="all-linear", dropout=0.0, base_dtype=torch.bfloat16)
    push_policy(engine, policy)                         # vLLM: the adapters (vLLM's LoRA); else merged in fp32
    with adapters_off(policy): ...                    # the starting policy: KL reference, Self-Ref reflector
    save_adapter(policy, adapter_state(policy), folder) # adapter_config.json + adapter_model.safetensors
    load_adapter(policy, folder)                        # a checkpoint's adapters back into a fresh policy
    model.merged_folder("runs/x/ckpt-000010")            # an adapter folder as a plain HF model folder (eval.py)

peft (pinned in requirements.txt) injects the layers: each targeted nn.Linear becomes a
`peft.tuners.lora.Linear` holding the untouched `base_layer` and `lora_A` [r, in], `lora_B`
[out, r], and computes base_layer(x) + (alpha/r) * lora_B(lora_A(dropout(x))). B starts at zero,
so the adapted policy starts as the base, exactly. Only A and B train: the base weights are
frozen (requires_grad False, no gradient, no optimizer state) and held in the training dtype
(bf16 under autocast); the adapters are fp32 master weights with AdamW's moments.

The vLLM engine serves the adapters unmerged, as vLLM's own LoRA (push_policy: the adapters
alone go in, the base weights never move; rollout.VLLMRollout.push_adapters verifies them). A
merge W + (alpha/r) B A into bf16 weights would round every element whose update is below half a
bf16 step of W back to W: after ~100 Adam steps at 1e-5, most of them, and the engine would
sample close to the starting policy. Where a merge is what is wanted (an fp32 engine, the HF
backend, an export), engine_weights computes it in fp32 from the untouched base (no
merge/unmerge cycle on the trainer's weights, so nothing drifts), under the HF names the engine
loads (`.base_layer` gone).

Folders are PEFT's own format (keys base_model.model.<module>.lora_A.weight, the config with r,
lora_alpha and the short target names), which `PeftModel.from_pretrained` reads, and vLLM's LoRA
loader too when the engine's max_lora_rank is at least r (vLLM's default is 16;
rollout.engine_lora_rank).
"""

import contextlib
import os

import torch

import dist
from model import ADAPTER_WEIGHTS, read_adapter_config

PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the wrapped model's names, in saved adapters
ALL_LINEAR = "all-linear"


def decoder_layers(model):
    """The decoder's layers (model.model.layers of an HF causal LM), where adapters go."""
    return model.model.layers


def target_names(model, targets=ALL_LINEAR):
    """The short names (q_proj, ...) of the nn.Linear modules of the decoder layers that
    `targets` names: "all-linear" (every linear layer of the decoder; the LM head is not in it)
    or a comma-separated list, each name of which must exist."""
    found = sorted({name.rsplit(".", 1)[-1] for layer in decoder_layers(model)
                    for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)})
    if targets == ALL_LINEAR:
        return found
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    missing = [t for t in wanted if t not in found]
    if missing or not wanted:
        raise SystemExit(f"--lora_targets={targets}: {', '.join(missing) or 'nothing'} is not a linear layer of the decoder "
                         f"(it has {', '.join(found)}; or {ALL_LINEAR})")
    return sorted(wanted)


class GradOnlyDropout(torch.nn.Dropout):
    """LoRA's dropout, active only in a forward that builds a graph: the no-grad passes of a
    step (old, reference and CRM log-probs) see the same deterministic policy the update starts from."""

    def forward(self, x):
        return super().forward(x) if torch.is_grad_enabled() else x


def add_adapters(model, rank, alpha, targets=ALL_LINEAR, dropout=0.0, base_dtype=torch.float32):
    """Inject LoRA adapters (rank r, scaling alpha/r, B = 0) into every targeted linear layer of
    the decoder, in place; freeze every other weight and cast it to `base_dtype`. The adapters
    are fp32 master weights. Returns the model."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_names(model, targets), lora_dropout=dropout,
                        bias="none", task_type="CAUSAL_LM")
    inject_adapter_in_model(config, model)  # freezes everything but the adapters
    for module in lora_layers(model):
        if dropout:
            module.lora_dropout["default"] = GradOnlyDropout(dropout)
        # peft casts a layer's input to the adapters' dtype (fp32). Under bf16 autocast the matmul casts it
        # back, and the bf16 copy it saves for backward duplicates the base layer's saved input; without
        # autocast the input is already fp32. Off: the input goes to the adapters as it is.
        module.cast_input_dtype_enabled = False
    master = torch.promote_types(base_dtype, torch.float32)  # fp32 (fp64 for a float64 base: the tests)
    for name, p in model.named_parameters():
        if is_adapter(name):
            p.data = p.data.to(master)
        else:
            p.requires_grad_(False)
            p.data = p.data.to(base_dtype)
    return model


def load_policy(cfg, model_path, weights_path, device):
    """train.py's LoRA policy: cfg.model's weights (model_path) frozen in the dtype the forward
    computes in (bf16 under autocast, else fp32), adapters of cfg.lora_* (zero B), those of a
    checkpoint folder when weights_path is one."""
    from transformers import AutoModelForCausalLM

    base_dtype = torch.bfloat16 if cfg.autocast_bf16 else torch.float32
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=base_dtype).to(device)
    add_adapters(policy, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout, base_dtype)
    return load_adapter(policy, weights_path) if weights_path != model_path else policy


def describe(model):
    """'LoRA: rank 32, alpha 32 on down_proj, ...: 9,768,960 trained parameters of 144,283,968'."""
    config = lora_config(model)
    trained = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))  # FSDP2: global sizes
    return (f"LoRA: rank {config.r}, alpha {config.lora_alpha} on {', '.join(targets_of(model))}: {trained:,} trained "
            f"parameters of {sum(p.numel() for p in model.parameters()):,}")


def is_adapter(name):
    return ".lora_A." in name or ".lora_B." in name


def lora_layers(model):
    """The injected LoRA layers of `model` (none: not a LoRA model)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def is_lora(model):
    return any(is_adapter(name) for name, _ in model.named_parameters())


def scaling(model):
    """alpha / r, the factor of B A (the same for every layer: one rank and alpha for all)."""
    return lora_layers(model)[0].scaling["default"]


@contextlib.contextmanager
def adapters_off(model):
    """The base model alone for the block (LoRA layers compute base_layer(x)): the starting
    policy, with no second copy of it. A no-op on a model without adapters. (peft's public
    enable_adapters(False) also flips requires_grad; the flag it reads is set directly.)"""
    layers = lora_layers(model)
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m in layers:
            m._disable_adapters = False


def merged_weights(named, factor, adapters=True):
    """(HF name, fp32 tensor) pairs for an engine from (name, full tensor) pairs of an adapted
    model in named_parameters order (a layer's base weight before its lora_A and lora_B):
    each targeted weight becomes W + factor * B A computed in fp32 (adapters=False: W, the
    starting policy), under its plain name; the adapters themselves are not sent. Other
    tensors pass as they are."""
    pending = {}  # layer prefix -> {"weight": W, "lora_A": A, "lora_B": B} until all three came
    for name, tensor in named:
        if ".base_layer." not in name and not is_adapter(name):
            yield name, tensor
            continue
        if ".base_layer." in name:
            prefix, leaf = name.split(".base_layer.")
            if leaf != "weight":  # a base bias: unchanged by LoRA
                yield f"{prefix}.{leaf}", tensor
                continue
            kind = "weight"
        else:
            prefix, kind = name.split(".lora_")[0], "lora_" + name.split(".lora_")[1][0]
        parts = pending.setdefault(prefix, {})
        parts[kind] = tensor
        if len(parts) == 3:
            del pending[prefix]
            weight = parts["weight"].float()
            if adapters:
                weight = weight + factor * (parts["lora_B"].float() @ parts["lora_A"].float())
            yield f"{prefix}.weight", weight
    if pending:
        raise ValueError(f"LoRA layers without a base weight or an adapter: {sorted(pending)}")


def engine_weights(model, dtype=None, adapters=True, named=None):
    """What an engine holds of `model`: (HF name, tensor) pairs cast to `dtype`, one at a time.
    A LoRA model's targeted weights are merged (merged_weights); any other model's parameters
    pass as dist.full_parameters gives them. `named`: (name, full tensor) pairs to merge instead
    of the live model's (e.g. a state dict gathered on rank 0). Under FSDP2 a collective, as
    dist.full_parameters: every rank consumes the whole generator."""
    if not is_lora(model):
        yield from dist.full_parameters(model, dtype)
        return
    source = dist.full_parameters(model) if named is None else named
    for name, tensor in merged_weights(source, scaling(model), adapters):
        yield name, tensor if dtype is None else tensor.to(dtype)


def push_policy(engine, model):
    """The policy into the rollout engine, verified there (a mismatch raises). A LoRA policy on an
    engine that serves adapters (rollout.VLLMRollout with lora_rank) goes as its adapters alone,
    the base never moving (after a level-2 sleep, which dropped the engine's weights, the frozen
    base is pushed first); any other engine gets engine_weights, the merged weights, which only
    an fp32 engine holds exactly: a merge cast to bf16 or fp16 is refused, as it rounds every
    update below half a step of W back to W (docs/GPU.md "LoRA"). Under FSDP2 a collective."""
    dtype = getattr(engine, "dtype", None)
    if is_lora(model) and getattr(engine, "lora_rank", 0):
        if getattr(engine, "sleep_level", 0) == 2:
            engine.push_weights(engine_weights(model, dtype, adapters=False))
        config = lora_config(model)
        return engine.push_adapters(adapter_state(model), config.r, config.lora_alpha, targets_of(model))
    if is_lora(model) and dtype is not None and dtype.itemsize < 4:
        raise ValueError(f"a LoRA policy merged into {dtype} weights loses every update below half a {dtype} step of "
                         "the base: start the engine with lora_rank (vLLM's LoRA), or in float32")
    return engine.push_weights(engine_weights(model, dtype))


def weight_streams(model, named=None):
    """(merged, base): functions that each return engine_weights pairs, the adapted policy and the
    starting one (adapters off), from the live model or from `named`, a state dict gathered earlier
    (rank 0's Self-Ref round under FSDP, where the others cannot join a collective)."""
    def stream(adapters):
        return lambda: engine_weights(model, adapters=adapters, named=named.items() if named else None)
    return stream(True), stream(False)


def peft_key(name):
    """model.layers.0.self_attn.q_proj.lora_A.default.weight -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"""
    return PEFT_PREFIX + name.replace(".default.", ".")


def adapter_state(model):
    """{PEFT key: fp32 CPU tensor} of every adapter: what a checkpoint stores. Under FSDP2 a
    collective (each adapter's shards are gathered), every rank gets the whole (small) dict."""
    state = {}
    for name, p in model.named_parameters():
        if is_adapter(name):
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            state[peft_key(name)] = t.float().cpu().contiguous()
    return state


def lora_config(model):
    """The LoraConfig peft injected with (rank, alpha, targets, dropout)."""
    return model.peft_config["default"]


def targets_of(model):
    """The short names of the targeted layers (peft records full module names once injected)."""
    return sorted({t.rsplit(".", 1)[-1] for t in lora_config(model).target_modules})


def save_adapter(model, state, folder):
    """adapter_config.json + adapter_model.safetensors in `folder` (PEFT's format), the base
    named as the model was loaded (its config's name_or_path)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    saved = lora_config(model)
    config = LoraConfig(r=saved.r, lora_alpha=saved.lora_alpha, lora_dropout=saved.lora_dropout, bias="none",
                        target_modules=targets_of(model),
                        task_type="CAUSAL_LM", base_model_name_or_path=model.config.name_or_path)
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    save_file(state, os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})


def load_adapter(model, folder):
    """Copy a saved adapter (save_adapter's folder) into a model that add_adapters gave the same
    rank and targets; before sharding. A missing, extra or misshapen tensor is a clear error."""
    from safetensors.torch import load_file

    path = os.path.join(folder, ADAPTER_WEIGHTS)
    try:
        saved = load_file(path)
    except Exception as e:  # noqa: BLE001 - unreadable file: one line naming it
        raise SystemExit(f"{path}: cannot read the adapters ({type(e).__name__}: {e})") from None
    params = {peft_key(n): p for n, p in model.named_parameters() if is_adapter(n)}
    if saved.keys() != params.keys():
        raise SystemExit(f"{path}: adapters do not match this model's LoRA layers (missing "
                         f"{sorted(params.keys() - saved.keys())[:3]}, unexpected {sorted(saved.keys() - params.keys())[:3]})")
    with torch.no_grad():
        for key, p in params.items():
            if saved[key].shape != p.shape:
                raise SystemExit(f"{path}: {key} is {tuple(saved[key].shape)}, the model's is {tuple(p.shape)}")
            p.copy_(saved[key])
    return model


def read_adapter(folder):
    """(state, rank, alpha, short target names) of a PEFT adapter folder: what
    rollout.VLLMRollout.push_adapters takes. An unreadable file is a one-line error naming it."""
    from safetensors.torch import load_file

    config, path = read_adapter_config(folder), os.path.join(folder, ADAPTER_WEIGHTS)
    try:
        state = load_file(path)
    except Exception as e:  # noqa: BLE001 - unreadable file: one line naming it
        raise SystemExit(f"{path}: cannot read the adapters ({type(e).__name__}: {e})") from None
    targets = config["target_modules"]
    targets = [targets] if isinstance(targets, str) else targets
    return state, config["r"], config["lora_alpha"], sorted({t.rsplit(".", 1)[-1] for t in targets})
