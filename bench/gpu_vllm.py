"""The prepared vLLM-on-GPU check: what only a GPU with vLLM installed can show, in one call.

    python bench/gpu_vllm.py                               # a CUDA machine after `bash setup.sh gpu` (< 9 min on one GPU)
    python bench/gpu_vllm.py --shapes=1.7b,4b              # also the trainer's memory at Qwen3-4B's shape
    python bench/gpu_vllm.py --device=cpu --out=/tmp/x.json   # smoke test of the script (CI: tests/test_bench.py)

Local models only (no download): the shipped default model (SmolLM2-135M, tied head) for the
engine checks, and a random Qwen3-shaped model with a tied head and the shipped tokenizer, which
never stops talking, for train.py and eval.py. Writes a JSON of measured facts (--out), one
entry a check, each with "pass" (or "skipped" and why, or "error"); exits 1 if a check failed.

  versions      torch, CUDA, driver, GPU, vLLM (a missing vLLM is one line; the engine checks are
                skipped and the rest runs)
  logprobs      engine log-probs at T = 0.6 against HF's log_softmax(logits / T) on the same tokens
  sleep         CUDA: sleep frees the engine's memory (mem_get_info), a 20 GiB torch allocation
                succeeds while it sleeps, wake-up gives the same greedy answers as before
  push          a perturbed model pushed while the engine sleeps (train.py's order) is verified,
                the answers follow the new weights (log-probs against HF on them), the original
                pushed back restores the answers exactly
  corrupt_push  a loader that drops the tensors makes push_weights raise
  seeds         a repeated seeded call reproduces; the same call as rank 1 samples otherwise
  train         train.py --max_steps=2 --save_every=1 on the random model: sleep, wake, push,
                checkpoint each step (--kl_beta > 0, so every step trains and pushes)
  eval_long     eval.py --max_tokens=4096 (CPU: 2,100) on the random model: answers longer than
                2,048 tokens (vLLM's default context cut them there before)
  p2o_train     train.py --algo=p2o as the preset runs it: CUDA graphs on, sleep level 2, a
                Self-Ref GEPA round (the starting weights swapped in for each reflection, the
                policy pushed back), on a Qwen3-shaped model whose vocabulary (49,162) vLLM pads
                to a multiple of 64: every push verified
  flex_long     one packed group of 6 answers (R up to 12,288 tokens; CPU: 90) through two layers
                of Qwen3-4B's widths, FlexAttention against the dense mask: seconds, peak memory,
                the log-prob gap, the graphs compiled over all lengths (dynamic shapes: <= 4)
  memory        train.policy_update, trainer only, at Qwen3-1.7B's shape (8 prompts x 6 rows of
                4,096 response tokens, the README's one-GPU settings), peak memory measured from
                the allocation before the model (what earlier checks left is not counted)
                against docs/GPU.md's estimate (training_peak(estimate_peak(..)), within 15%);
                --shapes=4b adds Qwen3-4B at the paper's 12,288 tokens (1 prompt x 6 rows).
                CPU: a tiny shape, no peak measured.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

GiB = 2 ** 30
SHAPES = {  # Qwen3 configurations (config.json of the released models), random weights
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, vocab_size=4000),  # vLLM-CPU's attention takes head_dim 64
}
PROBES = {  # shape -> (prompts, rows per prompt, prompt tokens, response tokens, micro-batch rows)
    "1.7b": (8, 6, 200, 4096, 2),
    "4b": (1, 6, 200, 12288, 1),
    "tiny": (2, 3, 20, 40, 2),
}


def qwen3_config(shape, **extra):
    from transformers import Qwen3Config

    return Qwen3Config(**{**SHAPES[shape], "tie_word_embeddings": True, "max_position_embeddings": 16384, **extra})


def random_qwen3(tokenizer_path, folder, extra_vocab=0):
    """A random 2-layer Qwen3 with a tied head and the shipped tokenizer, saved as an HF folder.
    extra_vocab > 0: that many vocabulary rows beyond the tokenizer's, e.g. 10, so that the
    vocabulary is not a multiple of 64 and vLLM pads its embedding (vocab_parallel_embedding.py)
    beyond what a push sends."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    config = qwen3_config("tiny", bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config.vocab_size = len(tok) + extra_vocab
    torch.manual_seed(extra_vocab)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


