"""train.py: config parsing, the prompt stream, response log-probs, the policy update, and end-to-end GRPO /
P²O runs on a tiny random Llama (HF backend, scripted rewards): exact resume, NaN guard, signals, every flag."""

import json
import math
import os

import pytest
import torch

import config

import rollout
import train
from conftest import (MarkingEngine, full_logits_logprobs, load_tiny, p2o_config, parity_reward, read_metrics,
                      scripted_reflector, small_data, some_rows, templated_reward, tiny_config, update_config)
from config import Config, parse_overrides
from data import PromptStream, hold_out


def test_overrides_are_type_checked():
    cfg = parse_overrides(Config(), ["--lr=2e-6", "--dynamic_sampling=true", "--group_size=12"])
    assert (cfg.lr, cfg.dynamic_sampling, cfg.group_size) == (2e-6, True, 12)
    with pytest.raises(SystemExit, match="unknown setting"):
        parse_overrides(Config(), ["--lrr=1"])
    with pytest.raises(SystemExit, match="expects a int"):
        parse_overrides(Config(), ["--group_size=1.5"])
    with pytest.raises(SystemExit, match="expects a bool"):
        parse_overrides(Config(), ["--dynamic_sampling=maybe"])


def test_prompt_stream_epochs_and_state():
    items = list(range(5))
    s = PromptStream(items, seed=1)
    first = s.take(0, 5)
    assert sorted(first) == items and s.epoch_of(5) == 1
    second = s.take(5, 5)
    assert sorted(second) == items and first != second  # a new order each epoch
    resumed = PromptStream(items, seed=1)  # a new stream at a saved position
    assert resumed.take(6, 3) == second[1:4]
    assert resumed.take(3, 4) == first[3:]  # never past the epoch's end: the epoch's last step is short
    assert [len(s.take(p, 2)) for p in (0, 2, 4)] == [2, 2, 1] and s.steps_per_epoch(2) == 3


def test_no_step_straddles_an_epoch(tiny_model, tmp_path):
    """Issue 20: with 6 prompts and B = 4 each epoch is a step of 4 and a short step of 2. Every
    epoch's steps hold each prompt once, and the hard set GEPA gets after epoch 0 holds exactly
    the prompts that had < tau successes in epoch 0 (the straddling step used to train 2 prompts
    of epoch 1's order in epoch 0, mine them into its hard set, and skip their templates)."""
    data = small_data(tmp_path)
    out = train.train(p2o_config(tiny_model, tmp_path, data, prompts_per_step=4, log_rollouts=10),
                      engine=MarkingEngine(tiny_model), reward_fn=templated_reward, reflector=scripted_reflector())
    m = read_metrics(tmp_path / "t")
    assert [(x["epoch"], len(x["prompt_ids"])) for x in m] == [(0, 4), (0, 2), (1, 4), (1, 2)] and out["step"] == 4
    for epoch in (0, 1):
        ids = [i for x in m if x["epoch"] == epoch for i in x["prompt_ids"]]
        assert sorted(ids) == [f"q{i}" for i in range(6)]
    groups = [json.loads(line) for line in (tmp_path / "t" / "rollouts.jsonl").read_text().splitlines()]
    hard0 = {g["id"] for g in groups if g["step"] <= 2 and sum(g["rewards"]) < 2}
    assert out["gepa_history"][0]["hard"] == len(hard0) == 6  # plain rollouts never earn the scripted reward
    assert [h["hard"] for h in out["gepa_history"]] == [6, sum(sum(g["rewards"]) < 2 for g in groups if g["step"] > 2)]


def test_two_steps_end_to_end(tiny_model, tmp_path):
    cfg = tiny_config(tiny_model, tmp_path)
    out = train.train(cfg, reward_fn=parity_reward)
    m = read_metrics(os.path.join(str(tmp_path), "t"))
    assert [x["step"] for x in m] == [1, 2]
    for x in m:
        assert len(x["prompt_ids"]) == 3 and x["trained_rows"] > 0 and x["grad_norm"] > 0
        assert 0 < x["entropy"] and x["response_len_max"] <= 6
        assert abs(x["loss"]) < 1e-6  # rho == 1 with one update per batch
    ckpt = out["checkpoint"]
    assert os.path.basename(ckpt) == "ckpt-000002"
    assert os.readlink(os.path.join(str(tmp_path), "t", "latest")) == "ckpt-000002"
    from transformers import AutoModelForCausalLM
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model)
    moved = any(not torch.equal(a, b) for a, b in zip(reloaded.parameters(), initial.parameters()))
    assert moved
    for a, b in zip(reloaded.parameters(), out["policy"].parameters()):
        assert torch.equal(a, b)


def test_resume_is_exact(tiny_model, tmp_path):
    full = train.train(tiny_config(tiny_model, tmp_path / "a", max_steps=4, save_every=0), reward_fn=parity_reward)
    train.train(tiny_config(tiny_model, tmp_path / "b", max_steps=2), reward_fn=parity_reward)
    resumed = train.train(tiny_config(tiny_model, tmp_path / "b", max_steps=4, resume="auto"),
                          reward_fn=parity_reward)
    ma, mb = read_metrics(tmp_path / "a" / "t"), read_metrics(tmp_path / "b" / "t")
    assert [x["step"] for x in mb] == [1, 2, 3, 4]
    for x, y in zip(ma, mb):
        assert x["prompt_ids"] == y["prompt_ids"] and x["reward_mean"] == y["reward_mean"]
    worst = max((a - b).abs().max().item() for a, b in zip(full["policy"].parameters(),
                                                           resumed["policy"].parameters()))
    assert worst <= 1e-6  # stated tolerance; bit-exact in practice on CPU


def test_nan_steps_are_skipped_then_stop_after_saving(tiny_model, tmp_path, monkeypatch):
    real = train.grpo.aggregate
    monkeypatch.setattr(train.grpo, "aggregate", lambda *a, **k: real(*a, **k) * float("nan"))
    cfg = tiny_config(tiny_model, tmp_path, max_steps=5, max_bad_steps=2, save_every=0)
    with pytest.raises(RuntimeError, match="2 consecutive non-finite steps"):
        train.train(cfg, reward_fn=parity_reward)
    state = torch.load(tmp_path / "t" / "ckpt-000002" / "trainer.pt", weights_only=False)
    assert state["loop"]["skipped_steps"] == 2


def test_corrupt_checkpoint_is_reported(tmp_path):
    bad = tmp_path / "ckpt-000001"
    bad.mkdir()
    (bad / "trainer.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="corrupt checkpoint"):
        train.resume_point(Config(resume=str(bad)))  # runs.load_trainer_state, as a resume reads it


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tiny_model, tmp_path):
    import signal

    calls = {"n": 0}

    def reward_then_signal(text, problem):
        calls["n"] += 1
        if calls["n"] == 3 * 4 + 1:  # during the second step's scoring
            os.kill(os.getpid(), signal.SIGTERM)
        return parity_reward(text, problem)

    out = train.train(tiny_config(tiny_model, tmp_path, max_steps=10, save_every=0), reward_fn=reward_then_signal)
    assert out["interrupted"] and out["step"] == 2  # the step in flight was finished
    assert os.path.basename(out["checkpoint"]) == "ckpt-000002"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


