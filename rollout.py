"""Generation: one interface, two backends.

    engine = make_rollout("vllm", resolve_model())          # or "hf" (transformers .generate)
    groups = engine.generate([messages, "raw prompt"], n=4, temperature=0.6, max_tokens=128)
                                                            # n and temperature may also be lists,
                                                            # one value per prompt (greedy: 0)
    groups[0][2]  -> Sample(prompt_ids=[1, 9690, ...], response_ids=[17, 1232, ..., 2],
                            text="2 + 3 = 5 ...", finish_reason="stop", logprobs=[-0.41, ...])
    engine.push_weights(policy.state_dict())               # verified; raises on any mismatch
    policy, reference, tokenizer, engine = load_models(cfg, ...)   # what train.py's run starts with

A prompt is either chat messages (a list of {"role", "content"} dicts, rendered with the model's
chat template and a generation prompt) or a raw string. Both backends tokenise prompts with the
same `encode_prompt`, so their prompt ids are identical; the chat template gets the engine's
`chat_template_kwargs`, or a call's own (`generate(..., chat_template_kwargs={...})`: the
reflector's). `top_k` 0 (the default) is no top-k cut, as in vLLM's SamplingParams.
`response_ids` include the EOS token that ended a finished answer ("stop"); an answer cut by
`max_tokens` ends with finish_reason "length".

`stop` strings end an answer (kept at the end of its text, finish_reason "stop"). A chat prompt
whose last message is an assistant turn is a prefill that the answer continues.

`logprobs` (when asked) are the log-probabilities of the sampled tokens under the distribution
that was actually sampled from, i.e. after temperature, top-k and top-p (vLLM
"processed_logprobs", HF generate's processed scores); for greedy decoding that is the raw model
distribution.

GEPA's reflectors share one interface, `reflect(prompts) -> [(text, finished) | None, ...]`:
`EngineReflector` on an engine above (the current policy, the frozen starting weights swapped in,
or another local model) and `OpenAIReflector`, a model behind an OpenAI-compatible chat API
(vLLM's own server, or any hosted model) reached over HTTP. A test's scripted reflector is one
more object with that method.

The vLLM engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that `push_weights`
can hand tensors to its worker without serialising them. A push streams (name, tensor) pairs one
at a time (`dist.full_parameters` gathers one FSDP parameter at a time), so no full copy of the
model is ever held. Pushes are verified by comparing float64 checksums (count, sum, sum of
squares, all order-independent) of the engine's parameters with those of the tensors as they
went in, cast to the engine dtype: a push that loaded nothing, or the wrong values, raises
WeightPushError instead of letting generation continue on stale weights.

Seeds (`seed_requests`): a seeded call is reproducible and differs between the ranks of a
torchrun job. On CUDA every request carries its own `SamplingParams(seed=...)`, derived from
(call seed, rank, request index, child); on vLLM-CPU, which crashes on per-request seeds, the
global torch generator is seeded instead (details in `seed_requests`).
"""

import functools
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import types
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from tqdm import tqdm

import dist
import grpo
import lora
from config import packed_layout, reflector_chat_kwargs
from forward import response_hidden_mean, selected_logprobs
import gepa
from gepa import DELIM_CLOSE, DELIM_OPEN, reflector_framing
from model import resolve_model, use_packed_flex
from prompts import encode_prompt, problem_messages


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop token) | "length" (hit max_tokens)
    logprobs: list[float] | None = None  # one per response token, when asked


class WeightPushError(RuntimeError):
    """The inference engine does not hold the weights that were pushed."""


