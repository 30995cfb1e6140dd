"""Start-up: the command line reads as argparse does, and every bad setting, path, model or
data file is one line, before any model loads, leaving no run folder behind."""

import os
import subprocess
import sys

import pytest

import train
from config import parse_overrides
from train import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_key_value_pairs_bare_flags_and_the_names_given():
    given = set()
    cfg = parse_overrides(Config(), ["--lr", "-1e-6", "--dynamic_sampling", "--group_size", "12",
                                     "--crm=false", "--verbose", "--seed=3"], given)
    assert (cfg.lr, cfg.dynamic_sampling, cfg.group_size, cfg.crm, cfg.verbose, cfg.seed) == (-1e-6, True, 12, False,
                                                                                             True, 3)
    assert given == {"lr", "dynamic_sampling", "group_size", "crm", "verbose", "seed"}
    assert parse_overrides(Config(), ["--crm", "0"]).crm is False  # a bool takes a following true/false/1/0
    with pytest.raises(SystemExit, match="--group_size needs a value"):
        parse_overrides(Config(), ["--group_size"])
    with pytest.raises(SystemExit, match="--crm expects a bool, got 'maybe'"):
        parse_overrides(Config(), ["--crm", "maybe"])
    with pytest.raises(SystemExit, match="arguments look like"):
        parse_overrides(Config(), ["group_size=4"])


@pytest.mark.parametrize("flag, nearest", [("group_sise", "--group_size"), ("learning_rate", None),
                                           ("kl_bta", "--kl_beta"), ("wandb", "--wandb_project")])
def test_a_misspelt_setting_names_the_nearest(flag, nearest):
    with pytest.raises(SystemExit) as e:
        parse_overrides(Config(), [f"--{flag}=1"])
    message = str(e.value)
    assert message.startswith(f"unknown setting --{flag}")
    assert (f"did you mean {nearest}" in message) if nearest else ("did you mean" not in message)


def fails(argv, out_dir, match):
    """train.main(argv) stops with a one-line SystemExit matching `match`, and leaves out_dir empty."""
    with pytest.raises(SystemExit) as e:
        train.main([*argv, f"--out_dir={out_dir}"])
    message = str(e.value)
    assert "\n" not in message, message
    assert match in message, message
    assert not os.path.exists(out_dir) or os.listdir(out_dir) == [], os.listdir(out_dir)


def test_bad_starts_stop_before_anything_loads(tmp_path, monkeypatch):
    out = str(tmp_path / "runs")
    monkeypatch.setattr(train, "start_run", lambda *a, **k: pytest.fail("start_run reached"))
    fails(["--prompts_per_step=0"], out, "--prompts_per_step must be >= 1, got 0")
    fails(["--epochs=-1"], out, "--epochs must be >= 1, got -1")
    fails(["--model=./no/such/folder"], out, "--model=./no/such/folder: no such folder")
    fails([f"--model={tmp_path}"], out, "not a model folder (no config.json)")
    fails(["--train_data=no/such.jsonl"], out, "--train_data: no/such.jsonl: no such data file")
    fails(["--dev_data=nope"], out, "--dev_data: ")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "problem": "1+1?", "answer": 2}\n')
    fails([f"--train_data={bad}"], out, f"{bad}:1: field 'answer' must be a string, got int; convert the file "
                                        "with data/prep.py")
    fails(["--reflector=./no/reflector"], out, "--reflector=./no/reflector: no such folder")
    fails(["--resume=auto", "--run_name=typo"], out, "--resume=auto: no run folder")


def test_an_unreachable_or_unknown_hub_model_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    out = str(tmp_path / "runs")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)  # nothing cached

    def offline(self, repo_id, **kw):
        raise ConnectionError("Name or service not known")
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", offline)
    fails(["--model=Qwen/Qwen3-0.6B"], out, "the hub cannot be reached (ConnectionError: Name or service not known)")

    def missing(self, repo_id, **kw):
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its __init__ wants an HTTP response
        Exception.__init__(error, "404 Client Error")
        raise error
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", missing)
    fails(["--model=Qwen/Qwen3-0.6B-typo"], out, "no such model on the hub")


def test_the_command_line_prints_one_line_and_no_traceback(tmp_path):
    out = tmp_path / "runs"
    for argv, expected in ((["--group_sise=4"], "unknown setting --group_sise; did you mean --group_size?"),
                           (["--train_data=missing.jsonl"], "--train_data: missing.jsonl: no such data file")):
        proc = subprocess.run([sys.executable, "train.py", *argv, f"--out_dir={out}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 1
        assert proc.stderr.strip() == expected and proc.stdout == ""
        assert not out.exists()