def test_one_p2o_epoch_end_to_end(tiny_model, tmp_path):
    data = small_data(tmp_path)
    out = train.train(p2o_config(tiny_model, tmp_path, data), engine=MarkingEngine(tiny_model),
                      reward_fn=templated_reward, reflector=scripted_reflector())
    run = tmp_path / "t"
    archive = json.loads((run / "gepa-epoch-0.json").read_text())
    assert archive["pool"][0] == "" and len(archive["scores"]) == len(archive["pool"])
    assert all(len(row) == len(archive["dev_ids"]) for row in archive["scores"])
    accepted = [e for e in archive["log"] if e["outcome"] == "accepted"]
    assert accepted and all(e["template"].startswith("Approach") for e in accepted)
    history = out["gepa_history"]
    assert history[0]["ran"] and history[0]["hard"] >= 1 and history[0]["accepted"] == len(accepted)
    assert set(archive["assignment"]) <= {f"q{i}" for i in range(6)}
    m = read_metrics(run)
    assert [x["epoch"] for x in m] == [0, 0, 1, 1]
    assert all(x["templated_row_fraction"] == 0 for x in m[:2])  # epoch 0 is plain GRPO
    assert sum(x["templated_row_fraction"] for x in m[2:]) > 0
    templated_groups = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    for g in templated_groups:
        if any(g["templates"]):
            assert set(g["templates"]) <= set(archive["pool"]) and len(g["templates"]) == 4
            assert g["id"] in archive["assignment"]
    c = out["counts"]
    assert c["gepa_dev_rollouts"] > 0 and c["gepa_minibatch_rollouts"] > 0 and c["reflection_calls"] > 0
    assert c["train_rollouts"] == 4 * 3 * 4


def test_p2o_resume_restores_hard_set_templates_and_accounting(tiny_model, tmp_path):
    data = small_data(tmp_path)
    full = train.train(p2o_config(tiny_model, tmp_path / "a", data), engine=MarkingEngine(tiny_model),
                       reward_fn=templated_reward, reflector=scripted_reflector())
    train.train(p2o_config(tiny_model, tmp_path / "b", data, max_steps=3, save_every=3),
                engine=MarkingEngine(tiny_model), reward_fn=templated_reward, reflector=scripted_reflector())
    state = torch.load(tmp_path / "b" / "t" / "ckpt-000003" / "trainer.pt", weights_only=False)
    loop = state["loop"]
    assert loop["epoch"] == 1 and loop["assignment"] and loop["counts"]["reflection_calls"] > 0
    resumed = train.train(p2o_config(tiny_model, tmp_path / "b", data, resume="auto"), given={"resume", "max_steps"},
                          engine=MarkingEngine(tiny_model), reward_fn=templated_reward, reflector=scripted_reflector())
    ma, mb = read_metrics(tmp_path / "a" / "t"), read_metrics(tmp_path / "b" / "t")
    assert [x["step"] for x in mb] == [1, 2, 3, 4]
    for x, y in zip(ma, mb):
        for key in ("prompt_ids", "reward_mean", "templated_row_fraction", "hard_so_far", "crm_masked_fraction"):
            assert x[key] == y[key], key
    untimed = lambda history: [{k: v for k, v in h.items() if k != "seconds"} for h in history]  # noqa: E731
    assert full["counts"] == resumed["counts"]
    assert untimed(full["gepa_history"]) == untimed(resumed["gepa_history"])
    worst = max((a - b).abs().max().item() for a, b in zip(full["policy"].parameters(), resumed["policy"].parameters()))
    assert worst <= 1e-6


@pytest.mark.parametrize("flags", [
    dict(dynamic_sampling=True, max_refills=1),
    dict(kl_beta=0.1, ppo_epochs=2, dual_clip=3.0, eps_high=0.28),
    dict(crm_soft=True, crm_denominator="kept"),
    dict(context_distill=False),
    dict(same_template_per_group=True, crm=False),
    dict(adv_norm="none", loss_agg="seq-mean-token-sum-norm", gradient_checkpointing=True),
    dict(loss_agg="seq-mean-token-mean", algo="grpo"),
    dict(mini_batches=2, tis_cap=2.0, prompt_format="official"),
    dict(bare_rollout=True, drop_failed_templated=True, gepa_auto="light", gepa_dev_max=2),
])
def test_every_ablation_flag_runs_end_to_end(tiny_model, tmp_path, flags):
    data = small_data(tmp_path)
    out = train.train(p2o_config(tiny_model, tmp_path, data, **flags), engine=MarkingEngine(tiny_model),
                      reward_fn=templated_reward, reflector=scripted_reflector())
    m = read_metrics(tmp_path / "t")
    assert out["step"] == 4 and len(m) == 4 and all(math.isfinite(x["grad_norm"]) for x in m)
    if flags.get("algo") == "grpo":
        assert not out["gepa_history"] and all(x["templated_row_fraction"] == 0 for x in m)
    if flags.get("same_template_per_group"):
        for line in (tmp_path / "t" / "rollouts.jsonl").read_text().splitlines():
            assert len(set(json.loads(line)["templates"])) == 1
    if flags.get("bare_rollout"):
        groups = [json.loads(line) for line in (tmp_path / "t" / "rollouts.jsonl").read_text().splitlines()]
        templated = [g["templates"] for g in groups if any(g["templates"])]
        assert templated and all(t[0] == "" and all(t[1:]) for t in templated)
        assert json.loads((tmp_path / "t" / "gepa-epoch-0.json").read_text())["budget"] == 4 * 2 + 380  # light, |dev| 2
        assert sum(x["dropped_failed_templated"] for x in m) > 0


def test_drop_failed_templated_keeps_them_in_the_advantages_only(tiny_model):
    from transformers import AutoTokenizer

    from data import Problem
    from rollout import Sample

    tok = AutoTokenizer.from_pretrained(tiny_model)
    problem = Problem("q0", "What is 2 + 3?", "5")
    samples = [Sample([1, 2, 3], [10 + i, 2], f"answer {i}", "stop", [-0.5, -0.1]) for i in range(4)]
    group = train.Group(problem, samples, ["", "Add.", "Add.", "Add."], [0.0, 1.0, 0.0, 1.0])
    cfg = train.Config(group_size=4, drop_failed_templated=True)
    rows = train.training_rows([group], cfg, tok)
    # the group's advantages use all four rewards: mean 0.5, std (unbiased) 0.5774 -> +-0.866
    assert [r.response_ids[0] for r in rows] == [10, 11, 13]  # the failed templated rollout (12) is dropped
    assert [round(r.advantage, 3) for r in rows] == [-0.866, 0.866, 0.866]  # the bare failure stays
    assert rows[0].tilde_prompt_ids is None and rows[1].tilde_prompt_ids == [1, 2, 3]  # x~ kept for the CRM
    assert len(train.training_rows([group], train.Config(group_size=4), tok)) == 4  # off: every rollout


# ----------------------------------------------------------------------------- pieces of one step