VLLM_CAPTURE_TOKENS = 512  # vLLM's largest CUDA-graph capture by default: min(2 x max_num_seqs, 512) tokens
VLLM_CAPTURE_SIZES = 51  # its default capture sizes up to 512: 1, 2, 4, 8 .. 248 by 8, 256 .. 512 by 16
VLLM_PER_GRAPH = 2 ** 20  # vLLM's own floor for one FULL graph's memory when it extrapolates the pool


def head_phases(tokens, chunk, vocab, hidden, trains_head):
    """Bytes that grpo.head_logprobs holds beside its inputs and outputs, at the peak of its
    forward and of its backward: (forward, backward). c = min(tokens, chunk), V = vocab, H = hidden,
    bf16 autocast, fp32 master weights. Read from the chunk loop and measured on the CPU
    (tests/test_bench.py, the allocator's events under torch.profiler: equal within 2%):
      forward   2 B x V x H, the bf16 cast of the head's weight (trains_head: it is fp32), and per
                chunk entry 10 B when there are several chunks: the previous chunk's fp32 logits
                are still held while the next one's bf16 product and its fp32 copy are made
                (8 B with one chunk: logsumexp's one [c, V] temporary, or the entropy's softmax,
                beside the logits)
      backward  trains_head: the fp32 weight gradient and the weight's bf16 cast (6 B x V x H),
                and, at each chunk, the recomputed fp32 logits and their bf16 gradient (6 B an
                entry) beside the weight gradient's bf16 product and its fp32 copy (6 B x V x H);
                or, at a chunk change, the previous chunk's 6 B an entry beside the next one's
                bf16 product and fp32 copy (12 B an entry), whichever is larger. A frozen head
                (LoRA: bf16 already, no weight gradient): 12 B an entry (6 with one chunk).
    tokens <= 0: (0, 0)."""
    if tokens <= 0:
        return 0, 0
    c, several = min(tokens, chunk), tokens > chunk
    forward = (10 if several else 8) * c * vocab + (2 * vocab * hidden if trains_head else 0)
    entries = (12 if several else 6) * c * vocab
    if not trains_head:
        return forward, entries
    return forward, 6 * vocab * hidden + max(entries, 6 * c * vocab + 6 * vocab * hidden)


def vllm_asleep(shape):
    """An estimate (not measured) of the bytes a sleeping vLLM 0.32 engine keeps on the GPU, the
    defaults (CUDA graphs on, Model Runner V2). Sleep offloads the "runtime" pool (the state built
    with the KV cache), drops the KV cache and drops (level 2) or offloads (level 1) the weights
    pool (vllm/device_allocator/sleep_mode_backend.py 127-137), which also holds what the runner
    made while loading the model (its sampler's penalty counts, 4 B x max_num_seqs x V). The
    CUDA-graph pool is offloaded only when it is cuMem's, with sleep_mode_offload_cudagraph, off
    by default (config/model.py 380, config/vllm.py 688-699). What stays is that pool and the
    buffers the runner made before loading (input ids and positions, max_num_batched_tokens x
    13 B: under 1 MB). The pool, from how vLLM sizes it (v1/worker/gpu/cudagraph_utils.py
    869-990: the first, largest capture allocates the pool, later graphs reuse it):
      the live intermediates of one layer at the largest capture, 512 tokens x (2 x hidden + 3 x
      MLP width) x 2 B (the residual, the normed input, gate/up and the activation, bf16)
      + the manager's output buffer, 512 x hidden x 2 B
      + 1 MiB for each of the 51 FULL decode graphs (vLLM's own per-graph floor; 51 where
        max_num_seqs >= 512, as vLLM's default of 1,024 on an H100 or H200).
    About 0.09 GB at Qwen3-4B, without what the driver keeps for the instantiated graphs. vLLM
    logs the measured pool at start-up ("Graph capturing finished in .. secs, took .. GiB");
    that, not this, is the number to trust."""
    s = SHAPES[shape]
    h, width = s["hidden_size"], s["intermediate_size"]
    return VLLM_CAPTURE_TOKENS * (2 * h + 3 * width) * 2 + VLLM_CAPTURE_TOKENS * h * 2 \
        + VLLM_CAPTURE_SIZES * VLLM_PER_GRAPH


