"""Bad input and faults, second pass (issue 52): each case a careful user met, driven end to end
where it is cheap. Non-finite settings are one line before anything loads; no checkpoint, export
or push holds a NaN or inf (checked where they are written); an interrupted run does not exit 0."""

import math
import os
import signal

import pytest
import torch

import config
import rollout
import runs
import train
from conftest import load_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- non-finite settings


@pytest.mark.parametrize("flag", ["--lr=inf", "--lr=1e400", "--lr=nan", "--temperature=nan", "--grad_clip=nan",
                                  "--kl_beta=-inf", "--crm_high=inf", "--clipo_tau=nan"])
def test_a_non_finite_setting_is_one_line_before_anything_loads(flag, capsys):
    name = flag[2:].split("=")[0]
    with pytest.raises(SystemExit, match=f"--{name} must be a finite number, got "):
        train.main([flag, "--dry_run"])
    assert capsys.readouterr().out == ""  # nothing printed as if the settings were good


def test_a_yaml_nan_is_refused_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: .nan\n")
    cfg, _, _ = config.resolve_settings(train.Config(), [f"--config={path}"])
    assert math.isnan(cfg.lr)
    with pytest.raises(SystemExit, match="--lr must be a finite number, got nan"):
        config.check_config(cfg)


# ----------------------------------------------------------------------------- nothing non-finite is written


def poisoned(tiny_model):
    model = load_tiny(tiny_model)
    with torch.no_grad():
        model.model.norm.weight[3] = float("nan")
    return model


def test_a_checkpoint_of_non_finite_weights_is_refused_and_the_earlier_one_stands(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    good = load_tiny(tiny_model)
    runs.save_checkpoint(str(tmp_path), 1, good, tok, {"loop": {}, "config": {}})
    with pytest.raises(runs.NonFiniteError, match=r"ckpt-000002: 1 tensors hold NaN or inf \(model.norm.weight\)"):
        runs.save_checkpoint(str(tmp_path), 2, poisoned(tiny_model), tok, {"loop": {}, "config": {}})
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001", "latest"]
    assert os.readlink(tmp_path / "latest") == "ckpt-000001"
    state = {"loop": {}, "config": {}, "optimizer": {"state": {0: {"exp_avg": torch.tensor([1.0, math.inf])}}}}
    with pytest.raises(runs.NonFiniteError, match=r"optimizer.state.0.exp_avg"):  # the optimizer's state too
        runs.save_checkpoint(str(tmp_path), 3, good, tok, state)
    with pytest.raises(runs.NonFiniteError, match="export-000004"):
        runs.save_export(str(tmp_path), 4, poisoned(tiny_model), tok, {})
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001", "latest"]


def test_a_push_of_non_finite_weights_is_refused_before_it_reaches_the_engine(tiny_model, vllm_engine, hf_model):
    hf = rollout.HFRollout(tiny_model)
    before = {k: v.clone() for k, v in hf.model.state_dict().items()}
    with pytest.raises(rollout.WeightPushError, match="model.norm.weight holds NaN or inf"):
        hf.push_weights(poisoned(tiny_model).state_dict())
    assert all(torch.isfinite(v).all() for v in hf.model.state_dict().values())
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    bad = dict(original)
    bad["model.norm.weight"] = bad.pop("model.norm.weight") * float("inf")  # last: the rest goes in unchanged
    try:
        with pytest.raises(rollout.WeightPushError, match="model.norm.weight holds NaN or inf"):
            vllm_engine.push_weights(bad)
        (got, _), = vllm_engine.llm.collective_rpc(rollout._engine_checksums)
        assert all(math.isfinite(squares) for _, _, squares in got.values())
    finally:
        vllm_engine.push_weights(original)
    assert before.keys() == hf.model.state_dict().keys()


# ----------------------------------------------------------------------------- exit status


def test_an_interrupted_run_exits_with_the_signals_status(monkeypatch):
    """SIGTERM (a preempted job) or SIGINT: the step in flight is finished and saved, then the
    process exits 128 + the signal, as a shell reports a signal's end; a completed run exits 0."""
    monkeypatch.setattr(train, "train", lambda cfg, given: {"interrupted": True, "signal": signal.SIGTERM})
    with pytest.raises(SystemExit) as stopped:
        train.main(["--max_steps=1"])
    assert stopped.value.code == 128 + signal.SIGTERM == 143
    monkeypatch.setattr(train, "train", lambda cfg, given: {"step": 1})
    assert train.main(["--max_steps=1"]) is None  # exit status 0