def test_response_logprobs_equal_a_full_logits_gather(tiny_model):
    model = load_tiny(tiny_model)
    ids, attention, response = train.grpo.make_batch([[5, 6, 7], [8]], [[9, 10, 2], [11, 12, 13, 2]], pad_id=2)
    mask = response[:, 1:]
    with torch.no_grad():
        logp, ent = train.response_logprobs(model, ids, attention, mask, 0.6, with_entropy=True)
    want, want_ent = full_logits_logprobs(model, ids, attention, mask, 0.6)
    assert torch.allclose(logp.double(), want, atol=1e-5) and (logp[~mask] == 0).all()
    assert torch.allclose(ent.double(), want_ent, atol=1e-4)
    rows = train.row_logprobs(model, [[5, 6, 7], [8]], [[9, 10, 2], [11, 12, 13, 2]], 2, 0.6)
    assert [len(r) for r in rows] == [3, 4]
    assert torch.allclose(rows[1].double(), want[1][mask[1]], atol=1e-5)


def band_masking_the_largest_ratio(model, row):
    """(low, high) that keep every templated token but the one with the largest c_t."""
    plain = train.row_logprobs(model, [row.prompt_ids], [row.response_ids], 2, 1.0)[0].detach()
    tilde = train.row_logprobs(model, [row.tilde_prompt_ids], [row.response_ids], 2, 1.0)[0].detach()
    c = (plain - tilde).double().exp().sort().values
    assert c[-1] > c[-2] * 1.01
    return c[0].item() * 0.99, c[-1].item() * 0.999


def test_a_non_finite_later_ppo_epoch_leaves_no_trace(tiny_model, monkeypatch):
    """Finding: with ppo_epochs > 1 the earlier epochs' optimizer steps were kept when a later
    epoch was non-finite, while the step was reported skipped (and the engine not pushed)."""
    model = load_tiny(tiny_model)
    cfg = update_config(ppo_epochs=2)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    assert train.policy_update(model, None, opt, some_rows(), cfg, pad_id=2).finite  # non-empty AdamW state
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    calls = {"n": 0}
    real = train.grpo.aggregate

    def nan_in_second_epoch(*a, **k):
        calls["n"] += 1
        out = real(*a, **k)
        return out * float("nan") if calls["n"] > 2 else out  # 4 rows / micro-batch 2 = 2 calls an epoch

    monkeypatch.setattr(train.grpo, "aggregate", nan_in_second_epoch)
    update = train.policy_update(model, None, opt, some_rows(), cfg, pad_id=2)
    assert not update.finite and calls["n"] == 4
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, opt.state.values()))
    assert all(p.grad is None for p in model.parameters())


def test_a_non_finite_call_before_any_optimizer_step_leaves_an_empty_optimizer(tiny_model, monkeypatch):
    """The rollback snapshot (dist.cpu_snapshot, in CPU memory) of a fresh AdamW holds no
    state: after a non-finite second epoch the optimizer is empty again, so the next update is
    exactly the one a fresh optimizer takes."""
    cfg = update_config(ppo_epochs=2)
    model, fresh = load_tiny(tiny_model), load_tiny(tiny_model)
    opt, fresh_opt = (torch.optim.AdamW(m.parameters(), lr=cfg.lr) for m in (model, fresh))
    snapshot = train.dist.cpu_snapshot(model, opt)
    assert all(t.device.type == "cpu" for t in snapshot[0]) and snapshot[1]["state"] == {}
    calls, real = {"n": 0}, train.grpo.aggregate

    def nan_in_second_epoch(*a, **k):
        calls["n"] += 1
        out = real(*a, **k)
        return out * float("nan") if calls["n"] > 2 else out

    monkeypatch.setattr(train.grpo, "aggregate", nan_in_second_epoch)
    assert not train.policy_update(model, None, opt, some_rows(), cfg, pad_id=2).finite
    monkeypatch.undo()
    assert len(opt.state) == 0
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    train.policy_update(model, None, opt, some_rows(), cfg, pad_id=2)
    train.policy_update(fresh, None, fresh_opt, some_rows(), cfg, pad_id=2)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name


def test_packed_layout_per_device():
    """auto packs under FlexAttention on CUDA and the dense mask on the CPU; flex is refused off
    CUDA (no CPU backward); under a dense mask, CUDA turns packing off past the packed length."""
    from config import SHARED_PROMPT_CUDA_MAX, packed_layout

    long = Config(micro_batch_size=8, max_tokens=1024)  # 8,192 response tokens in one packed sequence
    assert SHARED_PROMPT_CUDA_MAX == 4096
    assert packed_layout(long, "cuda") == (True, "flex", None)
    assert packed_layout(long, "cpu") == (True, "dense", None)  # the CPU keeps its faster layout
    with pytest.raises(SystemExit, match="needs CUDA"):
        packed_layout(Config(packed_attention="flex"), "cpu")
    dense = dict(micro_batch_size=8, packed_attention="dense")
    shared, attention, reason = packed_layout(Config(max_tokens=1024, **dense), "cuda")
    assert (shared, attention) == (False, "dense") and "8 x 1024 = 8192" in reason
    assert packed_layout(Config(max_tokens=512, **dense), "cuda") == (True, "dense", None)  # 4,096: allowed
    assert packed_layout(Config(max_tokens=513, **dense), "cuda")[0] is False
    assert packed_layout(Config(max_tokens=1024, shared_prompt=False, **dense), "cuda") == (False, "dense", None)


def test_cpu_threads_share_the_cores_among_the_nodes_processes():
    from config import cpu_threads

    assert cpu_threads(0, cores=64, local_world=8) == 8
    assert cpu_threads(0, cores=6, local_world=4) == 1
    assert cpu_threads(0, cores=2, local_world=8) == 1  # never 0
    assert cpu_threads(3, cores=64, local_world=8) == 3  # --cpu_threads wins


def test_bf16_is_emulated_reads_the_cpu_flags(tmp_path):
    from config import bf16_is_emulated

    def cpuinfo(flags):
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 {flags}\n\n")
        return str(path)

    assert bf16_is_emulated("cpu", cpuinfo("avx512f"))  # AVX-512 without its bf16 extension: emulated
    assert not bf16_is_emulated("cpu", cpuinfo("avx512f avx512_bf16"))
    assert not bf16_is_emulated("cpu", cpuinfo("amx_tile amx_bf16"))
    assert not bf16_is_emulated("cpu", cpuinfo("bf16"))  # Arm's name
    assert bf16_is_emulated("cpu", cpuinfo("avx512_bf16_extra"))  # whole words only
    assert not bf16_is_emulated("cpu", str(tmp_path / "missing"))  # unknown: the settings stay as given
    assert not bf16_is_emulated("cuda", cpuinfo(""))