def estimate_peak(shape, prompts, per_prompt, prompt_len, response_len, micro, head_chunk=1024, lora_rank=0,
                  fused_adamw=True, processes=1):
    """docs/GPU.md's estimate of the trainer's peak memory on a GPU (bytes by part) for one step
    with gradient checkpointing, bf16 autocast, unshared rows, entropy logged, the rollback
    snapshot in CPU memory, one process or `processes` under FSDP2; training_peak() adds the
    parts up. N = response tokens of one micro-batch, L = its row length, P = parameters:
      states      16 B x P / processes: fp32 weights, gradients, AdamW's two moments
                  (LoRA: 2 B x P, the frozen bf16 base, + 16 B x adapter parameters)
      adamw       the optimizer step's temporary: 0 fused (train.py on CUDA); foreach AdamW
                  allocates a full-size sqrt of the second moments, 4 B x trained parameters
      autocast    the bf16 casts of the fp32 linear weights, cached by autocast for the step's
                  region (one process; train.py turns the cache off under FSDP: 0): 2 B x linear
                  parameters (LoRA: the adapters alone; the base is bf16 already)
      residuals   layers x rows x L x hidden x 4 B: checkpointed layer inputs (fp32 under autocast;
                  LoRA: 2 B, the bf16 base's embedding and residual adds are bf16)
      layer       rows x L x (3 x MLP width + 8 x hidden) x 2 B: one layer recomputed in backward
      head_weight the head's fp32 weight gradient accumulated over the chunks and its bf16 cast,
                  vocabulary x hidden x (4 + 2) B (LoRA: 0, the bf16 head is frozen)
      head        what the head's chunk loop holds besides head_weight at its peak (head_phases),
                  c = min(N, head_chunk): full training, in backward, the larger of 6 B x c x
                  vocabulary + 6 B x vocabulary x hidden (the weight gradient's bf16 product and
                  its fp32 copy) and 12 B x c x vocabulary: 3.3 GB at Qwen3-4B; LoRA 12 B x c x
                  vocabulary (one chunk: 8 B, the forward's). The forward holds 10 B an entry,
                  less. (Before chunking: N x vocabulary x 18 B.)
      fsdp_gathered  processes > 1: the root's parameters (embedding = tied head, final norm)
                  and one decoder layer's, gathered: 4 B each (LoRA's bf16 base: 2 B). FSDP2 does
                  not reshard the root after forward (torch/distributed/fsdp/_fully_shard/
                  _fsdp_state.py 203-207). Not counted: the next layer's prefetch and a layer's
                  reduce-scatter input, 4 B x a layer's parameters each (0.4 GB at 4B).
      fsdp_root_grad processes > 1: the root's unsharded fp32 gradient, 4 B x the root's
                  parameters (1.6 GB at 4B): it is the head's weight gradient, kept on the
                  unsharded parameter until the root's post-backward reduce-scatter at the end
                  of backward (_fsdp_param_group.py 588-630), so it is there while the layers
                  are recomputed; in one process it is added into the gradient of `states`
      vllm_asleep a sleeping vLLM engine in the same process (vllm_asleep(): its CUDA-graph pool;
                  an estimate): not the trainer's, and not counted by training_peak
    lora_rank r > 0: adapters on every linear layer of the decoder, r x (in + out) each."""
    s = SHAPES[shape]
    h, layers, width, vocab = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"], s["vocab_size"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    attention = h * s["head_dim"] * (s["num_attention_heads"] * 2 + s["num_key_value_heads"] * 2)
    linear = layers * (attention + 3 * h * width)
    layer = attention + 3 * h * width + 2 * h + 2 * s["head_dim"]  # a decoder layer's parameters
    root = vocab * h + h  # the embedding (the tied head) and the final norm
    params = root + layers * layer
    adapters = lora_rank * layers * (2 * (h + q) + 2 * (h + kv) + 3 * (h + width))  # q, o; k, v; gate, up, down
    length, tokens = prompt_len + response_len, micro * response_len
    trained = adapters if lora_rank else params
    sharded = processes > 1
    forward, backward = head_phases(tokens, head_chunk, vocab, h, trains_head=not lora_rank)
    head_weight = 0 if lora_rank else 6 * vocab * h
    return {"states": (2 * params + 16 * adapters if lora_rank else 16 * params) // processes,
            "adamw": 0 if fused_adamw else 4 * trained // processes,
            "autocast": 0 if sharded else 2 * (adapters if lora_rank else linear),
            "residuals": layers * micro * length * h * (2 if lora_rank else 4),
            "layer": micro * length * (3 * width + 8 * h) * 2,
            "head_weight": head_weight, "head": max(forward, backward) - head_weight,
            "fsdp_gathered": (2 if lora_rank else 4) * (root + layer) if sharded else 0,
            "fsdp_root_grad": 4 * root if sharded and not lora_rank else 0,
            "vllm_asleep": vllm_asleep(shape), "parameters": params, "lora_parameters": adapters}


