"""train.py under torchrun: 2 CPU processes (gloo, FSDP2, gradient checkpointing) train exactly what 1
process trains on the same global batch (uneven response lengths, DAPO refills, 2 mini-batches, KL,
templated P²O steps with CRM), hold identical P²O state, share GEPA's answering (the same archive as
one process), push full weights, and resume exactly at
world size 2; the same with LoRA adapters (merged pushes); and the real path with two vLLM engines."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(ROOT, "tests", "train_dist_child.py")
FINAL = "ckpt-000006"  # 12 problems, 4 prompts a step (plus DAPO refills), max_steps 6
# fp32 (no autocast) in both runs; they differ only in summation order (per-rank partial sums,
# padding widths, 2 vs 1 micro-batch splits). Measured after 6 AdamW steps (lr 1e-3, parameters
# moved by up to 1.2e-2): max |diff| 1.4e-7 on parameters, 2e-7 relative on losses and
# gradient norms; the tolerances leave a >10x margin.
PARAM_ATOL = 2e-6
METRIC_RTOL = 1e-5


def config(tiny_model, data, out_dir, **overrides):
    return {"model": tiny_model, "backend": "hf", "train_data": data["train"], "dev_data": data["dev"],
            "algo": "p2o", "prompts_per_step": 4, "group_size": 4, "max_tokens": 8, "temperature": 1.0,
            "micro_batch_size": 3, "mini_batches": 2, "kl_beta": 0.01, "dynamic_sampling": True, "lr": 1e-3,
            "warmup_steps": 1, "eval_every": 3, "eval_k": 2, "max_steps": 6, "save_every": 2, "keep_checkpoints": 0,
            "autocast_bf16": False, "seed": 3, "tau": 2, "gepa_min_hard": 1, "gepa_budget": 30, "gepa_parents": 3,
            "gepa_minibatch": 1, "out_dir": str(out_dir), "run_name": "run", **overrides}


def launch(tmp, name, cfg, world):
    """Run the child alone (world 1) or under torchrun; returns its output folder."""
    out = tmp / name
    out.mkdir()
    job = tmp / f"{name}.json"
    job.write_text(json.dumps({"config": cfg, "out": str(out)}))
    cmd = [sys.executable, CHILD, str(job)]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] + cmd[1:]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("train-dist")
    rows = [{"id": f"p{i}", "problem": f"Compute {i + 1} * {i + 4} - {i}.", "answer": str((i + 1) * (i + 4) - i),
             "source": "test"} for i in range(12)]
    data = {"train": tmp / "train.jsonl", "dev": tmp / "dev.jsonl"}
    data["train"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    data["dev"].write_text("".join(json.dumps({**r, "id": "d" + r["id"]}) + "\n" for r in rows[:4]))
    data = {k: str(v) for k, v in data.items()}
    one = launch(tmp, "one", config(tiny_model, data, tmp / "one"), 1)
    # the 2-process runs also recompute activations in backward (FSDP2 + gradient checkpointing;
    # measured: on 1 process it changes no bit of the result)
    two = launch(tmp, "two", config(tiny_model, data, tmp / "two", gradient_checkpointing=True), 2)
    resumed = launch(tmp, "resumed", config(tiny_model, data, tmp / "resumed", gradient_checkpointing=True,
                                            resume=str(two / "run" / "ckpt-000002")), 2)
    return {"one": one, "two": two, "resumed": resumed, "data": data, "tiny": tiny_model, "tmp": tmp}


def weights(out):
    return load_file(os.path.join(out, "run", FINAL, "model.safetensors"))


def ended(out, rank=0):
    return torch.load(os.path.join(out, f"rank-{rank}.pt"), weights_only=False)


def metrics(out):
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def without_times(state):
    return {**state, "gepa_history": [{k: v for k, v in h.items() if k != "seconds"} for h in state["gepa_history"]]}


def test_two_processes_train_what_one_trains(runs, tiny_model):
    one, two, init = weights(runs["one"]), weights(runs["two"]), load_file(os.path.join(tiny_model, "model.safetensors"))
    assert sorted(one) == sorted(two)
    assert max((one[k] - init[k]).abs().max().item() for k in one) > 1e-3  # it trained
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=PARAM_ATOL, rtol=0)


def test_the_run_covers_refills_templates_and_uneven_shares(runs):
    m = metrics(runs["two"])
    assert len(m) == 6
    assert sum(x["refills"] for x in m) > 0  # DAPO refilled
    assert any(x["templated_row_fraction"] > 0 and x["crm_mean_log_ratio"] != 0 for x in m)  # distilled, CRM
    tokens = [ended(runs["two"], rank)["local_tokens"] for rank in (0, 1)]  # response tokens trained per rank
    assert len(tokens[0]) == len(tokens[1]) == 6 and tokens[0] != tokens[1]
    assert [a + b for a, b in zip(*tokens)] == ended(runs["one"])["local_tokens"]


def test_logged_step_metrics_agree(runs):
    for a, b in zip(metrics(runs["one"]), metrics(runs["two"]), strict=True):
        for key, value in a.items():
            if key.startswith(("time_", "gen_tokens", "peak_rss")) or isinstance(value, (list, str)):
                continue
            if isinstance(value, float) and value != value:  # nan: no templated (or plain) group
                assert b[key] != b[key]
            else:
                assert b[key] == pytest.approx(value, rel=METRIC_RTOL, abs=1e-9), (a["step"], key)
        assert a["prompt_ids"] == b["prompt_ids"]


def test_p2o_state_is_identical_on_both_ranks_and_equals_one_process(runs):
    rank0, rank1, alone = ended(runs["two"], 0), ended(runs["two"], 1), ended(runs["one"])
    assert rank0["state"] == rank1["state"]
    assert without_times(rank0["state"]) == without_times(alone["state"])
    assert sum(h["ran"] for h in rank0["state"]["gepa_history"]) >= 2  # GEPA rounds were broadcast


def test_gepa_rounds_are_answered_by_every_rank_and_search_as_one_process(runs):
    """Rank 0 searches; each answer call is shared over both engines (items[rank::2]); the
    archive of every round equals the one-process round's."""
    names = sorted(n for n in os.listdir(os.path.join(runs["one"], "run")) if n.startswith("gepa-epoch-"))
    assert len(names) >= 2
    for name in names:
        one, two = (json.load(open(os.path.join(runs[k], "run", name))) for k in ("one", "two"))
        assert two == one and len(one["log"]) > 0 and one["metric_calls"] > 0
    alone = ended(runs["one"])["gepa_calls"]
    shares = [ended(runs["two"], rank)["gepa_calls"] for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == len(alone) > 2  # every rank takes part in every call
    for call, first, second in zip(alone, *shares):
        assert abs(len(first) - len(second)) <= 1 and len(first) + len(second) == len(call)
        assert first == call[0::2] and second == call[1::2]
    assert sum(len(c) for c in alone) == sum(json.load(open(os.path.join(runs["one"], "run", n)))["metric_calls"]
                                             for n in names)


def test_every_rank_pushes_the_full_weights(runs):
    final = weights(runs["two"])
    for rank in (0, 1):
        out = ended(runs["two"], rank)
        assert out["pushes"] == 6
        for k, v in final.items():
            assert torch.equal(out["pushed"][k], v)


def test_resume_at_world_size_two_is_exact(runs):
    assert ended(runs["resumed"])["state"]["step"] == 6
    a, b = weights(runs["resumed"]), weights(runs["two"])
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert without_times(ended(runs["resumed"])["state"]) == without_times(ended(runs["two"])["state"])


def test_checkpoint_is_a_plain_hf_folder(runs):
    from transformers import AutoModelForCausalLM

    folder = os.path.join(runs["two"], "run", FINAL)
    assert json.load(open(os.path.join(folder, "config.json")))["architectures"] == ["LlamaForCausalLM"]
    assert sorted(n for n in os.listdir(folder) if n.startswith("rank-")) == ["rank-0.pt", "rank-1.pt"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for k, v in weights(runs["two"]).items():
        assert torch.equal(model.state_dict()[k], v)


def test_resuming_at_another_world_size_is_a_clear_error(runs, capsys):
    cfg = train.Config(**config(runs["tiny"], runs["data"], runs["tmp"] / "wrong",
                                resume=os.path.join(runs["two"], "run", "ckpt-000002")))
    with pytest.raises(SystemExit, match="written by 2 processes"):
        train.train(cfg, engine=object())


def test_reward_shaping_under_torchrun_gives_every_rank_the_same_bonuses_as_one_process(runs):
    """GRPO + CLIPO + the agreement bonus: the hidden states are forwarded in shares and gathered,
    so both ranks hold the same features, draw the same positives and step the same head: their
    bonuses and heads are identical, and equal one process's up to summation order."""
    tmp, data, tiny = runs["tmp"], runs["data"], runs["tiny"]
    shaped = dict(algo="grpo", clipo_weight=0.2, clipo_dim=8, agreement_bonus=0.3, agreement_ngram=1, max_steps=4,
                  eval_every=0, save_every=0, dynamic_sampling=False)
    one = launch(tmp, "shaped-one", config(tiny, data, tmp / "shaped-one", **shaped), 1)
    two = launch(tmp, "shaped-two", config(tiny, data, tmp / "shaped-two", gradient_checkpointing=True, **shaped), 2)
    rank0, rank1, alone = ended(two, 0), ended(two, 1), ended(one)
    assert rank0["bonuses"] == rank1["bonuses"]
    assert all(torch.equal(rank0["shapers"][0]["head"][k], rank1["shapers"][0]["head"][k]) for k in rank0["shapers"][0]["head"])
    shaped_groups = [b for step in alone["bonuses"] for b in step if b is not None]
    assert shaped_groups and any(any(x != 0 for x in b) for b in shaped_groups)
    for a, b in zip(alone["bonuses"], rank0["bonuses"], strict=True):
        for x, y in zip(a, b, strict=True):
            assert (x is None) == (y is None) and (x is None or x == pytest.approx(y, abs=1e-5))
    for a, b in zip(metrics(one), metrics(two), strict=True):
        assert b.get("shaping_bonus_mean") == pytest.approx(a.get("shaping_bonus_mean"), abs=1e-5)


@pytest.fixture(scope="module")
def lora_runs(runs):
    """The same P²O run (KL to adapters off included) with LoRA adapters: alone, under torchrun,
    and resumed at world size 2; plus one in bf16 autocast (a bf16 base beside fp32 adapters in FSDP2's groups)."""
    tmp, data, tiny = runs["tmp"], runs["data"], runs["tiny"]
    lora = dict(lora_rank=4, lora_alpha=8)
    one = launch(tmp, "lora-one", config(tiny, data, tmp / "lora-one", **lora), 1)
    two = launch(tmp, "lora-two", config(tiny, data, tmp / "lora-two", gradient_checkpointing=True, **lora), 2)
    resumed = launch(tmp, "lora-resumed", config(tiny, data, tmp / "lora-resumed", gradient_checkpointing=True,
                                                 resume=str(two / "run" / "ckpt-000002"), **lora), 2)
    bf16 = launch(tmp, "lora-bf16", config(tiny, data, tmp / "lora-bf16", autocast_bf16=True, max_steps=2, **lora), 2)
    return {"one": one, "two": two, "resumed": resumed, "bf16": bf16}


def adapters(out, name=FINAL):
    return load_file(os.path.join(out, "run", name, "adapter_model.safetensors"))


def test_lora_under_fsdp2_trains_what_one_process_trains_and_every_engine_gets_the_merged_weights(lora_runs, tiny_model):
    import lora

    one, two = adapters(lora_runs["one"]), adapters(lora_runs["two"])
    assert sorted(one) == sorted(two) and max(v.abs().max().item() for k, v in one.items() if "lora_B" in k) > 1e-3
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=PARAM_ATOL, rtol=0)
    base = load_file(os.path.join(tiny_model, "model.safetensors"))
    pushed = [ended(lora_runs["two"], rank)["pushed"] for rank in (0, 1)]
    assert pushed[0].keys() == pushed[1].keys() and all(torch.equal(pushed[0][k], pushed[1][k]) for k in pushed[0])
    alone = ended(lora_runs["one"])["pushed"]
    for k, v in pushed[0].items():  # W + (alpha/r) B A of the final adapters, the base untouched
        if k.endswith("proj.weight"):
            prefix = "base_model.model." + k[:-len(".weight")]
            want = base[k] + 2.0 * two[f"{prefix}.lora_B.weight"] @ two[f"{prefix}.lora_A.weight"]
            torch.testing.assert_close(v, want, atol=1e-6, rtol=0)
        else:
            assert torch.equal(v, base[k]), k
        torch.testing.assert_close(v, alone[k], atol=PARAM_ATOL, rtol=0)
    assert not any(lora.is_adapter(k) or ".base_layer" in k for k in pushed[0])
    assert without_times(ended(lora_runs["two"])["state"]) == without_times(ended(lora_runs["one"])["state"])


def test_lora_resume_at_world_size_two_is_exact_and_bf16_bases_shard(lora_runs):
    a, b = adapters(lora_runs["resumed"]), adapters(lora_runs["two"])
    assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    assert without_times(ended(lora_runs["resumed"])["state"]) == without_times(ended(lora_runs["two"])["state"])
    pushed = ended(lora_runs["bf16"])["pushed"]  # the scripted engine takes what comes: merged fp32, the rest bf16
    assert pushed["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    assert pushed["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16
    assert ended(lora_runs["bf16"])["state"]["step"] == 2


@pytest.mark.parametrize("lora_flags", [[], ["--lora_rank=8"]], ids=["full", "lora"])
def test_train_py_under_torchrun_with_vllm_engines(tmp_path, model_path, lora_flags):
    """The real path: `torchrun --nproc_per_node=2 train.py` on the default model, each rank with
    its own in-process vLLM engine (external_launcher), one step (DAPO refills until some group
    varies, so the step trains), weights pushed (verified) into both engines, a sharded dev evaluation, the checkpoint written by rank 0, a clean exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           "--max_steps=1", "--prompts_per_step=4", "--group_size=4", "--max_tokens=96", "--eval_every=0",
           "--dynamic_sampling=True",
           "--eval_k=0", "--save_every=0", "--dev_data=" + str(write_dev(tmp_path)), f"--out_dir={tmp_path}",
           "--run_name=v", "--lr=1e-4", *lora_flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = tmp_path / "v"
    (m,) = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert m["step"] == 1 and m["trained_rows"] > 0 and m["sampler_stale"] == 0.0  # the engines sampled the policy
    assert [json.loads(line)["step"] for line in open(run / "dev.jsonl")] == [0, 1]
    assert "2 processes" in proc.stdout and "dev greedy accuracy" in proc.stdout
    if lora_flags:  # adapters pushed as vLLM's LoRA, verified in both engines; the checkpoint holds the adapters
        assert "LoRA: rank 8" in proc.stdout
        trained = load_file(str(run / "ckpt-000001" / "adapter_model.safetensors"))
        assert max(v.abs().max().item() for k, v in trained.items() if "lora_B" in k) > 0
        return
    trained = load_file(str(run / "ckpt-000001" / "model.safetensors"))
    start = load_file(os.path.join(model_path, "model.safetensors"))
    assert max((trained[k] - start[k]).abs().max().item() for k in trained) > 0


def write_dev(folder):
    """The first 6 built-in dev problems as a file: a short sharded evaluation."""
    from data import load_jsonl

    path = folder / "dev6.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer, "source": p.source}) + "\n"
                            for p in load_jsonl("builtin-dev")[0][:6]))
    return path