def test_cpu_fp32_fallback_turns_bf16_into_fp32_only_where_bf16_is_emulated():
    from config import cpu_precision

    default = Config()
    assert (default.engine_dtype, default.autocast_bf16, default.cpu_fp32_fallback) == ("bfloat16", True, True)
    engine, autocast, note = cpu_precision(default, "cpu", emulated=True)
    assert (engine, autocast) == ("float32", False) and "--cpu_fp32_fallback=False" in note
    assert cpu_precision(default, "cpu", emulated=False) == ("bfloat16", True, None)
    assert cpu_precision(default, "cuda", emulated=True) == ("bfloat16", True, None)
    assert cpu_precision(Config(cpu_fp32_fallback=False), "cpu", emulated=True) == ("bfloat16", True, None)
    assert cpu_precision(Config(engine_dtype="float16"), "cpu", emulated=True)[:2] == ("float16", False)
    assert cpu_precision(Config(autocast_bf16=False), "cpu", emulated=True)[:2] == ("float32", False)
    assert cpu_precision(Config(engine_dtype="float32", autocast_bf16=False), "cpu", emulated=True)[2] is None


def test_a_run_on_a_cpu_that_emulates_bf16_trains_and_saves_fp32(tiny_model, tmp_path, monkeypatch, capsys):
    import config

    monkeypatch.setattr(config, "bf16_is_emulated", lambda device_type: device_type == "cpu")
    cfg = tiny_config(tiny_model, tmp_path, train_data=small_data(tmp_path), max_steps=1, save_every=1,
                      autocast_bf16=True, device="cpu")
    train.train(cfg, reward_fn=parity_reward)
    out = capsys.readouterr().out
    assert "this CPU has no bf16 instructions" in out and '"autocast_bf16": false' in out  # the settings printed
    saved = json.loads((tmp_path / "t" / "latest" / "train_config.json").read_text())
    assert (saved["engine_dtype"], saved["autocast_bf16"]) == ("float32", False)  # a resume keeps the precision