def _per_prompt(value, num_prompts):
    """One value (a sample count, a temperature) for every prompt, or a list with one per prompt."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * num_prompts
    if len(values) != num_prompts:
        raise ValueError(f"{len(values)} values for {num_prompts} prompts")
    return values


def checksum(tensors, dtype, chunk=1 << 24):
    """(count, sum, sum of squares) of tensors cast to `dtype`, accumulated in float64; all
    three are independent of element order, so a fused or repacked copy has the same values.
    Taken `chunk` elements at a time: vector_norm casts its input to float64 first, which for a
    whole 4B model's embedding would be a 3.1 GB copy; a chunk's is 128 MB."""
    count, total, squares = 0, 0.0, 0.0
    for t in tensors:
        flat = t.detach().reshape(-1)
        count += flat.numel()
        for part in flat.split(chunk):
            part = part.to(dtype)
            total += part.sum(dtype=torch.float64).item()  # accumulated in float64 without a copy
            squares += torch.linalg.vector_norm(part, dtype=torch.float64).item() ** 2
    return count, total, squares


def _engine_checksums(worker):
    """Runs inside the vLLM worker (collective_rpc): per-parameter checksums of the live model.
    Parameters emptied by a backend that repacked them (vLLM-CPU's oneDNN linears) are skipped.
    A vocabulary vLLM padded (to a multiple of 64: an embedding or head with org_vocab_size rows
    of its own) is checked on those rows when the padding rows are zero, as the loader leaves
    them; padding rows that are not zero keep the whole parameter, whose count then fails."""
    model = worker.model_runner.get_model()
    own_rows = {f"{n}.weight": m.org_vocab_size for n, m in model.named_modules() if hasattr(m, "org_vocab_size")}
    sums = {}
    for n, p in model.named_parameters():
        if p.numel() == 0:
            continue
        rows = own_rows.get(n, p.shape[0])
        if rows < p.shape[0] and not p[rows:].any():
            p = p[:rows]
        sums[n.replace(".base_layer.", ".")] = checksum([p], p.dtype)  # a LoRA engine wraps each layer: its base_layer
    return sums, dict(getattr(model, "packed_modules_mapping", {}))


def _engine_adapter_checksums(worker, adapter_id):
    """Runs inside the vLLM worker (collective_rpc): for each LoRA layer of the engine, the
    checksums of the slot that holds adapter `adapter_id`, as (A, B) summed over a fused layer's
    slices (q, k, v of qkv_proj). A slot is sized for max_lora_rank and zeroed before an adapter
    is copied in, so its padding adds nothing to the sums; whatever else it held would. None
    when no slot holds the adapter."""
    manager = worker.model_runner.lora_manager._adapter_manager
    if adapter_id not in manager.lora_index_to_id:
        return None
    slot = manager.lora_index_to_id.index(adapter_id)
    sums = {}
    for name, module in manager.modules.items():
        if hasattr(module, "lora_a_stacked"):
            a, b = [t[slot] for t in module.lora_a_stacked], [t[slot] for t in module.lora_b_stacked]
            sums[name] = (checksum(a, a[0].dtype)[1:], checksum(b, b[0].dtype)[1:])  # (sum, sum of squares)
    return sums, dict(getattr(manager.model, "packed_modules_mapping", {}))


def _refresh_packed_copies(worker):
    """Runs inside the vLLM worker after an in-place reload. vLLM-CPU keeps a packed copy of
    each embedding-class weight for its GEMM kernel; the layer-wise reload only repacks layers
    whose tensors arrived, so a tied LM head (its weight is the embedding, never pushed under
    its own name) would keep computing logits with the OLD packed weights. Repack it; then
    report every layer whose packed GEMM disagrees with its readable weight (should be none)."""
    model = worker.model_runner.get_model()
    stale = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_linear") or weight is None or weight.numel() == 0:
            continue
        if name.removesuffix(".base_layer").endswith("lm_head"):
            module.quant_method.process_weights_after_loading(module)
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(4, weight.shape[1], generator=gen).to(weight.dtype)
        got = module.cpu_linear(probe, weight, None).float()
        want = (probe.float() @ weight.float().T)
        if (got - want).abs().max().item() > 2e-2 * want.abs().max().item() + 1e-3:
            stale.append(name)
    return stale


def engine_name(hf_name, packed_modules_mapping):
    """HF checkpoint name -> the vLLM parameter it is loaded into (q/k/v -> qkv_proj, ...)."""
    for fused, parts in packed_modules_mapping.items():
        for part in parts:
            if f".{part}." in hf_name:
                return hf_name.replace(f".{part}.", f".{fused}.")
    return hf_name


def _sampled_logprob(entry, token_id):
    return entry[token_id].logprob


def named_tensors(weights):
    """A state dict, or an iterable of (name, tensor) pairs (e.g. dist.full_parameters), as pairs."""
    return weights.items() if isinstance(weights, dict) else weights


class PreparedWeights:
    """Weights pushed many times (Self-Ref swaps the starting weights in and the policy back for
    every reflection call), prepared once: each tensor cast to the engine's dtype (in pinned
    host memory on CUDA, so the copy to the GPU is a plain DMA) with its push checksum. A push
    of these skips the cast and the checksum of what goes in; the engine's side is still read
    and compared. `weights`: a state dict, (name, tensor) pairs, or a function giving them.
    Iterates as (name, tensor) pairs, so any engine's push_weights takes it."""

    def __init__(self, weights, dtype=None):
        pin = torch.cuda.is_available()
        self.tensors, self.sums = [], {}
        for name, tensor in named_tensors(weights() if callable(weights) else weights):
            # to host memory first: the policy's own tensors are on the GPU in one process, and only
            # dense CPU tensors can be pinned (a GPU copy of the whole model would also cost its memory)
            tensor = tensor.detach().to("cpu", dtype or tensor.dtype, copy=True)
            if pin:
                tensor = tensor.pin_memory()
            self.tensors.append((name, tensor))
            self.sums[name] = checksum([tensor], tensor.dtype)

    def __iter__(self):
        return iter(self.tensors)