def training_peak(est):
    """The trainer's peak from estimate_peak's parts: what is held through backward (states,
    AdamW's temporary, the autocast cache, the checkpointed inputs, FSDP's gathered root and
    layer) plus the larger of two moments that do not overlap: the head's backward (head +
    head_weight) and a layer's recompute (layer, with the root's unsharded gradient under
    FSDP). The sleeping engine (vllm_asleep) is not the trainer's."""
    held = est["states"] + est["adamw"] + est["autocast"] + est["residuals"] + est["fsdp_gathered"]
    return held + max(est["head"] + est["head_weight"], est["layer"] + est["fsdp_root_grad"])


def check_versions(device):
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), memory_gib=torch.cuda.mem_get_info(device)[1] / GiB,
                    driver=".".join(str(x) for x in divmod(torch._C._cuda_getDriverVersion(), 1000)))
    try:
        import transformers
        import vllm

        info.update(vllm=vllm.__version__, transformers=transformers.__version__)
    except ImportError as e:
        info["vllm"] = f"not installed ({e})"
    return info


def hf_logprobs(model, sample, temperature):
    ids = torch.tensor([sample.prompt_ids + sample.response_ids], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, ids[0, len(sample.prompt_ids):, None])[:, 0].cpu()


def worst_logprob_gap(engine, model, prompts, temperature, seed):
    groups = engine.generate(prompts, n=2, temperature=temperature, max_tokens=32, logprobs=True, seed=seed)
    gaps = torch.cat([(hf_logprobs(model, s, temperature) - torch.tensor(s.logprobs)).abs()
                      for g in groups for s in g])
    return gaps.max().item(), gaps.mean().item()


def greedy(engine, prompts):
    return [g[0].response_ids for g in engine.generate(prompts, n=1, temperature=0, max_tokens=24)]


def check_seeds(engine, prompts):
    """A repeated seeded call reproduces; the same call with rank 1's seed derivation (per-request
    seeds on CUDA, the generator seed on the CPU) samples otherwise."""
    call = lambda: [s.response_ids for g in engine.generate(prompts, n=3, temperature=1.0, max_tokens=16,  # noqa: E731
                                                            seed=7) for s in g]
    a, b = call(), call()
    engine.rank = 1
    try:
        c = call()
    finally:
        engine.rank = 0
    return {"repeated_call_equal": a == b, "rank1_differs": a != c, "pass": a == b and a != c}