def test_kept_denominator_loss_is_logged_once_per_step_not_compounded(tiny_model):
    """Finding: with crm_denominator=kept and ppo_epochs > 1 the logged loss was divided by the
    kept count once per epoch. With lr = 0 both epochs see the same weights, so the logged loss is
    -sum_rows A sum_t w_t / sum(w), computed here from a full-logits reference."""
    model = load_tiny(tiny_model)
    rows = some_rows()
    low, high = band_masking_the_largest_ratio(model, rows[2])
    cfg = update_config(ppo_epochs=2, crm_denominator="kept", crm_low=low, crm_high=high, lr=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    update = train.policy_update(model, None, opt, rows, cfg, pad_id=2)
    templated = rows[2]
    plain = train.row_logprobs(model, [templated.prompt_ids], [templated.response_ids], 2, 1.0)[0].detach()
    tilde = train.row_logprobs(model, [templated.tilde_prompt_ids], [templated.response_ids], 2, 1.0)[0].detach()
    w, _ = train.distill.crm_weights(plain, tilde, low, high)
    assert 0 < w.sum() < len(w)  # some, not all, of the templated tokens are masked
    weight_mass = sum(len(r.response_ids) for r in rows) - len(w) + w.sum().item()
    expected = -sum(r.advantage * (w.sum().item() if r is templated else len(r.response_ids)) for r in rows) / weight_mass
    assert update.finite and update.loss == pytest.approx(expected, abs=1e-5)
    assert update.sums["crm_out_of_band_tokens"] == int((w == 0).sum())


def test_kl_term_is_not_weighted_by_the_crm(tiny_model):
    """Intended: the CRM weight multiplies the policy-gradient term only (as the reference code);
    the k3 KL term counts every response token, masked or not."""
    model = load_tiny(tiny_model)
    reference = load_tiny(tiny_model).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    Row = train.Row
    rows = [Row([5, 6], [14, 3, 2], 0.0, tilde_prompt_ids=[30, 31, 5, 6]), Row([8], [11, 12, 2], 0.0)]
    cfg = update_config(kl_beta=0.5)
    cfg.crm_low, cfg.crm_high = band_masking_the_largest_ratio(model, rows[0])
    update = train.policy_update(model, reference, torch.optim.AdamW(model.parameters(), lr=0.0), rows, cfg, pad_id=2)
    assert update.sums["crm_out_of_band_tokens"] > 0  # the mask is active on the templated row
    ids, attention, response = train.grpo.make_batch([r.prompt_ids for r in rows], [r.response_ids for r in rows], 2)
    mask = response[:, 1:]
    logp, _ = full_logits_logprobs(model, ids, attention, mask, 1.0)
    ref, _ = full_logits_logprobs(reference, ids, attention, mask, 1.0)
    d = (ref - logp)[mask]
    expected = 0.5 * (d.exp() - d - 1).sum().item() / mask.sum().item()  # every token, weight 1
    assert update.loss == pytest.approx(expected, rel=1e-4)


def test_resuming_an_earlier_checkpoint_starts_a_clean_branch(tiny_model, tmp_path):
    """Finding: after resuming from ckpt-2 of a run that reached ckpt-4, the new branch never
    replaced ckpt-4 (the old branch's weights stayed, `latest` pointed into it) and metrics.jsonl
    held steps 3 and 4 twice."""
    train.train(tiny_config(tiny_model, tmp_path, max_steps=4, save_every=2), reward_fn=parity_reward)
    run = tmp_path / "t"
    old4 = load_tiny(str(run / "ckpt-000004"))
    out = train.train(tiny_config(tiny_model, tmp_path, max_steps=4, save_every=2, lr=5e-3,
                                  resume=str(run / "ckpt-000002")), reward_fn=parity_reward)
    assert [x["step"] for x in read_metrics(run)] == [1, 2, 3, 4]
    assert os.readlink(run / "latest") == "ckpt-000004"
    new4 = load_tiny(str(run / "ckpt-000004"))
    assert all(torch.equal(a, b) for a, b in zip(new4.parameters(), out["policy"].parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(new4.parameters(), old4.parameters()))  # lr differs
    assert [x["lr"] for x in read_metrics(run)] == [1e-3, 1e-3, 5e-3, 5e-3]  # --lr given on resume applies
    (abandoned,) = (run / "abandoned").iterdir()  # the old branch is set aside, not lost
    assert (abandoned / "ckpt-000004").is_dir()
    assert [json.loads(line)["step"] for line in (abandoned / "metrics.jsonl").read_text().splitlines()] == [3, 4]


def test_resume_auto_before_the_first_checkpoint_starts_from_scratch(tiny_model, tmp_path):
    """A run killed before its first checkpoint has nothing to resume: --resume=auto starts it over."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "metrics.jsonl").write_text('{"step": 1, "partial": tru')  # a line cut by a kill
    out = train.train(tiny_config(tiny_model, tmp_path, max_steps=1, resume="auto"), reward_fn=parity_reward)
    assert out["step"] == 1 and [x["step"] for x in read_metrics(tmp_path / "t")] == [1]


# ----------------------------------------------------------------------------- devices and engine sizing


def test_pick_device():
    assert train.pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert train.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(SystemExit, match="auto | cpu | cuda"):
        train.pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            train.pick_device("cuda")


def test_chat_template_kwargs_setting():
    assert train.chat_template_kwargs(Config()) == {}
    assert train.chat_template_kwargs(Config(chat_template_kwargs='{"enable_thinking": false}')) == {"enable_thinking": False}
    for bad in ("enable_thinking=false", "[1, 2]"):
        with pytest.raises(SystemExit, match="JSON object"):
            train.chat_template_kwargs(Config(chat_template_kwargs=bad))


def test_context_length_covers_the_longest_prompt_template_and_answer(model_path):
    from transformers import AutoTokenizer

    from data import Problem
    from prompts import problem_messages
    from prompts import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_path)
    problems = [Problem("a", "What is 2 + 2?", "4"), Problem("b", "What is " + " + ".join(["7"] * 30) + "?", "210")]
    longest = len(encode_prompt(tok, problem_messages(problems[1])))
    grpo_cfg = Config(algo="grpo", max_tokens=100, max_template_chars=50)
    assert rollout.context_length(grpo_cfg, tok, problems, {}) == longest + 50 + 2 + 100
    assert rollout.context_length(Config(max_model_len=777), tok, problems, {}) == 777
    # P²O: a real reflection prompt with answers cut to reflect_answer_chars must fit with its reply
    cfg = Config(max_tokens=16, max_template_chars=40, reflect_answer_chars=60, reflect_max_tokens=30, gepa_minibatch=2)
    need = rollout.context_length(cfg, tok, problems, {})
    records = [train.gepa.reflection_record(p, "x9 " * 100, 60) for p in problems]
    meta = [{"role": "user", "content": train.gepa.meta_prompt("t" * 40, records)},
            {"role": "assistant", "content": train.gepa.DELIM_OPEN}]
    assert len(encode_prompt(tok, meta)) + 30 <= need
    assert need > longest + 40 + 2 + 16  # here the reflection prompt is the longer one
    # check_fit measures the context once and hands it to the engine's start (vLLM); the HF backend takes none
    for c in (grpo_cfg, cfg):
        c.model = model_path
        assert rollout.check_fit(c, problems, {}) == rollout.context_length(c, tok, problems, {})
    assert rollout.check_fit(Config(model=model_path, backend="hf"), problems, {}) is None


def test_truncated_importance_sampling_and_the_logged_mismatch(tiny_model):
    """Sampler log-probs = trainer log-probs - delta: the mismatch is |delta|, and with tis_cap = 2
    each token's policy-gradient term is weighted by min(exp(delta), 2)."""
    model = load_tiny(tiny_model)
    Row = train.Row
    prompts, responses = [[5, 6, 7], [8]], [[9, 10, 2], [11, 12, 13, 2]]
    old = [lp.detach() for lp in train.row_logprobs(model, prompts, responses, 2, 1.0)]
    deltas = [torch.tensor([0.0, math.log(1.5), math.log(3.0)]), torch.tensor([-0.5, 0.0, 0.2, 0.0])]
    rows = [Row(p, r, a, sampler_logp=(o - d).tolist()) for p, r, a, o, d in zip(prompts, responses, [1.0, -2.0], old, deltas)]
    cfg = update_config(tis_cap=2.0)
    update = train.policy_update(model, None, torch.optim.AdamW(model.parameters(), lr=0.0), rows, cfg, pad_id=2)
    capped = [d.exp().clamp(max=2.0) for d in deltas]  # [1, 1.5, 2] and [e^-0.5, 1, e^0.2, 1]
    expected = -(1.0 * capped[0].sum() - 2.0 * capped[1].sum()).item() / 7  # rho = 1; token-mean over 7 tokens
    assert update.loss == pytest.approx(expected, abs=1e-4)
    s = update.sums
    assert s["mismatch_tokens"] == 7
    assert s["mismatch_abs_sum"] / 7 == pytest.approx(sum(d.abs().sum() for d in deltas).item() / 7, abs=1e-4)
    assert s["mismatch_abs_max"] == pytest.approx(math.log(3.0), abs=1e-4)
    off = train.policy_update(model, None, torch.optim.AdamW(model.parameters(), lr=0.0), rows, update_config(), pad_id=2)
    assert off.loss == pytest.approx(-(1.0 * 3 - 2.0 * 4) / 7, abs=1e-4)  # tis_cap = 0: plain -A, mismatch still logged
    assert off.sums["mismatch_tokens"] == 7


def test_two_mini_batches_take_two_steps_the_second_off_policy(tiny_model):
    """mini_batches=2: one optimizer step on each half of the groups, each token-mean over its own
    tokens; the second step's ratio is against the log-probs from before the first step. Checked
    against the same two SGD steps written out with full-logits log-probs."""
    import copy

    Row = train.Row
    rows = [Row([5, 6, 7], [9, 10, 2], 1.0, group=0), Row([5, 6, 7], [11, 2], -1.0, group=0),
            Row([8, 4], [12, 13, 14, 2], 0.5, group=1), Row([8, 4], [15, 2], -0.5, group=1)]
    cfg = update_config(mini_batches=2, grad_clip=1e9, eps_low=0.01, eps_high=0.01)
    model = load_tiny(tiny_model)
    manual = copy.deepcopy(model)
    train.policy_update(model, None, torch.optim.SGD(model.parameters(), lr=0.5), rows, cfg, pad_id=2)

    def logp_of(m, part):
        ids, attention, response = train.grpo.make_batch([r.prompt_ids for r in part], [r.response_ids for r in part], 2)
        mask = response[:, 1:]
        logits = m(input_ids=ids, attention_mask=attention).logits[:, :-1]
        return train.grpo.token_logprobs(logits, ids[:, 1:], 1.0), mask.float()

    halves = [rows[:2], rows[2:]]
    with torch.no_grad():
        old = [logp_of(manual, h)[0] for h in halves]  # stored before the first step
    sgd = torch.optim.SGD(manual.parameters(), lr=0.5)
    for half, old_logp in zip(halves, old):
        sgd.zero_grad()
        logp, mask = logp_of(manual, half)
        loss, _ = train.grpo.ppo_clip_token_loss(logp, old_logp, torch.tensor([r.advantage for r in half]), 0.01, 0.01)
        ((loss * mask).sum() / mask.sum()).backward()  # token-mean over this mini-batch only
        sgd.step()
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), manual.parameters()))
    assert worst < 1e-5
    moved = load_tiny(tiny_model)
    assert max((a - b).abs().max().item() for a, b in zip(model.parameters(), moved.parameters())) > 1e-3


def test_hold_out_is_a_seeded_disjoint_split():
    items = list(range(20))
    train_part, dev_part = hold_out(items, 5, seed=1)
    assert len(dev_part) == 5 and sorted(train_part + dev_part) == items
    assert hold_out(items, 5, seed=1) == (train_part, dev_part)
    assert hold_out(items, 5, seed=2)[1] != dev_part
    with pytest.raises(SystemExit, match="dev_holdout"):
        hold_out(items, 20, seed=1)


def test_best_dev_checkpoint_is_kept_and_named(tiny_model, tmp_path):
    """The first dev evaluation after training is the best so far (a random tiny model scores 0
    throughout, and only a strictly better score moves `best`): ckpt-2 is saved and named `best`."""
    cfg = tiny_config(tiny_model, tmp_path, train_data=small_data(tmp_path), dev_holdout=2, eval_every=2, eval_k=0,
                      max_steps=4, save_every=0, prompts_per_step=2)
    train.train(cfg, reward_fn=parity_reward)
    run = tmp_path / "t"
    assert os.readlink(run / "best") == "ckpt-000002" and (run / "ckpt-000002" / "model.safetensors").exists()
    assert [json.loads(x)["step"] for x in (run / "dev.jsonl").read_text().splitlines()] == [0, 2, 4]
    loop = torch.load(run / "ckpt-000004" / "trainer.pt", weights_only=False)["loop"]
    assert (loop["best_step"], loop["best_dev"]) == (2, 0.0)