def request_seed_base(seed, rank):
    """The first per-request seed of a call seeded `seed` on `rank`: a 48-bit hash of both, so
    that calls with nearby seeds (consecutive steps) or on other ranks start far apart and the
    seeds of one call (base + 0, 1, 2, ...) never run into another call's."""
    digest = hashlib.blake2b(f"{seed}/{rank}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


def generator_seed(seed, rank):
    """The torch generator seed of a seeded call on `rank` (vLLM-CPU, HF generate): the call
    seed itself on rank 0 (what a single process uses), request_seed_base(seed, rank) on the
    others. Not seed + rank x a large stride: torch's CPU generator (mt19937) keeps only the
    low 32 bits of its seed, so such ranks would draw the same stream."""
    return seed if rank == 0 else request_seed_base(seed, rank)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM 0.32's max_lora_rank accepts (config/lora.py)


def engine_lora_rank(rank):
    """The max_lora_rank an engine needs for adapters of rank `rank`: the smallest that vLLM
    accepts and that is not below it (vLLM refuses an adapter above max_lora_rank, default 16)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")


def _same_sums(got, want):
    """Two (sum, sum of squares) pairs equal up to float64 summation order."""
    tolerance = 1e-9 * max(want[1], got[1], 1.0)
    return abs(got[0] - want[0]) <= tolerance and abs(got[1] - want[1]) <= tolerance


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # vLLM's in-place reload (0.32)


class NeverLoadedLayers(logging.Filter):
    """vLLM's layer-wise reload warns "<Layer>: Failed to load weights" for every layer that got
    no tensor, on every push. Some never get one, by design: a rotary embedding (its cos/sin
    cache is computed, no checkpoint holds it) and, with tied embeddings, the LM head (its
    weight is the embedding, pushed under that name). Their warnings are dropped; any other
    layer still warns, and the checksums decide whether a push holds."""

    def __init__(self, tied_head):
        super().__init__()
        self.tied_head = tied_head

    def filter(self, record):
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        return not (layer.endswith("RotaryEmbedding") or (self.tied_head and layer == "ParallelLMHead"))


class ContextError(ValueError):
    """A generate request whose prompt plus max_tokens exceeds the engine's context."""


class VLLMRollout:
    """In-process vLLM engine. CPU defaults (KV cache size, no reserved core) come from
    `kv_cache_gib`; on a GPU `gpu_memory_utilization` sizes the cache instead, and with
    `sleep_level` > 0 the engine can free its memory while the trainer runs (`sleep` / `wake`).
    external_launcher: the process was started by torchrun and is one of several trainers,
    each with its own engine (tensor parallel size 1): vLLM then places this engine on the
    rank's own device (LOCAL_RANK) and joins the process group torchrun set up instead of
    starting its own. `rank` makes seeded calls differ between ranks (seed_requests); the engine
    itself is seeded with seed + rank. enforce_eager: no CUDA graphs (vLLM-CPU always runs eager:
    its compiled mode took ~110 s to start here for little gain). `llm`: an LLM already built
    (tests pass a stand-in), with `cpu` saying which platform it behaves as.
    max_model_len: the context (prompt + answer tokens); None = the model's own maximum. A
    request that cannot fit, its prompt plus max_tokens, is an error (ContextError), never an
    answer cut short by the context (train.py and eval.py size it from their data).

    lora_rank > 0: the engine serves a LoRA policy as vLLM's own LoRA, the base weights (the
    model at model_path, never moved) plus the adapters of the last push_adapters, applied
    unmerged to every generate call (adapters=False: the base alone). Merging W + (alpha/r) B A
    into bf16 weights instead rounds every update below half a bf16 step of W back to W, and
    after ~100 Adam steps at 1e-5 that is most of them: the engine would sample close to the
    starting policy (docs/GPU.md "LoRA")."""

    def __init__(self, model_path, dtype="bfloat16", max_model_len=None, seed=0, kv_cache_gib=1,
                 gpu_memory_utilization=0.5, enforce_eager=True, sleep_level=0, chat_template_kwargs=None,
                 external_launcher=False, progress_bars=True, rank=0, llm=None, cpu=None, lora_rank=0):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: needed by push_weights
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))  # whole GiB
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        if cpu is None:
            from vllm.platforms import current_platform  # lazy: importing vLLM takes seconds

            cpu = current_platform.is_cpu()
        self.is_cpu, self.rank = cpu, rank
        self.sleep_level = 0 if self.is_cpu else sleep_level  # vLLM-CPU has no sleep mode
        if llm is None:
            from vllm import LLM

            kwargs = {} if self.is_cpu else {"gpu_memory_utilization": gpu_memory_utilization,
                                             "enable_sleep_mode": self.sleep_level > 0}
            if external_launcher:
                kwargs["distributed_executor_backend"] = "external_launcher"
            if lora_rank:  # one adapter at a time: the policy's latest
                kwargs.update(enable_lora=True, max_lora_rank=engine_lora_rank(lora_rank), max_loras=1)
            llm = LLM(model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed + rank,
                      enforce_eager=enforce_eager or self.is_cpu, logprobs_mode="processed_logprobs",
                      use_tqdm_on_load=progress_bars, **kwargs)
        self.llm = llm
        self.lora_rank, self.adapter, self._adapter_dir = lora_rank, None, None  # adapter: a vLLM LoRARequest
        self.tokenizer = llm.get_tokenizer()
        self.chat_template_kwargs = chat_template_kwargs
        self.asleep = set()  # what sleep() released: "weights", "kv_cache"
        model_config = llm.llm_engine.model_config
        self.dtype = model_config.dtype  # the engine's weights (a torch dtype once vLLM resolved "auto")
        self.max_model_len = model_config.max_model_len
        self.tied_embeddings = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
        reload_logger = logging.getLogger(RELOAD_LOGGER)
        for old in [f for f in reload_logger.filters if isinstance(f, NeverLoadedLayers)]:
            reload_logger.removeFilter(old)  # one engine a process: its own model decides
        reload_logger.addFilter(NeverLoadedLayers(self.tied_embeddings))

    def seed_requests(self, params, seed):
        """The one place a generate call is seeded (seed None: unseeded).

        CUDA (Model Runner V2 samples with a hash of a per-request seed; an unseeded request
        draws its seed from numpy, seeded alike on every rank): request i gets
        request_seed_base(seed, rank) + the number of samples of the requests before it, and
        vLLM gives its child j that seed + j (v1/engine/parallel_sampling.py). Every sample of a
        call has its own seed, so its sampling noise does not depend on the batch; the logits it
        perturbs do (CUDA kernels are not batch-invariant unless VLLM_BATCH_INVARIANT=1, and a
        repeated call may prefill less from the prefix cache): a repeat reproduces most samples,
        not all of them bit for bit (docs/GPU.md "Seeds").

        vLLM-CPU: per-request seeds crash vLLM-CPU 0.32 whenever chunked prefill discards a
        sampled token ("CPU Generator does not use offset"). The engine runs in this process and
        samples from torch's global generator, so seeding that (generator_seed(seed, rank))
        makes a call reproducible. Its draws depend on how the scheduler batches requests, which
        depends on what the prefix cache holds: empty it so that equal calls are scheduled,
        hence sampled, identically."""
        if seed is None:
            return
        if not self.is_cpu:
            offset, base = 0, request_seed_base(seed, self.rank)
            for p in params:
                p.seed = base + offset
                offset += p.n
            return
        self.llm.reset_prefix_cache()
        torch.manual_seed(generator_seed(seed, self.rank))

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=256, seed=None,
                 logprobs=False, ignore_eos=False, progress=False, stop=None, top_k=0, chat_template_kwargs=None,
                 adapters=True):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake()
        kwargs = self.chat_template_kwargs if chat_template_kwargs is None else chat_template_kwargs
        ids = [encode_prompt(self.tokenizer, p, kwargs) for p in prompts]
        longest = max(map(len, ids), default=0)
        if longest + max_tokens > self.max_model_len:
            raise ContextError(f"a prompt of {longest} tokens + max_tokens={max_tokens} does not fit the engine's context "
                               f"of {self.max_model_len} tokens (max_model_len): its answer would be cut short")
        params = [SamplingParams(n=k, temperature=t, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                 logprobs=0 if logprobs else None, ignore_eos=ignore_eos,
                                 stop=stop, include_stop_str_in_output=True)
                  for k, t in zip(_per_prompt(n, len(prompts)), _per_prompt(temperature, len(prompts)))]
        self.seed_requests(params, seed)
        lora = {"lora_request": self.adapter} if adapters and self.adapter else {}  # none: the base model
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=progress, **lora)
        groups = []
        for prompt_ids, out in zip(ids, outputs):
            group = []
            for c in out.outputs:
                lp = None
                if logprobs:
                    lp = [_sampled_logprob(e, t) for e, t in zip(c.logprobs, c.token_ids)]
                group.append(Sample(list(prompt_ids), list(c.token_ids), c.text,
                                    "length" if c.finish_reason == "length" else "stop", lp))
            groups.append(group)
        return groups

    def close(self):
        """Shut the engine down. Under torchrun (external_launcher) vLLM's shutdown also leaves
        the process group it shares with the trainer, so call this before the trainer's own
        teardown, never after (its subgroups must go before the group they belong to)."""
        self.llm.llm_engine.engine_core.shutdown()
        if self._adapter_dir:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)

    def sleep(self):
        """GPU: free the KV cache and move the weights off the GPU (level 1) or drop them (level 2)
        while the trainer needs the memory. A no-op on the CPU or with sleep_level 0."""
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = {"weights", "kv_cache"}

    def wake(self, part=None):
        """Map back what sleep() released: `part` ("weights" or "kv_cache") alone, or (None)
        everything. torch's cached free blocks are released first, so that vLLM can map its
        memory again (TRL and verl do the same)."""
        parts = sorted(self.asleep) if part is None else [part] if part in self.asleep else []
        if not parts:
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=parts)
        self.asleep -= set(parts)

    def push_weights(self, weights):
        """Load HF-named tensors (a state dict, or (name, tensor) pairs consumed one at a time,
        e.g. dist.full_parameters(policy)) into the running engine in place, then verify the load.

        Order (TRL's and verl's): wake the weights only, stream the tensors in, each cast to
        the engine dtype and checksummed as it goes, reset the prefix cache (its blocks were
        computed with the old weights), then wake the KV cache: the KV cache is never mapped
        while the trainer's tensors are. A tied LM head is the embedding: `lm_head.weight` is
        not sent (sending it would copy a vocabulary x hidden matrix for nothing).

        Verification: every readable engine parameter must equal (as float64 checksums) what
        went into it. On GPU that is every parameter; on vLLM-CPU the linear layers are repacked
        into opaque oneDNN buffers, leaving embeddings and norms to check, plus a probe that each
        remaining packed copy (the LM head) computes with its current weight. vLLM's warnings
        about layers that never receive a tensor are filtered (NeverLoadedLayers)."""
        self.wake("weights")
        sent = {}  # HF name -> checksum of the tensor as it went in

        prepared = isinstance(weights, PreparedWeights) and all(t.dtype == self.dtype for _, t in weights)

        def stream():
            for name, tensor in named_tensors(weights):
                if self.tied_embeddings and name == "lm_head.weight":
                    continue
                if prepared:  # cast and summed once (Self-Ref's weights, pushed for every reflection)
                    sent[name] = weights.sums[name]
                else:
                    tensor = tensor.detach().to(self.dtype)
                    sent[name] = checksum([tensor], self.dtype)
                if not math.isfinite(sent[name][2]):  # a NaN or inf anywhere makes the sum of squares one
                    raise WeightPushError(f"{name} holds NaN or inf: refused before it reached the engine")
                yield name, tensor

        items = stream()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        for _ in items:  # what a loader left untaken still counts as sent (and is gathered: FSDP lock-step)
            pass
        if self.llm.reset_prefix_cache() is False:  # False: blocks still in use (never between generate calls)
            raise WeightPushError("vLLM did not empty its prefix cache after the push: cached blocks hold the old weights")
        self.wake("kv_cache")
        if self.is_cpu:
            (stale,) = self.llm.collective_rpc(_refresh_packed_copies)
            if stale:
                raise WeightPushError(f"packed GEMM copies of {stale} do not match their weights")
        (got, mapping), = self.llm.collective_rpc(_engine_checksums)
        pushed = {}
        for name, (count, total, squares) in sent.items():  # fused parameters (qkv_proj) add up their parts
            c, t, s = pushed.get(engine_name(name, mapping), (0, 0.0, 0.0))
            pushed[engine_name(name, mapping)] = (c + count, t + total, s + squares)
        for name, (count, total, squares) in got.items():
            if name not in pushed:
                raise WeightPushError(f"engine parameter {name} was not in the pushed state dict")
            e_count, e_total, e_squares = pushed[name]
            if count != e_count or abs(total - e_total) > 1e-9 * max(e_squares, 1.0) \
                    or abs(squares - e_squares) > 1e-9 * max(e_squares, 1.0):
                raise WeightPushError(
                    f"engine parameter {name} does not hold the pushed values: "
                    f"(count, sum, sumsq) = {(count, total, squares)} vs {(e_count, e_total, e_squares)}")
        return {"pushed": len(sent), "verified": len(got)}

    def push_adapters(self, state, rank, alpha, targets):
        """LoRA: serve the base with these adapters from the next generate call on (lora_rank > 0).
        `state`: {PEFT key (base_model.model.<module>.lora_A.weight): tensor} as lora.adapter_state
        gives it; rank, alpha and the short target names (q_proj, ...) as the policy's LoraConfig.

        The adapters go to vLLM as a new LoRA adapter (a PEFT folder written to a temporary
        folder, a fresh adapter id, so no prefix-cache block of an older one is ever reused), with
        (alpha/r) B computed in fp32 and rounded once to the engine's dtype (the folder says
        alpha = r, so vLLM scales nothing again); the previous adapter is then dropped. Verified
        as push_weights is: every LoRA layer's slot in the engine must hold, as float64 checksums,
        exactly the A and B that went in (nothing, for a layer no tensor was sent to), and every
        sent tensor must have a layer; a push that loaded nothing or the wrong values raises
        WeightPushError and the engine keeps serving the previous adapter."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not self.lora_rank:
            raise WeightPushError("this engine was started without LoRA (lora_rank=0): it cannot take adapters")
        tensors, sent = {}, []  # sent: (module, "A" or "B", (sum, sum of squares)) of each tensor as it went in
        for key, tensor in state.items():
            if ".lora_A." not in key and ".lora_B." not in key:
                raise WeightPushError(f"{key} is not a LoRA adapter tensor (.lora_A. or .lora_B.)")
            kind = "A" if ".lora_A." in key else "B"
            tensor = tensor.detach().to("cpu", torch.float32)
            tensor = (tensor * (alpha / rank) if kind == "B" else tensor).to(self.dtype).contiguous()
            tensors[key] = tensor
            module = key.removeprefix("base_model.model.").split(f".lora_{kind}.")[0]
            sent.append((module, kind, checksum([tensor], self.dtype)[1:]))
            if not math.isfinite(sent[-1][2][1]):
                raise WeightPushError(f"{key} holds NaN or inf: refused before it reached the engine")
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.mkdtemp(prefix="p2o-adapters-")
        number = (self.adapter.lora_int_id if self.adapter else 0) + 1
        folder = os.path.join(self._adapter_dir, f"{number:06d}")
        os.makedirs(folder)
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:  # the fields vLLM's PEFTHelper reads
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sorted(targets),
                       "bias": "none", "task_type": "CAUSAL_LM"}, f)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        request = LoRARequest(f"policy-{number}", number, folder)
        self.wake("weights")  # the slots live beside the weights
        try:
            self.llm.llm_engine.add_lora(request)
            verified = self._verify_adapter(request, sent)
        except BaseException:
            self.llm.llm_engine.remove_lora(number)
            shutil.rmtree(folder, ignore_errors=True)
            raise
        finally:
            self.llm.reset_prefix_cache()
            self.wake("kv_cache")
        previous, self.adapter = self.adapter, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return {"pushed": len(tensors), "verified": verified}

    def _verify_adapter(self, request, sent):
        """Every LoRA slot of the engine against `sent` (push_adapters'), the parts of a fused layer
        added up; raises WeightPushError on a difference, else returns the number of layers checked."""
        (report,) = self.llm.collective_rpc(_engine_adapter_checksums, args=(request.lora_int_id,))
        if report is None:
            raise WeightPushError(f"no LoRA slot of the engine holds adapter {request.lora_name}")
        got, mapping = report
        pushed = {}  # engine layer -> {"A": (sum, sumsq), "B": ...} of the parts that went into it
        for module, kind, (total, squares) in sent:
            into = pushed.setdefault(engine_name(f"{module}.weight", mapping).removesuffix(".weight"), {})
            old = into.get(kind, (0.0, 0.0))
            into[kind] = (old[0] + total, old[1] + squares)
        if pushed.keys() - got.keys():
            raise WeightPushError(f"adapters for layers the engine has no LoRA slot for: {sorted(pushed.keys() - got.keys())[:3]}")
        for layer, (a, b) in got.items():
            want = pushed.get(layer, {})
            for kind, have in (("A", a), ("B", b)):
                if not _same_sums(have, want.get(kind, (0.0, 0.0))):
                    raise WeightPushError(f"LoRA layer {layer} does not hold the pushed {kind}: (sum, sumsq) = "
                                          f"{have} vs {want.get(kind, (0.0, 0.0))}")
        return len(got)


class AdaptersOff:
    """A LoRA engine's base model alone: generate() without the adapters (Self-Ref's starting
    policy, with no weights swapped in or out)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, **kwargs):
        return self.engine.generate(prompts, adapters=False, **kwargs)