def engine_checks(device, model_path, prompts, results, run_check):
    """Every check that needs the one in-process engine (a second one in this process is not
    supported): log-probs, sleep, push, a corrupted push, seeds."""
    from transformers import AutoModelForCausalLM

    import dist
    from rollout import VLLMRollout, WeightPushError

    cuda = device.type == "cuda"
    dtype = "bfloat16" if cuda else "float32"  # CPU: fp32, as the tests compare at 1e-3
    engine = VLLMRollout(model_path, dtype=dtype, max_model_len=1024, seed=0, gpu_memory_utilization=0.3,
                         enforce_eager=False, sleep_level=1, progress_bars=False)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    original = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    bound = 0.1 if cuda else 1e-3  # bf16 engine against fp32 HF; fp32 against fp32

    def logprobs():  # pass: mean gap <= bound / 10, max gap <= bound (CPU) or 10 x bound (bf16 on CUDA)
        worst, mean = worst_logprob_gap(engine, hf, prompts, 0.6, seed=1)
        ok = mean <= bound / 10 and worst <= (bound * 10 if cuda else bound)
        return {"engine_dtype": dtype, "max_abs_gap": worst, "mean_abs_gap": mean, "bound": bound, "pass": ok}

    def sleep():
        if not cuda:
            return {"skipped": "vLLM-CPU has no sleep mode"}
        before = greedy(engine, prompts)
        free_awake = torch.cuda.mem_get_info(device)[0]
        engine.sleep()
        free_asleep = torch.cuda.mem_get_info(device)[0]
        big = torch.empty(20 * GiB, dtype=torch.uint8, device=device)  # raises if the memory is not free
        del big
        torch.cuda.empty_cache()
        after = greedy(engine, prompts)  # wakes the engine
        return {"freed_gib": (free_asleep - free_awake) / GiB, "allocated_20_gib_asleep": True,
                "same_greedy_after_wake": after == before, "pass": after == before and free_asleep > free_awake}

    def push():
        before = greedy(engine, prompts)
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen, device=device))
                p.copy_(p.to(torch.bfloat16 if cuda else torch.float32))  # HF computes with the engine's values
        engine.sleep()  # as train.py: asleep during the update, woken by the push
        report = engine.push_weights(dist.full_parameters(hf, engine.dtype))
        during = greedy(engine, prompts)
        worst, mean = worst_logprob_gap(engine, hf, prompts, 0.6, seed=2)
        hf.load_state_dict(original)
        engine.push_weights(dist.full_parameters(hf, engine.dtype))
        restored = greedy(engine, prompts) == before
        ok = report["verified"] > 0 and during != before and restored and mean <= bound / 10
        return {**report, "answers_changed": during != before, "perturbed_max_abs_gap": worst,
                "perturbed_mean_abs_gap": mean, "restored_exactly": restored, "pass": ok}

    def corrupt_push():
        real = engine.llm.collective_rpc
        engine.llm.collective_rpc = lambda method, *a, **k: None if method == "reload_weights" else real(method, *a, **k)
        shifted = {k: v + 0.01 for k, v in original.items()}
        try:
            engine.push_weights(shifted)
            raised = None
        except WeightPushError as e:
            raised = str(e)[:200]
        finally:
            engine.llm.collective_rpc = real
        engine.push_weights(original)
        return {"raised": raised, "pass": raised is not None}

    for check in (logprobs, sleep, push, corrupt_push):
        results[check.__name__] = run_check(check.__name__, check)
    results["seeds"] = run_check("seeds", lambda: check_seeds(engine, prompts))
    engine.close()


def run_train(device, model, work, name, flags):
    """train.py on `model` with `flags` into work/runs/<name> -> (process, run folder, its
    metrics.jsonl rows, seconds)."""
    cmd = [sys.executable, "train.py", f"--model={model}", f"--device={device.type}", "--dev_data=", "--eval_every=0",
           "--eval_k=0", f"--out_dir={os.path.join(work, 'runs')}", f"--run_name={name}", *flags]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    run = os.path.join(work, "runs", name)
    metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))] if proc.returncode == 0 else []
    return proc, run, metrics, time.perf_counter() - t


