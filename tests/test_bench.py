"""bench/gpu_vllm.py, the prepared vLLM-on-GPU check, as a smoke test on the CPU: every check
it can run here runs and passes (sleep mode is the one vLLM-CPU lacks), so the script a GPU
session runs once is known to work end to end before that session."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_vllm_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_vllm.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "bench/gpu_vllm.py", "--device=cpu", f"--out={out}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["versions"]["vllm"] == "0.32.0"
    assert r["sleep"] == {"skipped": "vLLM-CPU has no sleep mode", "check_seconds": r["sleep"]["check_seconds"]}
    for name in ("logprobs", "push", "corrupt_push", "seeds", "train", "eval_long", "p2o_train", "flex_long",
                 "memory_tiny"):
        assert r[name]["pass"] is True, (name, r[name])
    assert r["p2o_train"]["reflection_calls"] > 0  # a Self-Ref round on a vocabulary vLLM pads (49,162 -> 49,216)
    assert r["flex_long"]["flex_40"]["finite"] and r["flex_long"]["dense_90"]["finite"]
    assert r["logprobs"]["max_abs_gap"] <= 1e-3  # fp32 engine against fp32 HF
    assert r["push"]["answers_changed"] and r["push"]["restored_exactly"]
    assert "does not hold the pushed values" in r["corrupt_push"]["raised"]
    assert r["train"]["checkpoints"] == ["ckpt-000001", "ckpt-000002"] and min(r["train"]["trained_rows"]) > 0
    assert min(r["eval_long"]["answer_lengths"]) > 2048  # the random model never stops: the context holds 2,100
    assert r["memory_tiny"]["finite"] and r["memory_tiny"]["measured_peak_gib"] is None  # CPU: no CUDA peak


def test_memory_estimate_counts_the_models_parameters():
    """bench/gpu_vllm.estimate_peak's parameter count equals the model transformers builds at
    that shape (on the meta device: no memory), and its parts follow the formulas of its
    docstring (docs/GPU.md): 16 B a parameter, fp32 checkpointed residuals, the head's backward."""
    import torch
    from transformers import Qwen3ForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from gpu_vllm import estimate_peak, qwen3_config, training_peak

    for shape, billions in (("1.7b", 1.72), ("4b", 4.02)):
        with torch.device("meta"):
            model = Qwen3ForCausalLM(qwen3_config(shape))
        count = sum(p.numel() for p in model.parameters())  # the tied head once
        est = estimate_peak(shape, 1, 6, 200, 12288, 1)
        assert est["parameters"] == count and round(count / 1e9, 2) == billions
        assert est["states"] == 16 * count
        linear = sum(m.weight.numel() for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and n != "lm_head")  # the head is the embedding
        assert est["autocast"] == 2 * linear  # one bf16 cast of every fp32 linear weight, cached for the step
        assert est["adamw"] == 0 and estimate_peak(shape, 1, 6, 200, 12288, 1, fused_adamw=False)["adamw"] == 4 * count
    est = estimate_peak("4b", 1, 6, 200, 12288, 1)
    assert round(est["autocast"] / 1e9, 1) == 7.3 and round(est["head_weight"] / 1e9, 2) == 2.33  # review D1: 7.3; 1.56 + 0.78
    assert est["residuals"] == 36 * 12488 * 2560 * 4  # layers x L x hidden x fp32
    # the head's backward, 1,024-token chunks: 6 B an entry (fp32 logits, bf16 gradient) beside the
    # weight gradient's bf16 product and fp32 copy (6 B x V x H), larger than 12 B an entry at a chunk change
    assert est["head"] == (6 * 1024 + 6 * 2560) * 151936 == 3_267_231_744  # was 8 B an entry: 1.2 GB
    assert estimate_peak("4b", 1, 6, 200, 500, 1)["head"] == (6 * 500 + 6 * 2560) * 151936  # one chunk
    # held through backward + the head's backward (it outweighs the recomputed layer, 1.2 GB)
    assert training_peak(est) == est["states"] + est["autocast"] + est["residuals"] + 2 * 2560 * 151936 * 6 \
        + 6 * 1024 * 151936
    assert 81e9 <= training_peak(est) <= 82e9  # review D1's corrected one-GPU peak was about 80-83 GB
    est["vllm_asleep"] *= 10
    assert training_peak(est) == training_peak(estimate_peak("4b", 1, 6, 200, 12288, 1))  # not the trainer's