class HFRollout:
    """transformers `generate` on a local model; the reference backend and the fallback."""

    def __init__(self, model_path, dtype="float32", seed=0, batch_size=32, model=None, tokenizer=None,
                 chat_template_kwargs=None, rank=0):
        from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: transformers takes seconds to import

        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_path)
        self.model = model or AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.eval()
        self.shares_weights = model is not None  # a push into it changes the caller's model too
        self.batch_size, self.rank = batch_size, rank
        self.chat_template_kwargs = chat_template_kwargs
        torch.manual_seed(seed)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else self.tokenizer.eos_token_id])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)

    @torch.no_grad()
    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=256, seed=None,
                 logprobs=False, ignore_eos=False, progress=False, stop=None, top_k=0, chat_template_kwargs=None):
        if seed is not None:  # as VLLMRollout on the CPU: ranks draw different streams
            torch.manual_seed(generator_seed(seed, self.rank))
        kwargs = self.chat_template_kwargs if chat_template_kwargs is None else chat_template_kwargs
        ids = [encode_prompt(self.tokenizer, p, kwargs) for p in prompts]
        counts, temperatures = _per_prompt(n, len(prompts)), _per_prompt(temperature, len(prompts))
        flat = [(x, t) for x, k, t in zip(ids, counts, temperatures) for _ in range(k)]  # groups contiguous
        samples = [None] * len(flat)
        for t in dict.fromkeys(temperatures):  # one temperature a batch
            rows = [i for i, (_, ti) in enumerate(flat) if ti == t]
            for s in tqdm(range(0, len(rows), self.batch_size), desc="hf generate", disable=not progress):
                batch = rows[s:s + self.batch_size]
                for i, sample in zip(batch, self._generate_batch([flat[i][0] for i in batch], t, top_p, top_k,
                                                                 max_tokens, logprobs, ignore_eos, stop)):
                    samples[i] = sample
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        return [samples[o:o + k] for o, k in zip(offsets, counts)]

    def _generate_batch(self, batch, temperature, top_p, top_k, max_tokens, logprobs, ignore_eos, stop):
        width = max(map(len, batch))
        device = self.model.device
        input_ids = torch.tensor([[self.pad_id] * (width - len(x)) + x for x in batch], device=device)  # left pad
        attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=device)
        sampling = temperature > 0
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention, max_new_tokens=max_tokens,
            min_new_tokens=max_tokens if ignore_eos else 0, do_sample=sampling,
            temperature=temperature if sampling else None, top_p=top_p if sampling else None,
            top_k=top_k if sampling else None, pad_token_id=self.pad_id,  # top_k 0: off, as in vLLM
            output_scores=logprobs, return_dict_in_generate=True,
            stop_strings=stop, tokenizer=self.tokenizer if stop else None)
        new = out.sequences[:, width:]  # [b, T_new]
        if logprobs:
            scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # [b, T_new, V]
            token_lp = scores.gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [b, T_new]
        result = []
        for row, prompt in enumerate(batch):
            tokens = new[row].tolist()
            end = next((i + 1 for i, t in enumerate(tokens) if t in self.eos_ids and not ignore_eos), None)
            finish = "stop" if end is not None else "length"
            tokens = tokens[:end] if end is not None else tokens
            lp = token_lp[row, :len(tokens)].tolist() if logprobs else None
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            hits = [text.find(x) + len(x) for x in stop or () if x in text]
            if hits:  # stopped by a stop string (kept in the text, as vLLM's include_stop_str_in_output)
                text, finish = text[:min(hits)], "stop"
            result.append(Sample(list(prompt), tokens, text, finish, lp))
        return result

    def sleep(self):  # the HF backend shares or owns plain weights: nothing to free
        pass

    def wake(self):
        pass

    @torch.no_grad()
    def push_weights(self, weights):
        """Copy HF-named tensors (a state dict or (name, tensor) pairs, taken one at a time) into
        the model; every parameter must arrive (a tied LM head is the embedding: lm_head.weight
        may come or not). A state dict's persistent buffers are copied too."""
        params = dict(self.model.named_parameters())  # a tied head appears once, as the embedding
        buffers = dict(self.model.named_buffers())
        for name, tensor in named_tensors(weights):
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise WeightPushError(f"{name} holds NaN or inf: refused before it reached the engine")
            if name in params:
                params.pop(name).copy_(tensor)
            elif name in buffers:
                buffers[name].copy_(tensor)
            elif name != "lm_head.weight":
                raise WeightPushError(f"the model has no parameter {name}")
        if params:
            raise WeightPushError(f"not pushed: {sorted(params)}")
        return {"parameters": sum(p.numel() for p in self.model.parameters())}