def train_result(proc, metrics, seconds, ok, **facts):
    return {"returncode": proc.returncode, "seconds": seconds, "steps": len(metrics), **facts,
            "push_seconds": [m["time_push"] for m in metrics], "pass": ok,
            **({} if ok else {"output_tail": (proc.stdout + proc.stderr)[-3000:]})}


def check_train(device, tiny, work):
    proc, run, metrics, seconds = run_train(device, tiny, work, "check", [
        "--algo=grpo", "--max_steps=2", "--save_every=1", "--prompts_per_step=4", "--group_size=4", "--max_tokens=64",
        "--kl_beta=0.01", "--enforce_eager=True"])
    checkpoints = sorted(n for n in os.listdir(run) if n.startswith("ckpt-")) if os.path.isdir(run) else []
    ok = proc.returncode == 0 and len(metrics) == 2 and all(m["trained_rows"] > 0 for m in metrics) \
        and checkpoints == ["ckpt-000001", "ckpt-000002"]
    return train_result(proc, metrics, seconds, ok, trained_rows=[m["trained_rows"] for m in metrics],
                        checkpoints=checkpoints)


def check_p2o_train(device, model, work):
    """train.py --algo=p2o as the preset runs it: CUDA graphs on, sleep level 2 (the default),
    and a Self-Ref GEPA round (the starting weights swapped into the engine for each reflection,
    the policy pushed back), on a Qwen3-shaped model whose vocabulary vLLM pads. Four problems,
    four a step: epoch 0 is one step, then GEPA (the random model solves nothing: all hard), then
    a templated step; every push verified."""
    data = os.path.join(work, "four.jsonl")
    with open(data, "w") as f:
        for i in range(4):
            f.write(json.dumps({"id": f"p{i}", "problem": f"What is {i} + 5?", "answer": str(i + 5)}) + "\n")
    proc, run, metrics, seconds = run_train(device, model, work, "p2o", [
        "--algo=p2o", "--epochs=2", f"--train_data={data}", "--prompts_per_step=4", "--group_size=2",
        "--max_tokens=48", "--save_every=0", "--gepa_min_hard=1", "--gepa_budget=16", "--gepa_dev_max=2",
        "--gepa_parents=2", "--gepa_minibatch=1", "--reflector=init"])
    archive = os.path.join(run, "gepa-epoch-0.json")
    gepa = json.load(open(archive)) if os.path.isfile(archive) else {}
    ok = proc.returncode == 0 and len(metrics) == 2 and gepa.get("reflection_calls", 0) > 0
    return train_result(proc, metrics, seconds, ok, reflection_calls=gepa.get("reflection_calls"),
                        metric_calls=gepa.get("metric_calls"))