def test_lora_memory_estimate_counts_the_adapters_peft_injects():
    """estimate_peak(lora_rank=r)'s adapter count equals what lora.add_adapters puts on that shape
    (meta device), and the states are the bf16 base plus 16 B an adapter parameter; the frozen
    bf16 head holds 12 B an entry of a chunk in backward (the forward's 10 B is less)."""
    import torch
    from transformers import Qwen3ForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import lora
    from gpu_vllm import estimate_peak, qwen3_config, training_peak

    with torch.device("meta"):
        model = lora.add_adapters(Qwen3ForCausalLM(qwen3_config("4b")), 32, 32, base_dtype=torch.bfloat16)
    adapters = sum(p.numel() for n, p in model.named_parameters() if lora.is_adapter(n))
    est = estimate_peak("4b", 1, 6, 200, 12288, 1, lora_rank=32)
    assert est["lora_parameters"] == adapters == 66_060_288  # 36 layers x 32 x (q 6,656 + o 6,656 + k, v 3,584 + 3 x 12,288)
    assert est["states"] == 2 * est["parameters"] + 16 * adapters
    assert est["autocast"] == 2 * adapters and est["head_weight"] == 0  # the base and its head are bf16 and frozen
    assert est["residuals"] * 2 == estimate_peak("4b", 1, 6, 200, 12288, 1)["residuals"]
    assert est["head"] == 12 * 1024 * 151936  # 1.9 GB, was 8 B an entry (1.2 GB)
    assert est["head"] > est["layer"]  # 1.9 against 1.2 GB: the head's backward makes the peak
    assert training_peak(est) == est["states"] + est["autocast"] + est["residuals"] + est["head"]
    assert round(training_peak(est) / 1e9, 1) == 13.4  # docs/GPU.md


def test_memory_estimate_under_fsdp_counts_the_roots_gradient():
    """estimate_peak(processes=N): the states shard N ways, autocast's cache is off, and what
    FSDP2's root keeps whole (dist.shard wraps each decoder layer, then the model: the root holds
    what no layer holds, counted here on the meta model) is there gathered in fp32 beside one
    layer, and its unsharded fp32 gradient (1.6 GB at 4B) while the layers are recomputed."""
    import torch
    from transformers import Qwen3ForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from gpu_vllm import estimate_peak, qwen3_config, training_peak

    with torch.device("meta"):
        model = Qwen3ForCausalLM(qwen3_config("4b"))
    in_layers = {id(p) for p in model.model.layers.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)  # embedding (= head), final norm
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert root == 151936 * 2560 + 2560
    one, eight = estimate_peak("4b", 1, 6, 200, 12288, 1), estimate_peak("4b", 1, 6, 200, 12288, 1, processes=8)
    assert eight["states"] == one["states"] // 8 and eight["autocast"] == 0
    assert eight["fsdp_root_grad"] == 4 * root == 1_555_834_880 and one["fsdp_root_grad"] == 0
    assert eight["fsdp_gathered"] == 4 * (root + layer) and one["fsdp_gathered"] == 0
    held = eight["states"] + eight["residuals"] + eight["fsdp_gathered"]
    assert training_peak(eight) == held + max(eight["head"] + eight["head_weight"], eight["layer"] + 4 * root)
    assert round(training_peak(eight) / 1e9, 1) == 20.2  # docs/GPU.md, 8 x 80 GB
    lora = estimate_peak("4b", 1, 6, 200, 12288, 1, lora_rank=32, processes=8)
    assert lora["fsdp_root_grad"] == 0 and lora["fsdp_gathered"] == 2 * (root + layer)  # a frozen bf16 root