def make_rollout(backend, model_path, **kwargs):
    if backend == "vllm":
        return VLLMRollout(model_path, **kwargs)
    if backend == "hf":
        return HFRollout(model_path, **kwargs)
    raise ValueError(f"unknown rollout backend {backend!r} (vllm | hf)")


def context_length(cfg, tokenizer, problems, chat_kwargs, longest_prompt=None):
    """vLLM's max_model_len: --max_model_len, or (0) the longest prompt the run can send plus
    its answer. Training and GEPA prompts: the longest data prompt + the longest template
    (gepa.max_template_length, counted as one token a character, plus the blank line) +
    max_tokens. P²O reflection prompts (either --reflect_prompt): the meta-prompt with the
    longest problems and answers of the data (gepa.longest_reflection_prompt) under the
    reflector's chat template arguments (reflector_chat_kwargs, else chat_kwargs), plus the parts
    cut to a length in characters, one token each (gepa.reflection_cut_chars: the parent template,
    the answers and extracted answers), + reflect_max_tokens. `longest_prompt`: the data prompt's
    length when the caller measured it already (check_fit)."""
    if cfg.max_model_len:
        return cfg.max_model_len
    if longest_prompt is None:
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


def check_fit(cfg, problems, chat_kwargs):
    """Before the run folder and any weights, from the model's config and tokenizer alone: the
    LoRA targets are linear layers of its decoder (lora.target_names on a meta-device copy), and
    the longest prompt the run can send plus its answer (context_length) fits its positions; a
    problem too long for that is named. -> vLLM's context (context_length) for load_models, so that the
    problems are tokenised once; None with the HF backend or when the model's positions are unknown."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # lazy: seconds to import

    model_path = resolve_model(cfg.model)
    config = AutoConfig.from_pretrained(model_path)
    if cfg.lora_rank:
        with torch.device("meta"):
            lora.target_names(AutoModelForCausalLM.from_config(config), cfg.lora_targets)
    positions = getattr(config, "max_position_embeddings", None)
    if not positions or not problems:
        return None
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    lengths = {p.id: len(encode_prompt(tokenizer, problem_messages(p, fmt=cfg.prompt_format), chat_kwargs))
               for p in problems}
    longest = max(problems, key=lambda p: lengths[p.id])
    # vLLM is started with the whole context (and refuses one past the positions); HF generates what it is given
    context = context_length(cfg, tokenizer, problems, chat_kwargs, lengths[longest.id]) if cfg.backend == "vllm" \
        else None
    need = context or lengths[longest.id] + cfg.max_tokens
    if need > positions:
        raise SystemExit(f"the run needs a context of {need:,} tokens, over the model's {positions:,} positions: "
                         f"--max_model_len, or the longest prompt (problem {longest.id}, {lengths[longest.id]:,} "
                         f"tokens) + templates and reflections + --max_tokens={cfg.max_tokens}")
    return context


def engine_lora(cfg):
    """The rank a vLLM engine serves LoRA adapters at for this run (0: none). A 16-bit engine needs
    vLLM's LoRA: a merge into bf16 weights rounds most of a small update away (docs/GPU.md "LoRA in
    the engine"). An fp32 engine holds the fp32 merge exactly and takes merged pushes instead, which
    on vLLM-CPU also generates ~10x faster (its LoRA ops are a reference implementation)."""
    return cfg.lora_rank if cfg.engine_dtype != "float32" else 0


def start_engine(cfg, model_path, tokenizer, problems, chat_kwargs, device, policy=None, context=None):
    """The rollout engine train.py's settings name (`cfg`), holding `model_path`'s weights: vLLM,
    its context sized for `problems` (context_length, unless given as `context`), or the HF backend, which in one
    process without LoRA generates with `policy` itself. Under torchrun each rank starts its own."""
    if cfg.backend == "hf":
        shared = None if dist.active() or cfg.lora_rank else policy
        engine = HFRollout(model_path, model=shared, tokenizer=tokenizer, chat_template_kwargs=chat_kwargs,
                           rank=dist.rank())
        engine.model.to(device)
        return engine
    return make_rollout(cfg.backend, model_path, dtype=cfg.engine_dtype, seed=cfg.seed,
                        max_model_len=context or context_length(cfg, tokenizer, problems, chat_kwargs),
                        kv_cache_gib=cfg.kv_cache_gib, gpu_memory_utilization=cfg.gpu_memory_utilization,
                        sleep_level=cfg.vllm_sleep_level, enforce_eager=cfg.enforce_eager,
                        chat_template_kwargs=chat_kwargs, external_launcher=dist.active(),
                        progress_bars=cfg.verbose, rank=dist.rank(), lora_rank=engine_lora(cfg))


def load_models(cfg, model_path, weights_path, engine, device, problems, chat_kwargs, context=None):
    """The policy (fp32 master weights on `device`; under torchrun sharded with FSDP2), the
    frozen reference (kl_beta > 0 only; not sharded: it has no gradients or optimizer state),
    the tokenizer and the rollout engine, which starts from (or is pushed) the policy's
    weights. vLLM's context is sized for `problems` (context_length; `context`: check_fit's). Under torchrun every
    rank has its own engine; an HF engine then holds its own unsharded copy of the weights.

    LoRA: the policy is lora.load_policy's, the reference the policy read with its adapters off,
    the engine starts from the base (a vLLM engine with LoRA on, serving the adapters of each push)
    and is pushed the policy (lora.push_policy) on resume."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: transformers takes seconds to import

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if cfg.lora_rank:
        policy = lora.load_policy(cfg, model_path, weights_path, device)
    else:
        policy = AutoModelForCausalLM.from_pretrained(weights_path, dtype=torch.float32).to(device)
    if cfg.shared_prompt and packed_layout(cfg, device.type)[1] == "flex":
        use_packed_flex(policy)
    attention = policy.config._attn_implementation
    if cfg.shared_prompt and attention not in grpo.PACKED_ATTENTION:
        raise SystemExit(f"--shared_prompt=True packs rows with a 4D attention mask, which {attention!r} attention "
                         f"does not take; use a model that loads with {' or '.join(grpo.PACKED_ATTENTION)}, "
                         "or --shared_prompt=False")
    policy.train()
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.selected_logprobs = types.MethodType(selected_logprobs, policy)  # the trainer's forwards (forward.py)
    policy.response_hidden_mean = types.MethodType(response_hidden_mean, policy)
    policy = dist.shard(policy, forward_methods=("selected_logprobs", "response_hidden_mean"))
    reference = policy if cfg.kl_beta > 0 and cfg.lora_rank else None  # LoRA: read with its adapters off
    if cfg.kl_beta > 0 and not cfg.lora_rank:
        reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
        reference.requires_grad_(False)
        if policy.config._attn_implementation == grpo.PACKED_FLEX:
            use_packed_flex(reference)
    holds = model_path  # the weights the engine holds: a given engine has cfg.model's
    if engine is None:
        holds = model_path if cfg.lora_rank else weights_path  # a LoRA checkpoint holds adapters, not a model
        engine = start_engine(cfg, holds, tokenizer, problems, chat_kwargs, device, policy, context)
    if holds != weights_path:  # a resume moved on from what the engine holds
        lora.push_policy(engine, policy)
    return policy, reference, tokenizer, engine


