"""lora.py and --lora_rank: one layer against W + (alpha/r) B A by hand, B = 0 at start, a frozen base that
no step touches, the starting policy as adapters off, merged pushes verified in vLLM, PEFT folders that
peft loads, merged exports and adapter checkpoints that eval.py reads, exact resume."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import lora
from model import served_adapter
import train
from rollout import WeightPushError, named_tensors

PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]  # token ids (any ids of the tokenizer do for a random model)
RESPONSES = [[8, 9, 10], [11, 12, 13, 14, 15]]


def parity_reward(text, problem):
    return float(len(text) % 2 == 0)


def logprobs(model, prompts=PROMPTS, responses=RESPONSES):
    with torch.no_grad():
        return train.row_logprobs(model, prompts, responses, pad_id=0, temperature=1.0)


def adapted(path, rank=4, alpha=8, dtype=torch.float32, **kw):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return lora.add_adapters(model, rank, alpha, base_dtype=dtype, **kw)


def randomise_adapters(model, seed=0, scale=0.05):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter(name):
                p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return model


def lora_config(tiny_model, tmp_path, **over):
    cfg = train.Config(model=tiny_model, backend="hf", prompts_per_step=3, group_size=4, max_tokens=6,
                       temperature=1.0, micro_batch_size=5, lr=1e-3, warmup_steps=1, dev_data="", eval_every=0,
                       save_every=2, max_steps=3, out_dir=str(tmp_path), run_name="t", autocast_bf16=False, seed=3,
                       lora_rank=4, lora_alpha=8, export_every=3, keep_checkpoints=0)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def lora_run(tiny_model, tmp_path_factory):
    """Three LoRA steps on the tiny model with a k3 KL term (the reference: adapters off)."""
    out_dir = tmp_path_factory.mktemp("lora-run")
    out = train.train(lora_config(tiny_model, out_dir, kl_beta=0.01), reward_fn=parity_reward)
    return out, os.path.join(str(out_dir), "t")


def test_one_lora_layer_and_its_gradients_equal_the_hand_computed_update(tiny_model):
    model = randomise_adapters(adapted(tiny_model, rank=3, alpha=6, dtype=torch.float64))
    layer = model.model.layers[0].self_attn.q_proj
    w = layer.base_layer.weight.detach()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g = torch.randn(5, w.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    s = 6 / 3
    out = layer(x)
    (out * g).sum().backward()
    assert torch.allclose(out, x @ (w + s * b.detach() @ a.detach()).T, rtol=0, atol=1e-12)
    # d/dB <G, s x A^T B^T> = s G^T (x A^T);  d/dA = s B^T G^T x
    assert torch.allclose(b.grad, s * g.T @ (x @ a.detach().T), rtol=0, atol=1e-12)
    assert torch.allclose(a.grad, s * b.detach().T @ g.T @ x, rtol=0, atol=1e-12)
    assert layer.base_layer.weight.grad is None
    merged = dict(lora.merged_weights(model.named_parameters(), lora.scaling(model)))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(merged[name], (w + s * b.detach() @ a.detach()).float(), rtol=0, atol=1e-6)
    assert not any(".lora_" in k or ".base_layer" in k for k in merged)


def test_b_is_zero_at_start_so_the_adapted_policy_is_the_base_exactly(tiny_model):
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = adapted(tiny_model)
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if ".lora_B." in n)
    for want, got in zip(logprobs(base), logprobs(model)):
        assert torch.equal(want, got)


def test_gradients_reach_only_the_adapters(tiny_model):
    model = randomise_adapters(adapted(tiny_model))
    logp = train.row_logprobs(model, PROMPTS, RESPONSES, pad_id=0, temperature=1.0)
    sum(x.sum() for x in logp).backward()
    for name, p in model.named_parameters():
        if lora.is_adapter(name):
            assert p.requires_grad and p.dtype == torch.float32 and p.grad is not None and p.grad.abs().sum() > 0
        else:
            assert not p.requires_grad and p.grad is None, name


def test_base_dtype_and_dropout_only_where_a_graph_is_built(tiny_model):
    model = adapted(tiny_model, dtype=torch.float32, dropout=0.5)
    bf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    lora.add_adapters(bf, 4, 8, base_dtype=torch.bfloat16)
    assert {p.dtype for n, p in bf.named_parameters() if not lora.is_adapter(n)} == {torch.bfloat16}
    assert {p.dtype for n, p in bf.named_parameters() if lora.is_adapter(n)} == {torch.float32}
    randomise_adapters(model)
    model.train()
    first, second = logprobs(model), logprobs(model)  # no_grad: dropout off, deterministic
    assert all(torch.equal(x, y) for x, y in zip(first, second))
    with torch.enable_grad():
        noisy = train.row_logprobs(model, PROMPTS, RESPONSES, pad_id=0, temperature=1.0)
    assert any(not torch.allclose(x, y.detach()) for x, y in zip(first, noisy))


def test_unknown_targets_are_one_line(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert lora.target_names(model) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert lora.target_names(model, "v_proj, q_proj") == ["q_proj", "v_proj"]
    with pytest.raises(SystemExit, match="qkv is not a linear layer"):
        lora.target_names(model, "q_proj,qkv")


@pytest.mark.parametrize("flag,value,message", [("lora_rank", -1, "--lora_rank must be >= 0"),
                                                ("lora_alpha", 0, "--lora_alpha must be > 0"),
                                                ("lora_dropout", 1.0, "--lora_dropout must be < 1"),
                                                ("lora_lr_scale", 0.0, "--lora_lr_scale must be > 0"),
                                                ("lora_targets", " ", "--lora_targets is all-linear")])
def test_lora_settings_are_checked_before_any_model_loads(flag, value, message):
    cfg = train.Config(lora_rank=4)
    setattr(cfg, flag, value)
    with pytest.raises(SystemExit, match=message):
        train.check_config(cfg)


def test_training_moves_the_adapters_and_never_the_base(lora_run, tiny_model):
    out, _ = lora_run
    policy = out["policy"]
    start = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    moved = 0
    for name, p in policy.named_parameters():
        if lora.is_adapter(name):
            moved += ".lora_B." in name and bool(p.abs().sum() > 0)
        else:
            assert torch.equal(p, start[name.replace(".base_layer", "")]), name  # bit-identical after 3 steps
    assert moved > 0
    # the optimizer holds the adapters alone, at lr x lora_lr_scale
    assert json.load(open(os.path.join(lora_run[1], "ckpt-000003", "train_config.json")))["lora_rank"] == 4


def test_adapters_off_is_the_starting_policy_and_the_merged_weights_are_the_adapted_one(lora_run, tiny_model):
    policy = lora_run[0]["policy"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with lora.adapters_off(policy):
        off = logprobs(policy)
    on = logprobs(policy)
    assert all(torch.equal(x, y) for x, y in zip(logprobs(base), off))
    assert any(not torch.allclose(x, y) for x, y in zip(off, on))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    plain.load_state_dict(dict(lora.engine_weights(policy)), strict=False)
    plain.tie_weights()
    assert max((x - y).abs().max().item() for x, y in zip(logprobs(plain), on)) <= 1e-5
    initial = dict(lora.engine_weights(policy, adapters=False))
    assert all(torch.equal(initial[k], v) for k, v in base.state_dict().items() if k in initial)


def test_checkpoint_is_a_peft_folder_that_peft_loads_and_reproduces(lora_run, tiny_model):
    from peft import PeftModel

    out, run_dir = lora_run
    ckpt = os.path.join(run_dir, "ckpt-000003")
    assert not os.path.exists(os.path.join(ckpt, "model.safetensors"))  # adapters only: no base copy
    config = json.load(open(os.path.join(ckpt, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    keys = load_file(os.path.join(ckpt, "adapter_model.safetensors")).keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 2 * 7 * 2
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, ckpt).eval()
    got, want = logprobs(loaded.get_base_model()), logprobs(out["policy"])  # the wrapped model, peft's layers in it
    assert max((x - y).abs().max().item() for x, y in zip(got, want)) <= 1e-6
    optimizer = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=False)["optimizer"]
    assert len(optimizer["state"]) == len(keys)  # AdamW moments of the adapters alone


def test_export_is_the_merged_model_in_fp32_with_the_adapter_folder_beside_it(lora_run, tiny_model):
    """fp32, not bf16: a bf16 copy of W + (alpha/r) B A rounds most of a small update back to W."""
    out, run_dir = lora_run
    export = os.path.join(run_dir, "export-000003")
    saved = load_file(os.path.join(export, "model.safetensors"))
    merged = dict(lora.engine_weights(out["policy"]))
    assert all(saved[k].dtype == torch.float32 and torch.equal(saved[k], merged[k]) for k in saved)
    assert set(saved) <= set(merged) and json.load(open(os.path.join(export, "config.json")))["dtype"] == "float32"
    loaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert max((x - y).abs().max().item() for x, y in zip(logprobs(loaded), logprobs(out["policy"]))) <= 1e-4
    adapter = os.path.join(export, "adapter")
    assert json.load(open(os.path.join(adapter, "adapter_config.json")))["lora_alpha"] == 8
    assert load_file(os.path.join(adapter, "adapter_model.safetensors")).keys() == \
        load_file(os.path.join(run_dir, "ckpt-000003", "adapter_model.safetensors")).keys()


def test_eval_reads_an_adapter_checkpoint_as_its_merged_model_on_hf(lora_run, tmp_path, monkeypatch):
    import eval as evaluation
    from model import resolve_model

    monkeypatch.setenv("P2O_CACHE", str(tmp_path / "cache"))
    out, run_dir = lora_run
    ckpt = os.path.join(run_dir, "latest")
    folder = resolve_model(ckpt)
    assert folder.startswith(str(tmp_path / "cache")) and resolve_model(ckpt) == folder  # merged once, reused
    merged = load_file(os.path.join(folder, "model.safetensors"))
    ours = dict(lora.engine_weights(out["policy"]))
    for k, v in merged.items():  # peft's merge and ours, both in fp32 and kept in fp32
        assert v.dtype == torch.float32 and (v - ours[k]).abs().max().item() <= 1e-6 * ours[k].abs().max().item(), k
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"e{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(2)))
    result = tmp_path / "eval.json"
    assert evaluation.main([f"--model={ckpt}", "--backend=hf", f"--data={data}", "--k=0", "--max_tokens=4",
                            f"--out={result}", "--dtype=float32"]) in (0, None)
    assert json.load(open(result))["results"]


KEPT = []  # engines a test started, alive until the session ends


def test_eval_serves_an_adapter_checkpoint_and_an_export_as_vllms_lora_on_the_base(lora_run, model_path, tmp_path):
    """On vLLM, eval.py takes the base and serves the adapters unmerged (what training sampled): a fresh
    engine's log-probs are the adapted policy's. (The tiny model's head size is not one vLLM-CPU runs.)"""
    import eval as evaluation
    from tests.test_rollout import reference_logprobs

    run_dir = lora_run[1]
    assert served_adapter(os.path.join(run_dir, "latest")) == os.path.join(run_dir, "latest")
    assert served_adapter(os.path.join(run_dir, "export-000003")) == os.path.join(run_dir, "export-000003",
                                                                                       "adapter")
    assert served_adapter(model_path) is None
    policy = randomise_adapters(adapted(model_path, rank=8, alpha=16), seed=2, scale=0.02)
    ckpt = tmp_path / "ckpt"
    lora.save_adapter(policy, lora.adapter_state(policy), str(ckpt))
    (ckpt / "train_config.json").write_text(json.dumps({"model": model_path}))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"e{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(2)))
    args = evaluation.parse_args([f"--model={ckpt}", f"--data={data}", "--k=0", "--max_tokens=8",
                                  f"--out={tmp_path / 'e.json'}", "--dtype=float32"])
    benchmarks, template, chat_kwargs = evaluation.load_inputs(args)
    engine = evaluation.make_engine(args, benchmarks, template, chat_kwargs, 0)
    KEPT.append(engine)  # never closed nor collected: vLLM's shutdown would end the session engines' groups too
    assert engine.adapter is not None and engine.lora_rank == 8
    samples = [s for g in engine.generate(["What is 1 + 1?"], n=3, temperature=1.0, max_tokens=12, logprobs=True,
                                          seed=0) for s in g]
    gap = max((reference_logprobs(policy, s) - torch.tensor(s.logprobs)).abs().max().item() for s in samples)
    with lora.adapters_off(policy):
        base = max((reference_logprobs(policy, s) - torch.tensor(s.logprobs)).abs().max().item() for s in samples)
    assert gap <= 1e-3 < base, (gap, base)


def test_resume_is_exact_with_lora(tiny_model, tmp_path):
    full = train.train(lora_config(tiny_model, tmp_path / "a", max_steps=4, save_every=0, export_every=0),
                       reward_fn=parity_reward)
    train.train(lora_config(tiny_model, tmp_path / "b", max_steps=2, export_every=0), reward_fn=parity_reward)
    resumed = train.train(lora_config(tiny_model, tmp_path / "b", max_steps=4, resume="auto", export_every=0),
                          reward_fn=parity_reward)
    a, b = dict(full["policy"].named_parameters()), dict(resumed["policy"].named_parameters())
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_a_lora_push_into_vllm_is_verified_and_the_engine_samples_from_the_adapted_weights(vllm_engine, hf_model,
                                                                                          model_path):
    from tests.test_rollout import PROMPTS as CHAT, reference_logprobs

    policy = randomise_adapters(adapted(model_path, rank=8, alpha=16), seed=3, scale=0.02)
    base = vllm_engine.generate(CHAT, n=1, temperature=1.0, max_tokens=12, logprobs=True, seed=4)
    try:
        report = vllm_engine.push_weights(lora.engine_weights(policy, vllm_engine.dtype))
        assert report["verified"] > 0
        groups = vllm_engine.generate(CHAT, n=2, temperature=1.0, max_tokens=12, logprobs=True, seed=4)
        with lora.adapters_off(policy):
            off = max((reference_logprobs(policy, s) - torch.tensor(s.logprobs)).abs().max().item()
                      for g in groups for s in g)
        worst = max((reference_logprobs(policy, s) - torch.tensor(s.logprobs)).abs().max().item()
                    for g in groups for s in g)
        assert worst <= 1e-3 < off  # the adapted model's log-probs, not the base's
        # a push that misses a layer still raises (vLLM-CPU repacks linear weights into opaque buffers, so
        # here the checksums see a layer's norms; on a GPU every parameter is checked: rollout.push_weights)
        with pytest.raises(WeightPushError, match="not in the pushed state dict"):
            vllm_engine.push_weights((k, v) for k, v in lora.engine_weights(policy) if "layers.3." not in k)
    finally:
        vllm_engine.push_weights(hf_model.state_dict())
    again = vllm_engine.generate(CHAT, n=1, temperature=1.0, max_tokens=12, logprobs=True, seed=4)
    assert [g[0].logprobs for g in again] == [g[0].logprobs for g in base]


class SpyEngine:
    """The session's LoRA engine, recording what every push gave it (one adapter tensor) and whether each
    call sampled with the adapters. Greedy answers (GEPA's) are marked so that the scripted reward fails them:
    the round has failures to reflect on."""

    def __init__(self, engine):
        self.engine, self.q_proj_b, self.calls = engine, [], []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, adapters=True, **kw):
        self.calls.append((kw.get("temperature"), adapters))
        groups = self.engine.generate(prompts, adapters=adapters, **kw)
        if kw.get("temperature") == 0:
            for s in (s for g in groups for s in g):
                s.text += " <greedy>"
        return groups

    def push_adapters(self, state, *args):
        self.q_proj_b.append(state["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].clone())
        return self.engine.push_adapters(state, *args)

    def push_weights(self, weights):
        raise AssertionError("a LoRA engine's base never moves")


def test_a_short_p2o_run_with_lora_on_the_shipped_model_with_a_self_ref_gepa_round(lora_engine, model_path, tmp_path):
    """P²O end to end on the real model and a bf16 LoRA engine: each step's adapters pushed as vLLM's LoRA,
    a GEPA round whose Self-Ref reflector is the engine's base alone (no weights move), the policy's
    adapters served again after it."""
    from data import load_jsonl

    hard = [p for p in load_jsonl("builtin-train")[0] if p.source == "builtin/two_step"][:6]
    data = tmp_path / "six.jsonl"
    data.write_text("".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n" for p in hard))
    cfg = train.Config(model=model_path, train_data=str(data), dev_data="", prompts_per_step=3, group_size=4,
                       max_tokens=32, epochs=2, gepa_min_hard=1, gepa_budget=12, gepa_parents=2, gepa_minibatch=2,
                       reflect_max_tokens=64, eval_every=0, save_every=0, lora_rank=8, out_dir=str(tmp_path),
                       run_name="p2o-lora", seed=1)
    spy = SpyEngine(lora_engine)
    out = train.train(cfg, engine=spy, reward_fn=lambda text, p: 0.0 if text.endswith("<greedy>") else
                      parity_reward(text, p))
    assert out["step"] == 4 and out["gepa_history"][0]["ran"] and out["counts"]["reflection_calls"] > 0
    reflections = [c for c in spy.calls if c[0] == cfg.reflect_temperature]
    assert reflections and all(adapters is False for _, adapters in reflections)  # Self-Ref: the base alone
    assert all(adapters for t, adapters in spy.calls if t == cfg.temperature)  # rollouts: the policy
    final = out["policy"].model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert spy.q_proj_b and torch.equal(spy.q_proj_b[-1], final.detach().float().cpu()) and final.abs().sum() > 0
    assert lora_engine.adapter is not None and os.path.isfile(os.path.join(out["checkpoint"], "adapter_model.safetensors"))


def test_a_resume_keeps_the_checkpoints_lora_shape(lora_run, tmp_path):
    ckpt = os.path.join(lora_run[1], "ckpt-000002")
    for flag, value in (("lora_rank", 0), ("lora_rank", 8), ("lora_alpha", 16), ("lora_targets", "q_proj")):
        with pytest.raises(SystemExit, match=f"was trained with --{flag}=.*start a new run with --model="):
            train.resume_point(train.Config(resume=ckpt, **{flag: value}), given={"resume", flag})
    cfg, path, _ = train.resume_point(train.Config(resume=ckpt, lr=3e-3), given={"resume", "lr"})
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lr, path) == (4, 8, 3e-3, ckpt)


def test_self_refs_streams_from_a_gathered_state_dict_equal_the_live_policys(lora_run):
    """Under FSDP rank 0 reflects alone, from a state dict gathered before the round: its merged and
    adapters-off streams must be what the live policy streams."""
    policy = lora_run[0]["policy"]
    gathered = {k: v.clone() for k, v in policy.state_dict().items()}
    for (live, adapters), saved in zip(((lora.engine_weights(policy), True),
                                        (lora.engine_weights(policy, adapters=False), False)),
                                       lora.weight_streams(policy, gathered)):
        want, got = dict(live), dict(saved())
        assert want.keys() - {"lm_head.weight"} == got.keys() - {"lm_head.weight"}
        assert all(torch.equal(want[k], got[k]) for k in want if k in got), adapters


# ----------------------------------------------------------------------------- the bf16 LoRA engine (vLLM's LoRA)

# the adapters and the gaps of bench/lora_engine.py, which measures every way of serving them
from bench.lora_engine import QUESTIONS, gaps, sft_adapters  # noqa: E402


def engine_samples(engine, adapters=True):
    return [s for g in engine.generate(QUESTIONS, n=4, temperature=1.0, max_tokens=40, logprobs=True, seed=0,
                                       adapters=adapters) for s in g]


@pytest.mark.parametrize("lr", [1e-4, 3e-4])
def test_a_bf16_lora_engine_is_as_exact_as_full_training_where_a_bf16_merge_is_not(lora_engine, model_path, lr):
    """N2 (docs/GPU.md "LoRA"): adapters trained 10 Adam steps at 1e-4 (as far as ~100 steps at 1e-5: 84% of
    the merged elements round back to the base in bf16) and at 3e-4 (~300 steps), on a bf16 base. Served as
    vLLM's LoRA the engine sits as close to the trainer as an engine holding the same weights does (the
    floor: the base engine against the base trainer, kernels and bf16 rounding on both sides); merged into
    the bf16 weights (the old push) it does not. At ~300 steps the adapters move the policy 20x that floor
    and the engine's gap is within a tenth of the base's; at ~100 steps they move it 5-7x, so no engine
    could be (measured here: 0.16)."""
    policy = sft_adapters(model_path, rank=32, lr=lr, steps=10)
    floor, _, _ = gaps(policy, engine_samples(lora_engine, adapters=False), adapters=False)
    lora.push_policy(lora_engine, policy)
    engine, base, tokens = gaps(policy, engine_samples(lora_engine))
    assert tokens >= 200 and engine <= 1.3 * floor, (engine, floor, tokens)
    if lr >= 3e-4:
        assert engine <= 0.1 * base, (engine, base)

    merged = dict(lora.engine_weights(policy, torch.bfloat16))
    kept = [(merged[n.replace(".base_layer", "")] == w).float().mean().item()
            for n, w in policy.named_parameters() if n.endswith(".base_layer.weight")]
    assert sum(kept) / len(kept) > 0.6  # most merged elements round back to the base's
    try:
        lora_engine.push_weights(merged.items())
        merged_gap, _, _ = gaps(policy, engine_samples(lora_engine, adapters=False))
        assert merged_gap >= 1.25 * engine, (merged_gap, engine)
    finally:
        lora_engine.push_weights(lora.engine_weights(policy, torch.bfloat16, adapters=False))
    with pytest.raises(ValueError, match="loses every update"):  # and the old push is refused
        lora.push_policy(type("Bf16Engine", (), {"dtype": torch.bfloat16})(), policy)


def test_an_adapter_push_is_verified_and_a_failed_one_leaves_the_previous_adapter(lora_engine, model_path):
    from rollout import AdaptersOff

    policy = randomise_adapters(adapted(model_path, rank=8, alpha=16, dtype=torch.bfloat16), seed=5, scale=0.05)
    before = lora_engine.generate(QUESTIONS[:2], n=1, temperature=0.0, max_tokens=12, adapters=False)
    report = lora.push_policy(lora_engine, policy)
    assert report["pushed"] == sum(lora.is_adapter(n) for n, _ in policy.named_parameters())
    adapted_out = lora_engine.generate(QUESTIONS[:2], n=1, temperature=0.0, max_tokens=12)
    assert [g[0].text for g in adapted_out] != [g[0].text for g in before]  # the adapters act
    base_out = AdaptersOff(lora_engine).generate(QUESTIONS[:2], n=1, temperature=0.0, max_tokens=12)
    assert [g[0].text for g in base_out] == [g[0].text for g in before]  # and the base is untouched beside them

    # the check: a slot whose sums differ from what was sent (a layer sent nothing, a wrong value) raises
    sent = [("model.layers.0.self_attn.q_proj", "A", (0.0, 0.0)), ("model.layers.0.self_attn.q_proj", "B", (0.0, 0.0))]
    with pytest.raises(WeightPushError, match="qkv_proj does not hold the pushed A"):
        lora_engine._verify_adapter(lora_engine.adapter, sent)
    with pytest.raises(WeightPushError, match="no LoRA slot"):
        lora_engine._verify_adapter(lora_engine.adapter, [("model.layers.0.mlp.nope", "A", (1.0, 1.0))])
    # a push vLLM refuses raises and the engine keeps serving the adapters it had
    state = lora.adapter_state(policy)
    state["base_model.model.model.layers.0.mlp.nope.lora_A.weight"] = torch.ones(8, 576)
    first = lora_engine.adapter
    with pytest.raises(Exception):
        lora_engine.push_adapters(state, 8, 16, ["nope", *lora.targets_of(policy)])
    assert lora_engine.adapter == first and os.listdir(lora_engine._adapter_dir) == [os.path.basename(first.lora_path)]
    again = lora_engine.generate(QUESTIONS[:2], n=1, temperature=0.0, max_tokens=12)
    assert [g[0].text for g in again] == [g[0].text for g in adapted_out]
    with pytest.raises(WeightPushError, match="not a LoRA adapter tensor"):
        lora_engine.push_adapters({"model.embed_tokens.weight": torch.ones(2)}, 8, 16, ["q_proj"])


def test_an_engine_takes_adapters_up_to_its_rank_and_vllm_ranks_round_up():
    from rollout import engine_lora_rank

    assert [engine_lora_rank(r) for r in (1, 2, 8, 9, 32, 33, 320, 512)] == [1, 8, 8, 16, 32, 64, 320, 512]
    with pytest.raises(ValueError, match="above vLLM's largest"):
        engine_lora_rank(513)


def test_after_a_level_two_sleep_the_base_goes_back_before_the_adapters(tiny_model):
    """--vllm_sleep_level=2 drops the engine's weights: the frozen base is pushed again, then the adapters;
    a LoRA engine that kept its weights gets the adapters alone."""
    calls = []

    class Engine:
        dtype, lora_rank = torch.bfloat16, 8

        def __init__(self, level):
            self.sleep_level = level

        def push_weights(self, weights):
            calls.append(("weights", {k: v.clone() for k, v in weights}))

        def push_adapters(self, state, rank, alpha, targets):
            calls.append(("adapters", state, rank, alpha, targets))

    policy = randomise_adapters(adapted(tiny_model, rank=4, alpha=8, dtype=torch.bfloat16), seed=1, scale=0.1)
    lora.push_policy(Engine(2), policy)
    assert [c[0] for c in calls] == ["weights", "adapters"]
    base = calls[0][1]["model.layers.0.self_attn.q_proj.weight"]
    assert base.dtype == torch.bfloat16 and torch.equal(base, policy.model.layers[0].self_attn.q_proj.base_layer.weight)
    assert calls[1][2:] == (4, 8, lora.targets_of(policy)) and calls[1][1].keys() == lora.adapter_state(policy).keys()
    calls.clear()
    lora.push_policy(Engine(1), policy)
    assert [c[0] for c in calls] == ["adapters"]