def check_flex_long(device, responses=(2048, 4096, 12288), dense_max=4096):
    """One packed group (a 512-token prompt and 6 responses of R tokens) through two decoder
    layers of Qwen3-4B's widths (fp32 master weights, bf16 autocast, q/k norms fp32), forward and
    backward, under FlexAttention (model.use_packed_flex with grpo.packed_block_mask) and under
    the dense [L, L] SDPA mask (R <= dense_max): seconds (after a warm-up), peak memory above
    the model's, the largest log-prob gap between the layouts (bf16 rounding: <= 0.1), and how
    many graphs torch.compile made for flex over all lengths (bounded by dynamic shapes: <= 4).
    CPU: FlexAttention has no backward there, so forward only at small R."""
    from transformers import Qwen3ForCausalLM

    import grpo
    import train
    from model import use_packed_flex

    cuda = device.type == "cuda"
    if not cuda:
        responses, dense_max = (40, 90), 90
    config = qwen3_config("4b" if cuda else "tiny", num_hidden_layers=2, vocab_size=4000,
                          max_position_embeddings=131072)
    results, graphs, logps = {}, torch._dynamo.utils.counters["stats"]["unique_graphs"], {}
    for layout in ("flex", "dense"):
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(config).float()
        if layout == "flex":
            use_packed_flex(model)
        for r in responses:
            if layout == "dense" and r > dense_max:
                continue
            prompts, rows = [list(range(5, 517))] * 6, [[7 + (i % 50) for i in range(r)]] * 6
            ids, attention, mask = (t.to(device) for t in grpo.make_batch(prompts, rows, 0))
            packed = grpo.pack_rows(prompts, rows, 0).to(device)

            def step():
                with torch.autocast(device.type, torch.bfloat16), torch.set_grad_enabled(cuda):
                    logp, _ = train.response_logprobs(model, ids, attention, mask[:, 1:], 1.0, packed=packed)
                if cuda:
                    logp.sum().backward()
                return logp
            step()  # warm-up (compiles)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if cuda else 0
            t = time.perf_counter()
            logp = step()
            if cuda:
                torch.cuda.synchronize(device)
            logps[layout, r] = logp.detach().float().cpu()
            results[f"{layout}_{r}"] = {"seconds": time.perf_counter() - t, "tokens": packed.input_ids.shape[1],
                                        "peak_gib": (torch.cuda.max_memory_allocated(device) - base) / GiB
                                        if cuda else None, "finite": bool(torch.isfinite(logp).all())}
            model.zero_grad(set_to_none=True)
        if layout == "flex":
            results["flex_graphs_compiled"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        del model
    both = [r for r in responses if r <= dense_max]
    results["flex_over_dense_seconds"] = {r: results[f"flex_{r}"]["seconds"] / results[f"dense_{r}"]["seconds"]
                                          for r in both}
    results["flex_dense_max_abs_logp_gap"] = max((logps["flex", r] - logps["dense", r]).abs().max().item() for r in both)
    results["pass"] = all(v["finite"] for k, v in results.items() if isinstance(v, dict) and "finite" in v) \
        and results["flex_dense_max_abs_logp_gap"] <= 0.1 and (not cuda or results["flex_graphs_compiled"] <= 4)
    return results


def check_eval_long(device, tiny, work, max_tokens):
    data = os.path.join(work, "two.jsonl")
    with open(data, "w") as f:
        for i in range(2):
            f.write(json.dumps({"id": f"q{i}", "problem": f"What is {i} + 2?", "answer": str(i + 2)}) + "\n")
    out = os.path.join(work, "eval.json")
    cmd = [sys.executable, "eval.py", f"--model={tiny}", f"--data={data}", "--k=0", f"--max_tokens={max_tokens}",
           f"--out={out}", "--enforce_eager"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lengths = []
    if proc.returncode == 0:
        with open(os.path.splitext(out)[0] + ".samples.jsonl") as f:
            lengths = [n for line in f for n in json.loads(line)["lengths"]]
    ok = proc.returncode == 0 and max(lengths, default=0) > 2048
    return {"returncode": proc.returncode, "max_tokens": max_tokens, "answer_lengths": lengths, "pass": ok,
            **({} if ok else {"output_tail": (proc.stdout + proc.stderr)[-3000:]})}


def check_memory(device, shape):
    """One policy_update at `shape` (random weights and tokens) with the README's one-GPU
    settings: gradient checkpointing, unshared rows, two mini-batches."""
    import random

    from transformers import Qwen3ForCausalLM

    import train

    prompts, per_prompt, prompt_len, response_len, micro = PROBES[shape]
    estimate = estimate_peak(shape, prompts, per_prompt, prompt_len, response_len, micro)
    config = qwen3_config(shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    baseline = 0
    if device.type == "cuda":  # measured from here: what earlier checks (an engine in this process) left is not counted
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).float()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rng = random.Random(0)
    vocab = config.vocab_size
    rows = []
    for g in range(prompts):
        prompt = [rng.randrange(1, vocab) for _ in range(prompt_len)]
        for _ in range(per_prompt):
            rows.append(train.Row(prompt, [rng.randrange(1, vocab) for _ in range(response_len)],
                                  rng.choice([-1.0, 1.0]), group=g))
    cfg = train.Config(micro_batch_size=micro, gradient_checkpointing=True, shared_prompt=False,
                       mini_batches=2 if prompts > 1 else 1, lr=1e-6, max_tokens=response_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=device.type == "cuda" or None)  # as train.py
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    t = time.perf_counter()
    update = train.policy_update(model, None, optimizer, rows, cfg, pad_id=0)
    seconds = time.perf_counter() - t
    total = training_peak(estimate)  # the trainer alone: no engine sleeps beside this probe's model
    out = {"shape": shape, "rows": len(rows), "response_tokens": response_len, "micro_batch_size": micro,
           "parameters": estimate["parameters"], "estimate_gib": {k: v / GiB for k, v in estimate.items()
                                                                  if k not in ("parameters", "lora_parameters")},
           "estimate_total_gib": total / GiB, "seconds": seconds, "finite": update.finite}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - baseline
        out.update(measured_peak_gib=peak / GiB, measured_over_estimate=peak / total, baseline_gib=baseline / GiB,
                   pass_=update.finite and 0.85 <= peak / total <= 1.15)
    else:
        out.update(measured_peak_gib=None, pass_=update.finite)
    out["pass"] = out.pop("pass_")
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="1.7b", help="memory probes: 1.7b, 4b (comma-separated)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "gpu-vllm.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    results = {"device": str(device), "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def run_check(name, check):
        t = time.perf_counter()
        try:
            out = check()
        except Exception as e:  # record it and go on: one failed check must not hide the others
            out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:], "pass": False}
        out["check_seconds"] = round(time.perf_counter() - t, 2)
        print(f"{name}: {'skipped: ' + out['skipped'] if 'skipped' in out else 'PASS' if out.get('pass') else 'FAIL'}"
              f" ({out['check_seconds']:.0f} s)", flush=True)
        return out

    results["versions"] = check_versions(device)
    print(json.dumps(results["versions"]), flush=True)
    has_vllm = not results["versions"]["vllm"].startswith("not installed")
    from model import resolve_model

    model_path = resolve_model()
    prompts = [[{"role": "user", "content": "What is 3 + 4?"}], [{"role": "user", "content": "Name a colour."}],
               "The capital of France is"]
    with tempfile.TemporaryDirectory() as work:
        tiny = random_qwen3(model_path, os.path.join(work, "tiny-qwen3"))
        if has_vllm:
            engine_checks(device, model_path, prompts, results, run_check)
            results["train"] = run_check("train", lambda: check_train(device, tiny, work))
            results["eval_long"] = run_check("eval_long", lambda: check_eval_long(device, tiny, work, 4096 if cuda else 2100))
            padded = random_qwen3(model_path, os.path.join(work, "padded-qwen3"), extra_vocab=10)
            results["p2o_train"] = run_check("p2o_train", lambda: check_p2o_train(device, padded, work))
        else:
            print(f"vLLM is not installed here ({results['versions']['vllm']}): the engine, train.py and eval.py "
                  "checks are skipped; the trainer's memory probe runs", flush=True)
            for name in ("logprobs", "sleep", "push", "corrupt_push", "seeds", "train", "eval_long", "p2o_train"):
                results[name] = {"skipped": "vLLM is not installed"}
        results["flex_long"] = run_check("flex_long", lambda: check_flex_long(device))
        for shape in (args.shapes.split(",") if cuda else ["tiny"]):
            results[f"memory_{shape}"] = run_check(f"memory_{shape}", lambda: check_memory(device, shape))
    results["seconds"] = sum(r.get("check_seconds", 0) for r in results.values() if isinstance(r, dict))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    failed = [k for k, v in results.items() if isinstance(v, dict) and v.get("pass") is False]
    print(f"wrote {args.out}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
