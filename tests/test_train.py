"""End-to-end GRPO on a tiny randomly initialised Llama (HF rollout backend, scripted reward),
config parsing, exact resume, and the NaN guard."""

import json
import os

import pytest
import torch

import train
from train import Config, PromptStream, parse_overrides


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, model_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model_path)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = str(tmp_path_factory.mktemp("tiny"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def parity_reward(text, problem):
    """Scripted reward for a random model: mixed within groups, so advantages are non-zero."""
    return float(len(text) % 2 == 0)


def tiny_config(tiny_model, tmp_path, **over):
    cfg = Config(model=tiny_model, backend="hf", prompts_per_step=3, group_size=4, max_tokens=6,
                 temperature=1.0, micro_batch_size=5, lr=1e-3, warmup_steps=1, dev_data="",
                 eval_every=0, save_every=2, max_steps=2, out_dir=str(tmp_path), run_name="t",
                 autocast_bf16=False, seed=3)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


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
    first = s.take(5)
    assert sorted(first) == items and s.epoch_of(s.consumed) == 1
    second = s.take(5)
    assert sorted(second) == items and first != second  # a new order each epoch
    resumed = PromptStream(items, seed=1, consumed=3)
    assert resumed.take(4) == first[3:] + second[:2]


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
    assert open(os.path.join(str(tmp_path), "t", "latest")).read().strip() == "ckpt-000002"
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
    assert state["skipped_steps"] == 2


def test_corrupt_checkpoint_is_reported(tmp_path):
    bad = tmp_path / "ckpt-000001"
    bad.mkdir()
    (bad / "trainer.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="corrupt checkpoint"):
        train.load_trainer_state(str(bad))


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