def greedy_answers(engine, max_tokens):
    """GEPA's answering on one engine: chat prompts -> [(text, response tokens, prompt tokens)],
    greedy, so an answer is a function of its prompt (train.py shares each call over every
    rank's engine with dist.shared_map)."""
    def answer(prompts):
        out = engine.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens)
        return [(g[0].text, len(g[0].response_ids), len(g[0].prompt_ids)) for g in out]
    return answer


class EngineReflector:
    """GEPA's reflector on a rollout engine (Self-Ref, Policy-Ref, or a local Teacher-Ref).

        reflector = EngineReflector(engine, temperature=0.8, max_tokens=120, seed=0, counts=run_counts)
        reflector.reflect([meta_prompt, ...]) -> [("<template>Multiply first.</template>", True), ...]

    `engine` answers as it is (the training engine: the current policy; another model's
    engine: a teacher), or, with `swap` (a state dict, e.g. the frozen starting weights), holds
    `swap` for the call and `restore` (the policy's state dict) again after it, even when the
    call fails. Either may instead be a function returning (name, tensor) pairs, called at each
    push (a LoRA policy streams its weights merged, or its base alone, with no copy held). By
    default (prefill, stop None) the answer is prefilled with gepa's opening delimiter and stops
    at the closing one: a small reflector rarely writes the delimiters by
    itself. gepa.reflector_framing(cfg) gives both per --reflect_prompt; the official prompt's
    (prefill "", stop []) sends the prompt as the one user message and reads the whole reply.
    The returned text starts with the prefill; `finished` is False when the reply ran out of tokens
    first. Seeds: self.seed for a call, advanced by its number of prompts. top_p, top_k (0: off)
    and chat_template_kwargs (None: the engine's own; e.g. {"enable_thinking": True}) go to
    every generate call. A reply that thinks keeps its think block: the official parser reads
    past it (gepa.reply_after_thought).
    Generated tokens are policy compute: counts["reflection_tokens"]."""

    def __init__(self, engine, temperature=0.8, max_tokens=120, seed=0, counts=None, swap=None, restore=None,
                 prefill=None, stop=None, top_p=1.0, top_k=0, chat_template_kwargs=None):
        if (swap is None) != (restore is None):
            raise ValueError("swap and restore go together: the weights to reflect with and those to put back")
        self.engine, self.temperature, self.max_tokens, self.seed = engine, temperature, max_tokens, seed
        self.top_p, self.top_k, self.chat_template_kwargs = top_p, top_k, chat_template_kwargs
        self.counts = Counter() if counts is None else counts
        self.swap, self.restore = swap, restore
        self.prefill = DELIM_OPEN if prefill is None else prefill
        self.stop = [DELIM_CLOSE] if stop is None else list(stop)

    def reflect(self, prompts):
        # an engine that holds the policy's own tensors (the HF backend in one process) would lose
        # them to the swap: put back a copy. vLLM copies what it is pushed: `restore` as it is
        current = self.restore
        if self.swap is not None and getattr(self.engine, "shares_weights", False) and isinstance(current, dict):
            current = {k: v.detach().clone() for k, v in self.restore.items()}
        if self.swap is not None:
            self.engine.push_weights(self.swap() if callable(self.swap) else self.swap)
        # an empty prefill sends no assistant turn at all: an empty one would be continued, not opened
        prefill = [{"role": "assistant", "content": self.prefill}] if self.prefill else []
        try:
            out = self.engine.generate(
                [[{"role": "user", "content": p}, *prefill] for p in prompts],
                n=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens,
                seed=self.seed, stop=self.stop or None, chat_template_kwargs=self.chat_template_kwargs)
        finally:
            if self.swap is not None:
                self.engine.push_weights(current() if callable(current) else current)
        self.seed += len(prompts)
        self.counts["reflection_tokens"] += sum(len(g[0].response_ids) for g in out)
        self.counts["reflection_prefill_tokens"] += sum(len(g[0].prompt_ids) for g in out)
        return [(self.prefill + g[0].text, g[0].finish_reason == "stop") for g in out]