def test_vllm_asleep_estimate_is_the_graph_pool_of_the_default_capture_sizes():
    """gpu_vllm.vllm_asleep: vLLM 0.32's default capture sizes (config/vllm.py: 1, 2, 4, then by 8
    below 256 and by 16 up to min(2 x max_num_seqs, 512)) are 51, up to 512 tokens; the pool is one
    layer's live bf16 intermediates at 512 tokens, the output buffer and 1 MiB a FULL graph."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_vllm

    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, min(2 * 1024, 512) + 1, 16))
    assert len(sizes) == gpu_vllm.VLLM_CAPTURE_SIZES == 51 and sizes[-1] == gpu_vllm.VLLM_CAPTURE_TOKENS
    assert gpu_vllm.vllm_asleep("4b") == 512 * (2 * 2560 + 3 * 9728) * 2 + 512 * 2560 * 2 + 51 * 2 ** 20 == 91_226_112


def test_head_memory_formula_matches_a_cpu_measurement():
    """gpu_vllm.head_phases against the CPU allocator's own events (torch.profiler, profile_memory)
    while grpo.head_logprobs runs forward and backward under bf16 autocast: the peak above what
    was held before is the formula's within 2%, for a trained fp32 head over several chunks and a
    frozen bf16 head (LoRA) in one chunk."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import grpo
    from gpu_vllm import head_phases

    def peak(fn):  # the largest sum of the allocations and frees recorded while fn runs
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        now = top = 0
        for e in events:
            now += e.nbytes()
            top = max(top, now)
        return top

    V, H = 32000, 128
    for tokens, chunk, trains in ((1024, 256, True), (200, 256, False)):
        torch.manual_seed(0)
        hidden = torch.randn(tokens, H, requires_grad=True)
        weight = torch.randn(V, H) * 0.02
        weight = weight.requires_grad_() if trains else weight.to(torch.bfloat16)
        targets, out = torch.randint(0, V, (tokens,)), {}

        def forward():
            with torch.autocast("cpu", torch.bfloat16):
                out["logp"] = grpo.head_logprobs(hidden, weight, targets, 0.7, chunk, with_entropy=True)[0]
        measured = peak(forward), peak(lambda: out["logp"].sum().backward())
        for m, formula in zip(measured, head_phases(tokens, chunk, V, H, trains)):
            assert formula <= m <= 1.02 * formula, (tokens, chunk, trains, measured, formula)