def test_help_lists_every_setting_with_its_default_type_and_comment():
    import dataclasses
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("  --")]
    fields = dataclasses.fields(Config)
    assert [words[0].split("=")[0] for words in lines] == [f"--{f.name}" for f in fields]  # all, in class order
    for f, words in zip(fields, lines):
        value = getattr(Config(), f.name)
        assert words[0] == f"--{f.name}={value}" and words[1] == type(value).__name__
        assert len(words) > 2, f"{f.name} has no comment in Config"
    for heading in ("model and data:", "rollouts:", "optimisation:", "schedule and outputs:"):
        assert heading in proc.stdout.splitlines()


def shared_rows():
    """Three groups sharing prompts within each group (responses of 1-9 tokens, some ending in
    EOS = pad = 2), one distilled templated row with its x~, and a fourth 'group' trained under two
    template prompts (the no-distillation ablation's layout); advantages of both signs."""
    import random

    rng = random.Random(7)
    Row, rows = train.Row, []
    for g in range(3):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(4, 12))]
        for k in range(4):
            response = [rng.randrange(3, 200) for _ in range(rng.randrange(1, 9))] + ([2] if k % 2 else [])
            tilde = [40, 41] + prompt if (g, k) == (1, 2) else None
            rows.append(Row(prompt, response, rng.choice([-1.0, -0.3, 0.6, 1.2]), tilde_prompt_ids=tilde, group=g))
    for k in range(4):
        prompt = [50 + k % 2, 60, 61, 62]
        rows.append(Row(prompt, [rng.randrange(3, 200) for _ in range(k + 2)], 0.5 - k * 0.3, group=3))
    return rows


def test_shared_prompt_logprobs_and_gradients_equal_the_row_layout(tiny_model):
    """Issue 9: each prompt forwarded once for all its rows gives the same log-probs and the same
    gradients as one row per response (float32, random weights)."""
    rows = shared_rows()
    prompts, responses = [r.prompt_ids for r in rows], [r.response_ids for r in rows]
    ids, attention, response_mask = train.grpo.make_batch(prompts, responses, 2)
    mask = response_mask[:, 1:]
    packed = train.grpo.pack_rows(prompts, responses, 2)
    assert packed.input_ids.shape[0] == 5 and packed.input_ids.numel() < ids.numel()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    results = []
    for p in (None, packed):
        model = load_tiny(tiny_model)
        logp, ent = train.response_logprobs(model, ids, attention, mask, 0.7, with_entropy=True, packed=p)
        (logp * weights).sum().backward()
        results.append((logp.detach(), ent, {n: q.grad for n, q in model.named_parameters()}))
    (a, ent_a, grad_a), (b, ent_b, grad_b) = results
    torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-6)  # fp32: ~1 ulp at |logp| ~ 15
    assert (b[~mask] == 0).all()
    torch.testing.assert_close(ent_b, ent_a, atol=2e-5, rtol=0)
    for name in grad_a:
        torch.testing.assert_close(grad_b[name], grad_a[name], atol=1e-5, rtol=1e-4)


def test_policy_update_with_shared_prompts_equals_the_row_layout(tiny_model):
    """The whole update (micro-batches, 2 mini-batches, CRM pass, KL to a reference) with and
    without shared prompts: same SGD step, same logged sums."""
    out = []
    for shared in (False, True):
        model, reference = load_tiny(tiny_model), load_tiny(tiny_model).eval()
        cfg = update_config(shared_prompt=shared, micro_batch_size=5, mini_batches=2, kl_beta=0.05,
                            crm_low=0.5, crm_high=2.0)
        update = train.policy_update(model, reference, torch.optim.SGD(model.parameters(), lr=0.5), shared_rows(), cfg, pad_id=2)
        out.append((update, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    (u0, p0), (u1, p1) = out
    assert u0.finite and u1.finite and u0.trained_rows == u1.trained_rows == 16
    assert u1.loss == pytest.approx(u0.loss, abs=1e-6) and u1.grad_norm == pytest.approx(u0.grad_norm, rel=1e-5)
    for key in ("kl_sum", "entropy_sum", "crm_templated_tokens", "crm_out_of_band_tokens", "crm_log_ratio_sum"):
        assert u1.sums[key] == pytest.approx(u0.sums[key], rel=1e-5, abs=1e-6), key
    assert u0.sums["crm_templated_tokens"] > 0
    for k in p0:
        torch.testing.assert_close(p1[k], p0[k], atol=1e-6, rtol=0)


def test_a_resumed_run_prints_its_whole_before_after_line(tiny_model, tmp_path, capsys):
    """Issue 10: the closing 'dev greedy accuracy: before -> after' line of a resumed run takes the
    first evaluation from dev.jsonl (it happened before the interruption)."""
    import re

    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"id": f"d{i}", "problem": f"What is {i} + 2?", "answer": str(i + 2)}) + "\n"
                           for i in range(3)))
    over = dict(dev_data=str(dev), eval_every=1, eval_k=0)
    train.train(tiny_config(tiny_model, tmp_path, **over), reward_fn=parity_reward)
    capsys.readouterr()
    train.train(tiny_config(tiny_model, tmp_path, max_steps=4, resume="auto", **over), reward_fn=parity_reward)
    out = capsys.readouterr().out
    assert "dev @ step 0" not in out  # the first evaluation is not repeated ...
    assert re.search(r"dev greedy accuracy: \d\.\d{3} before \(step 0\) -> \d\.\d{3} after \(step 4; 3 problems\)", out)