class ReflectorError(RuntimeError):
    """The reflector server cannot be used at all (unreachable, or not an OpenAI-compatible API)."""


class OpenAIReflector:
    """A reflector behind an OpenAI-compatible /chat/completions API (Teacher-Ref).

        teacher = OpenAIReflector("http://localhost:8000/v1", model="", api_key_env="OPENAI_API_KEY",
                                  temperature=0.8, max_tokens=120, seed=0, counts=run_counts)
        teacher.reflect([meta_prompt, ...])
        -> [(text, finished) or None, ...], with teacher.calls, .failures, .tokens updated and
           counts["teacher_failures"], counts["teacher_tokens"] (cost, not policy compute)

    The constructor asks the server for its models (/models) and raises ReflectorError with the
    reason when it is unreachable or answers something else; model '' takes the first model it
    serves. Each prompt is one request with `timeout` seconds; a connection error, a timeout, a
    429 or a 5xx is retried `retries` times with exponential backoff, anything else (another 4xx,
    a body that is not a chat completion) is not. A prompt that still fails gives None: the
    caller counts and skips it. The teacher writes the delimiters itself (no prefill: hosted APIs
    do not continue an assistant turn). The API key is read from the environment variable
    `api_key_env` and only ever sent in the Authorization header.

    Sampling and the chat template: the body always carries temperature, max_tokens and seed;
    top_p only below 1, top_k only above 0 and chat_template_kwargs only when given (vLLM's server
    reads these fields; a hosted API may refuse ones it does not know), so that by default the
    server's own defaults apply (`vllm serve`: the model's generation_config, e.g. Qwen3's top_p
    0.95, top_k 20). A reply whose `content` is null (a server's reasoning parser found a thought
    and nothing after it) gives the thought (`reasoning_content`, or vLLM's newer `reasoning`), as
    the reference code's client does."""

    def __init__(self, base_url, model="", api_key_env="OPENAI_API_KEY", timeout=60.0, retries=3, backoff=1.0,
                 workers=4, temperature=0.8, max_tokens=120, seed=0, counts=None, top_p=1.0, top_k=0,
                 chat_template_kwargs=None):
        self.base_url, self.timeout, self.retries, self.backoff = base_url.rstrip("/"), timeout, retries, backoff
        self._key, self.workers = os.environ.get(api_key_env, ""), workers
        self.temperature, self.max_tokens, self.seed = temperature, max_tokens, seed
        self.top_p, self.top_k, self.chat_template_kwargs = top_p, top_k, chat_template_kwargs
        self.counts = Counter() if counts is None else counts
        self.calls = self.failures = self.tokens = 0
        try:
            served = [m["id"] for m in self._request("/models")["data"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ReflectorError(f"reflector {self.base_url}: unreachable or not an OpenAI-compatible API "
                                 f"(GET /models: {type(e).__name__}: {e})") from None
        if not served or (model and model not in served):
            raise ReflectorError(f"reflector {self.base_url} serves {served}, not {model or 'any model'!r}")
        self.model = model or served[0]

    def _request(self, path, body=None):
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read().decode("utf-8"))

    def _body(self, prompt, temperature, max_tokens, seed):
        """The /chat/completions request for one prompt (the optional fields: see the class)."""
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": temperature, "max_tokens": max_tokens, "seed": seed}
        if self.top_p < 1:
            body["top_p"] = self.top_p
        if self.top_k > 0:
            body["top_k"] = self.top_k
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return body

    def _complete(self, prompt, temperature, max_tokens, seed):
        """(text, finished, completion tokens) or None after the retries."""
        body = self._body(prompt, temperature, max_tokens, seed)
        for attempt in range(self.retries + 1):
            try:
                out = self._request("/chat/completions", body)
                choice = out["choices"][0]
                message = choice["message"]
                text = message["content"]
                if text is None:  # a reasoning parser's unfinished (or answerless) thought
                    text = message.get("reasoning_content") or message.get("reasoning")
                if not isinstance(text, str):
                    return None  # garbage: retrying will not help
                usage = out.get("usage") or {}
                return text, choice.get("finish_reason") == "stop", int(usage.get("completion_tokens") or 0)
            except urllib.error.HTTPError as e:
                if e.code != 429 and e.code < 500:
                    return None
            except (ValueError, KeyError, IndexError, TypeError):
                return None
            except OSError:  # refused, reset, timed out: the server may come back
                pass
            if attempt < self.retries:
                time.sleep(self.backoff * 2 ** attempt)
        return None

    def reflect(self, prompts):
        """Prompt i of this call is sampled with seed self.seed + i; the next call continues after them."""
        seed, self.seed = self.seed, self.seed + len(prompts)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            done = list(pool.map(lambda ip: self._complete(ip[1], self.temperature, self.max_tokens, seed + ip[0]),
                                 enumerate(prompts)))
        failures, tokens = sum(d is None for d in done), sum(d[2] for d in done if d is not None)
        self.calls += len(prompts)
        self.failures += failures
        self.tokens += tokens
        self.counts["teacher_failures"] += failures
        self.counts["teacher_tokens"] += tokens
        return [None if d is None else d[:2] for d in done]


def remote_reflector(cfg):
    return cfg.reflector.startswith(("http://", "https://"))


def make_reflector(cfg, engine, model_path, weights, counts, initial=None):
    """The reflector --reflector names, for one GEPA round of train.py (docs/METHOD.md "GEPA"):
    an http(s) server (Teacher-Ref over the OpenAI API), `init` (the frozen starting weights,
    swapped into the training engine for the reflection calls, then `weights`, the policy's full
    state dict, put back: Self-Ref), `policy` (the training engine as it is), or another local
    model (its own engine); the two Self-Ref weight sets are prepared once (PreparedWeights: cast
    to the engine's dtype, summed) for the round's many pushes. `cfg`: config.Config. Its seeds continue from the run's count of
    reflection calls (exact resume); the framing (prefill, stop) follows --reflect_prompt; every
    reflector samples with --reflect_temperature, --reflect_top_p, --reflect_top_k and applies
    --reflect_chat_template_kwargs (when '': an engine's own chat_template_kwargs, nothing sent
    to a server). `initial`: the starting weights for Self-Ref (a state dict, or a function giving
    (name, tensor) pairs, as `weights` may be: a LoRA policy's base with its adapters off); None:
    loaded from model_path. A LoRA policy on an engine that serves adapters (lora_rank) reflects
    with the engine's base alone (AdaptersOff): no weights move."""
    seed = cfg.seed * 7 + counts["reflection_calls"]
    settings = dict(temperature=cfg.reflect_temperature, max_tokens=cfg.reflect_max_tokens, seed=seed, counts=counts,
                    top_p=cfg.reflect_top_p, top_k=cfg.reflect_top_k, chat_template_kwargs=reflector_chat_kwargs(cfg))
    if remote_reflector(cfg):
        try:
            return OpenAIReflector(cfg.reflector, cfg.reflector_model, cfg.reflector_api_key_env,
                                   cfg.reflector_timeout, cfg.reflector_retries, **settings)
        except ReflectorError as e:  # a server that cannot be used is a one-line exit
            raise SystemExit(str(e)) from None
    settings.update(reflector_framing(cfg))
    if cfg.reflector == "init" and cfg.lora_rank and getattr(engine, "lora_rank", 0):
        return EngineReflector(AdaptersOff(engine), **settings)  # the base without the adapters: nothing to swap
    if cfg.reflector == "init":
        if initial is None:
            from transformers import AutoModelForCausalLM  # lazy: transformers takes seconds to import
            initial = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
        prepare = functools.partial(PreparedWeights, dtype=getattr(engine, "dtype", None))  # cast once a round
        return EngineReflector(engine, swap=prepare(initial), restore=weights if weights is None else prepare(weights),
                               **settings)
    if cfg.reflector == "policy":
        return EngineReflector(engine, **settings)
    dtype = {"dtype": cfg.engine_dtype} if cfg.reflector_backend == "vllm" else {}  # as the training engine
    return EngineReflector(make_rollout(cfg.reflector_backend, resolve_model(cfg.reflector), **dtype), **settings)