def test_head_bench_runs_and_agrees():
    """bench/head_logprobs.py at a small shape: both paths run and agree (float32)."""
    proc = subprocess.run([sys.executable, "bench/head_logprobs.py", "--tokens=40", "--vocab=300", "--hidden=16",
                           "--chunk=7", "--repeats=1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("largest |chunked - full|")
    gaps = [float(x) for x in re.findall(r"\d\.\d+e[-+]\d+", line)]
    assert len(gaps) == 3 and max(gaps) < 1e-4, line


def test_precision_bench_runs_small():
    """bench/cpu_precision.py at a small size: both dtypes generate the same number of tokens
    (EOS ignored) and the two ratio lines are printed."""
    proc = subprocess.run([sys.executable, "bench/cpu_precision.py", "--rounds=1", "--prompts=2", "--n=1",
                           "--new_tokens=4", "--rows=1", "--tokens=8"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("(8 tokens)") == 2, out  # 2 prompts x 1 sample x 4 tokens: bf16 and fp32
    assert re.search(r"generate: bf16 .* ratio fp32/bf16 \d+\.\d{3}", out) and re.search(r"train   : .* ratio", out)


def test_lora_bench_runs_small(tiny_model):
    """bench/lora_vs_full.py on the tiny model (HF engine for the push): every arm trains, checkpoints and
    pushes, and the ratio line is printed with the trained share it should track."""
    proc = subprocess.run([sys.executable, "bench/lora_vs_full.py", f"--model={tiny_model}", "--rounds=1", "--steps=1",
                           "--push_repeats=1", "--push_backend=hf", "--groups=1", "--k=2", "--prompt=8",
                           "--response=8", "--micro_batch=2", "--ranks=4"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"round 0 full .* ([\d,]+) of \1 trained", out), out  # full training trains everything
    m = re.search(r"ratios lora r4/full: training memory (\d+\.\d+), step time (\d+\.\d+), checkpoint (\d+\.\d+) "
                  r"\(trained share (\d+\.\d+)\), push time (\d+\.\d+)", out)
    assert m, out
    assert 0 < float(m.group(4)) < float(m.group(3)) < 1  # the adapters plus the tokenizer, well under the full model


def test_gepa_ranks_bench_answers_on_both_ranks_and_keeps_the_archive(tmp_path):
    """bench/gepa_ranks.py, small: a Self-Ref GEPA round with the shipped model on vLLM-CPU, alone and
    under torchrun with two engines. Rank 1 answers its share of every call; the greedy answers the
    arms share agree but for rare batch-composition flips (the bench counts them: 1 of 135 in the
    committed run; none at this size here), and with no flip the archives are equal."""
    out = tmp_path / "gepa_ranks.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "bench/gepa_ranks.py", "--hard=8", "--dev=4", "--budget=30", "--max_tokens=32",
                           "--rounds=1", f"--json={out}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["compared"] > 0 and r["flips"] <= 0.05 * r["compared"]
    if r["flips"] == 0:
        assert r["archives_equal"] and r["metric_calls"][0] == r["metric_calls"][1] > 0
    (alone,), (first, second) = r["shares"]["1"], r["shares"]["2"]
    assert first["calls"] == second["calls"] > 0  # rank 1 took part in every call
    assert 0 <= first["items"] - second["items"] <= first["calls"]  # items[0::2] and items[1::2] of each call
    if r["archives_equal"]:
        assert first["calls"] == alone["calls"] and first["items"] + second["items"] == alone["items"]
    assert "round time 1 process / 2 processes" in proc.stdout


def test_gpu_features_runs_on_the_cpu():
    """bench/gpu_features.py on the CPU (dense packed mask): packed pooled states equal per-row ones."""
    proc = subprocess.run([sys.executable, "bench/gpu_features.py", "--device=cpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "PASS" and "R 64: packed" in proc.stdout


def test_packing_bench_counts_the_reviews_example_and_the_default_runs_groups():
    """bench/packing.py: pack_rows' padded layout of the review's CRM micro-batch (N5) has the
    review's counts (58% of 166,840 tokens padding; 40,280 of 50,804 tiles for padding queries);
    one row has neither. On the default run's groups the training pass is unchanged (one
    sequence a forward) and the CRM pass loses its padding."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import packing

    (prompts, responses), = packing.review_example()
    counts = packing.work(prompts, responses)
    assert counts["before"] == (166840, 97504, 50804, 40280)  # tokens, padding tokens, tiles, padding-query tiles
    assert counts["after"] == (69336, 0, 10552, 0)
    proc = subprocess.run([sys.executable, "bench/packing.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    cells = [line.split()[-6:] for line in lines[1:7]]  # layout, tokens, padding, tiles, padding-query tiles (2)
    assert [c[0] for c in cells] == ["before", "after"] * 3
    training, crm = cells[2:4], cells[4:6]
    assert training[0][1:] == training[1][1:] and training[0][2] == "0.0%"
    assert crm[0][2] != "0.0%" and crm[1][2] == "0.0%" and crm[1][-2:] == ["0", "(0.0%)"]
    assert int(crm[1][3].replace(",", "")) < int(crm[0][3].replace(",", ""))


def test_objectives_bench_runs_small(tiny_model):
    """bench/objectives.py on the tiny model: every objective and correction updates the same step, and each arm's
    line has its median and its ratio to its own baseline (1 for the baselines themselves)."""
    proc = subprocess.run([sys.executable, "bench/objectives.py", f"--model={tiny_model}", "--rounds=1", "--groups=2",
                           "--k=3", "--prompt=6", "--template=3", "--response=5"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = {m.group(1).strip(): float(m.group(3)) for m in
             re.finditer(r"^(\S+( \(crm off\))?)\s+\d+\.\d+\s+(\d+\.\d{3})", proc.stdout, re.M)}
    assert set(lines) == {"ppo", "gspo_token", "cispo", "ppo+token_mask", "ppo+icepop", "ppo+seq_tis", "ppo+geo_mask",
                          "ppo (crm off)", "gspo (crm off)"}, proc.stdout
    assert lines["ppo"] == lines["ppo (crm off)"] == 1.0