def test_console_keeps_the_projects_lines_and_engine_logs_go_to_a_file(tmp_path):
    """Issue 10: a default-model run with vLLM prints its config, progress, dev evaluations and
    summary, and none of the engine's log lines (each weight push used to print ~240); those are
    in <run>/engine.log."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dev = tmp_path / "dev.jsonl"
    dev.write_text(json.dumps({"id": "d0", "problem": "What is 2 + 3?", "answer": "5"}) + "\n")
    proc = subprocess.run([sys.executable, "train.py", "--max_steps=2", "--prompts_per_step=4", "--group_size=4",
                           "--max_tokens=96", "--eval_every=1", "--eval_k=0", "--save_every=0", f"--dev_data={dev}",
                           f"--out_dir={tmp_path}", "--run_name=quiet", "--dynamic_sampling=True"],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = [line for line in (proc.stdout + proc.stderr).replace("\r", "\n").splitlines()
               if not line.startswith(' "')]  # the printed config names vllm settings
    engine_lines = [line for line in console if "(MainProcess pid=" in line or "vllm" in line.lower()
                    or "Loading weights" in line or "Writing model shards" in line]
    assert engine_lines == [], engine_lines[:5]
    text = "\n".join(console)
    assert "dev @ step 0" in text and "dev greedy accuracy" in text and '"max_steps": 2' in proc.stdout
    trained = [json.loads(line)["trained_rows"] for line in open(tmp_path / "quiet" / "metrics.jsonl")]
    log = (tmp_path / "quiet" / "engine.log").read_text()
    assert "vllm" in log and (sum(trained) == 0 or "Reloading and processing weights" in log)  # a push, if any


def test_time_summary_accounts_for_the_whole_wall_time():
    from collections import Counter

    line = train.time_summary(Counter({"train": 30.0, "generate": 50.0, "GEPA": 10.0}), 100.0)
    assert line == "wall time 100 s: generate 50 (50%), train 30 (30%), GEPA 10 (10%), other 10 (10%)"


def test_keep_checkpoints_keeps_the_newest_and_the_best(tiny_model, tmp_path):
    cfg = tiny_config(tiny_model, tmp_path, train_data=small_data(tmp_path), dev_holdout=2, eval_every=2, eval_k=0,
                      max_steps=4, save_every=1, keep_checkpoints=1, prompts_per_step=2)
    train.train(cfg, reward_fn=parity_reward)
    run = tmp_path / "t"
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000002", "ckpt-000004"]  # best, latest
    assert os.readlink(run / "best") == "ckpt-000002" and os.readlink(run / "latest") == "ckpt-000004"


def test_default_keeps_two_checkpoints_and_exports_are_bf16_model_folders_with_the_settings(tiny_model, tmp_path):
    """Disk defaults: the newest 2 checkpoints (+ best) stay; --export_every writes the model
    alone in bf16 (every N steps and the last) with train_config.json, and no export is pruned."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(tiny_model, tmp_path, train_data=small_data(tmp_path), dev_data="", max_steps=5, save_every=1,
                      export_every=2, prompts_per_step=2, chat_template_kwargs='{"x": 1}')
    assert Config().keep_checkpoints == 2
    out = train.train(cfg, reward_fn=parity_reward)
    run = tmp_path / "t"
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000004", "ckpt-000005"]
    assert sorted(p.name for p in run.glob("export-*")) == ["export-000002", "export-000004", "export-000005"]
    last = load_file(str(run / "export-000005" / "model.safetensors"))
    assert {v.dtype for v in last.values()} == {torch.bfloat16}
    master = {k: v for k, v in out["policy"].state_dict().items()}
    for name, value in last.items():  # the fp32 master weights rounded to bf16, exactly
        assert torch.equal(value, master[name].to(torch.bfloat16)), name
    assert "lm_head.weight" not in last  # tied to the embedding: stored once
    loaded = AutoModelForCausalLM.from_pretrained(str(run / "export-000005"))
    assert loaded.dtype == torch.bfloat16
    for folder in ("export-000002", "ckpt-000005"):
        saved = json.loads((run / folder / "train_config.json").read_text())
        assert saved["chat_template_kwargs"] == '{"x": 1}' and saved["export_every"] == 2
        assert saved["packed_attention"] == "auto"  # as given: a resume on a GPU chooses flex there


# ----------------------------------------------------------------------------- issue 20: latent bugs, config, resume


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # expected on the CPU
@pytest.mark.parametrize("implementation", ["sdpa", "eager", train.grpo.PACKED_FLEX])
def test_shared_prompt_packing_is_exact_under_each_supported_attention(tiny_model, implementation):
    """Bug: pack_rows' boolean 4D mask went to eager attention unchanged, which ADDS it to the
    scores (+1 / +0): every token saw every other (4.3 nats off). Checked in float64 against each
    row forwarded alone, under every attention implementation the packing supports (FlexAttention
    on the CPU: forward only, uncompiled; CUDA compiles the same call)."""
    from transformers import AutoModelForCausalLM

    from model import use_packed_flex

    flex = implementation == train.grpo.PACKED_FLEX
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64,
                                                 attn_implementation="sdpa" if flex else implementation)
    if flex:
        use_packed_flex(model)
    assert model.config._attn_implementation == implementation
    rows = shared_rows()
    prompts, responses = [r.prompt_ids for r in rows], [r.response_ids for r in rows]
    ids, attention, response_mask = train.grpo.make_batch(prompts, responses, 2)
    mask = response_mask[:, 1:]
    with torch.no_grad():
        packed, _ = train.response_logprobs(model, ids, attention, mask, 1.0,
                                            packed=train.grpo.pack_rows(prompts, responses, 2))
        for b, (p, r) in enumerate(zip(prompts, responses)):
            alone = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]  # [len(r), V]
            want = torch.log_softmax(alone, -1).gather(-1, torch.tensor(r).unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(packed[b][mask[b]].double(), want, atol=1e-5, rtol=0)  # logp is stored in fp32


def test_packing_refuses_an_attention_that_cannot_take_its_mask():
    block = torch.tensor([[-1, 0, 1]])  # a prompt token, then two one-token responses
    allowed = train.grpo.attention_mask_for(block, "sdpa")
    assert allowed.tolist() == [[[[True, False, False], [True, True, False], [True, False, True]]]]
    bias = train.grpo.attention_mask_for(block, "eager")
    assert bias.dtype == torch.float32 and (bias[allowed] == 0).all() and (bias[~allowed] < -1e30).all()
    with pytest.raises(ValueError, match="--shared_prompt=False"):
        train.grpo.attention_mask_for(block, "flash_attention_2")


def test_kept_denominator_counts_the_templated_rows_of_skipped_groups(tiny_model):
    """Bug: with crm_denominator=kept the CRM sums covered forwarded rows only, so the tokens of a
    skipped templated group (all its rollouts failed: advantages 0) counted at weight 1. The
    denominator is tokens - templated tokens + sum(w) over EVERY templated row; the logged
    masked fraction too. Expected values from each row's own CRM weights."""
    Row = train.Row
    tilde = [30, 31, 5, 6]
    rows = [Row([5, 6], [14, 3, 2], 1.0, tilde_prompt_ids=tilde, group=0),
            Row([5, 6], [15, 4, 9, 2], -0.25, tilde_prompt_ids=tilde, group=0),
            Row([7, 8], [16, 17, 2], 0.0, tilde_prompt_ids=[30, 31, 7, 8], group=1),  # the all-fail group:
            Row([7, 8], [18, 19, 20, 21, 2], 0.0, tilde_prompt_ids=[30, 31, 7, 8], group=1)]  # not forwarded
    model = load_tiny(tiny_model)
    log_c = []
    for r in rows:
        plain = train.row_logprobs(model, [r.prompt_ids], [r.response_ids], 2, 1.0)[0].detach()
        tilde_lp = train.row_logprobs(model, [r.tilde_prompt_ids], [r.response_ids], 2, 1.0)[0].detach()
        log_c.append(plain - tilde_lp)
    ordered = torch.cat(log_c).sort().values  # a band that keeps the middle of this model's ratios
    low, high = math.exp(ordered[3].item()) * 0.999, math.exp(ordered[11].item()) * 1.001
    w = [((c >= math.log(low)) & (c <= math.log(high))).float() for c in log_c]
    assert 0 < sum(x.sum().item() for x in w[2:]) < 8  # some tokens of the skipped group are masked
    cfg = update_config(crm_denominator="kept", crm_low=low, crm_high=high, lr=0.0)
    update = train.policy_update(model, None, torch.optim.AdamW(model.parameters(), lr=0.0), rows, cfg, pad_id=2)
    mass = sum(x.sum().item() for x in w)  # every row is templated: D = sum of all CRM weights
    expected = -(1.0 * w[0].sum().item() - 0.25 * w[1].sum().item()) / mass
    assert abs(expected) > 0.01 and update.trained_rows == 2 and update.loss == pytest.approx(expected, abs=1e-5)
    assert update.sums["crm_templated_tokens"] == 15
    assert update.sums["crm_out_of_band_tokens"] == sum(int((x == 0).sum()) for x in w)


@pytest.mark.parametrize("flag, value, message", [
    ("adv_norm", "z-score", "--adv_norm is one of"), ("loss_agg", "token-sum", "--loss_agg is one of"),
    ("backend", "sglang", "--backend is one of"), ("algo", "ppo", "--algo is one of"),
    ("crm_denominator", "some", "--crm_denominator is one of"), ("gepa_auto", "huge", "--gepa_auto is one of"),
    ("prompt_format", "chat", "--prompt_format is one of"), ("engine_dtype", "int8", "--engine_dtype is one of"),
    ("group_size", 0, "--group_size must be >= 1"), ("temperature", 0.0, "--temperature must be > 0"),
    ("top_p", 1.5, "--top_p must be <= 1"), ("adam_beta2", 1.0, "--adam_beta2 must be < 1"),
    ("dual_clip", 0.5, "--dual_clip is 0"), ("crm_low", 20.0, "--crm_low"), ("micro_batch_size", 0, ">= 1"),
    ("gepa_budget", 5, "--gepa_budget"), ("lr", -1e-6, "--lr must be >= 0"),
])
def test_every_enum_and_range_is_checked_before_any_model_loads(tmp_path, flag, value, message):
    cfg = Config(model=str(tmp_path / "no-such-model"), out_dir=str(tmp_path), **{flag: value})
    with pytest.raises(SystemExit, match=message):
        train.train(cfg)
    assert not os.listdir(tmp_path)  # nothing was loaded or written


def test_resume_reads_the_saved_settings_the_same_way_for_the_cli_and_train(tiny_model, tmp_path, monkeypatch):
    """Issue 20: one resume_point serves main() and train(cfg): the saved settings come back,
    the given ones win. train(cfg) used to ignore the saved config entirely."""
    train.train(tiny_config(tiny_model, tmp_path, max_steps=1, lr=3e-3), reward_fn=parity_reward)
    ckpt = str(tmp_path / "t" / "ckpt-000001")
    cfg, path, saved = train.resume_point(Config(resume=ckpt, max_steps=2))  # train(cfg): non-defaults given
    assert path == ckpt and saved["loop"]["step"] == 1
    assert (cfg.model, cfg.lr, cfg.max_steps, cfg.run_name, cfg.resume) == (tiny_model, 3e-3, 2, "t", ckpt)
    cli = config.parse_overrides(Config(), [f"--resume={ckpt}", "--lr=2e-5"])
    cfg, _, _ = train.resume_point(cli, given={"resume", "lr"})  # the CLI: a flag at its default value still wins
    assert (cfg.lr, cfg.max_steps, cfg.backend) == (2e-5, 1, "hf")
    seen = {}
    monkeypatch.setattr(train, "train", lambda cfg, given=None: seen.update(given=given) or {"step": 1})
    train.main([f"--resume={ckpt}", "--lr=2e-5"])
    assert seen["given"] == {"resume", "lr"}
    assert train.resume_point(Config()) == (Config(), None, None)


class SleepingEngine:
    """HF rollouts behind the sleep/push interface of VLLMRollout on CUDA, recording the calls."""

    def __init__(self, path, sleep_level):
        from rollout import HFRollout

        self.hf, self.sleep_level, self.calls = HFRollout(path), sleep_level, []

    def generate(self, prompts, **kw):
        self.calls.append("generate")
        return self.hf.generate(prompts, **kw)

    def sleep(self):
        self.calls.append("sleep")

    def push_weights(self, weights):
        self.calls.append("push")
        return self.hf.push_weights(weights)


@pytest.mark.parametrize("level", [1, 2])
def test_a_step_that_trains_nothing_pushes_only_after_a_level_two_sleep(tiny_model, tmp_path, level):
    """Level 1 keeps the engine's weights (offloaded), so a step with no trained row (every reward
    0, no KL) pushes nothing; level 2 discards them, so every step pushes the policy back."""
    engine = SleepingEngine(tiny_model, level)
    out = train.train(tiny_config(tiny_model, tmp_path, max_steps=2, save_every=0), engine=engine,
                      reward_fn=lambda text, problem: 0.0)
    assert out["step"] == 2 and all(m["trained_rows"] == 0 for m in read_metrics(tmp_path / "t"))
    step = ["generate", "sleep", "push"] if level == 2 else ["generate", "sleep"]
    assert engine.calls == step * 2


def test_autocast_caches_weight_casts_in_one_process_only(monkeypatch):
    """One process: the step's autocast region caches each weight's bf16 cast (cast once a step).
    Under FSDP the cache would keep every gathered layer's cast for the whole forward (7.3 GB a
    rank for 4B): train.autocast turns it off there."""
    cfg = Config()
    with train.autocast(cfg, torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled()
    monkeypatch.setattr(train.dist, "active", lambda: True)
    with train.autocast(cfg, torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()


class StaleEngine:
    """An HF engine on its own copy of the model whose pushes load nothing and report success: the
    silent failure the push checks exist for, which only the sampler mismatch can still see."""

    def __init__(self, path):
        from rollout import HFRollout

        self.hf = HFRollout(path)

    def generate(self, prompts, **kw):
        return self.hf.generate(prompts, **kw)

    def push_weights(self, weights):
        for _ in weights:  # consumed, as a real push would, and dropped
            pass
        return {"pushed": 0, "verified": 0}


def test_a_stale_engine_raises_the_sampler_alarm_and_a_fresh_one_does_not(tiny_model, tmp_path, capsys):
    from rollout import HFRollout

    runs = {}
    for name, engine in (("stale", StaleEngine(tiny_model)), ("fresh", HFRollout(tiny_model))):
        train.train(tiny_config(tiny_model, tmp_path / name, max_steps=4, lr=3e-2, save_every=0),
                    engine=engine, reward_fn=parity_reward)
        runs[name] = [m for m in read_metrics(tmp_path / name / "t") if "sampler_stale" in m]
    printed = capsys.readouterr().out
    trained = [m for m in runs["fresh"] if m["trained_rows"]]
    assert trained and all(m["sampler_stale"] == 0.0 and m["sampler_mismatch_mean"] < 1e-3 for m in trained)
    stale = [m for m in runs["stale"][1:] if m["trained_rows"]]  # step 1 samples the starting weights: not stale yet
    assert stale and all(m["sampler_stale"] == 1.0 for m in stale)
    assert printed.count("may not hold the pushed policy") == len(stale)
    untrained = [m for name in runs for m in runs[name] if not m["trained_rows"]]
    assert all(m["sampler_stale"] != m["sampler_stale"] for m in untrained)  # NaN where nothing was measured
