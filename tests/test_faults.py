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

    with pytest.raises(rollout.WeightPushError, match="model.norm.weight holds NaN or inf"):
        hf.push_weights(poisoned(tiny_model).state_dict())
    assert all(torch.isfinite(v).all() for v in hf.model.state_dict().values())
    # vLLM: the push stops at the bad tensor, which never goes in; the run then ends (WeightPushError),
    # and a later full push (a resumed run's first) serves the model again exactly
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    bad = dict(original)
    bad["model.norm.weight"] = bad.pop("model.norm.weight") * float("inf")  # last: the rest goes in unchanged
    prompts = ["What is 2 + 3?", "Name a colour."]
    greedy = vllm_engine.generate(prompts, temperature=0, max_tokens=12, logprobs=True)
    try:
        with pytest.raises(rollout.WeightPushError, match="model.norm.weight holds NaN or inf"):
            vllm_engine.push_weights(bad)
    finally:
        vllm_engine.push_weights(original)
    again = vllm_engine.generate(prompts, temperature=0, max_tokens=12, logprobs=True)
    assert [g[0].response_ids for g in again] == [g[0].response_ids for g in greedy]
    assert [g[0].logprobs for g in again] == [g[0].logprobs for g in greedy]


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


# ----------------------------------------------------------------------------- config files and custom rewards


@pytest.mark.parametrize("name, text", [("run.yaml", "lr: 1e-6\ngroup_size: 4\nlr: 2e-6\n"),
                                        ("run.json", '{"lr": 1e-6, "group_size": 4, "lr": 2e-6}'),
                                        ("nested.yaml", "chat_template_kwargs:\n  a: 1\n  a: 2\n")])
def test_a_setting_given_twice_in_a_config_file_is_an_error_not_the_last_one(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    key = "a" if name == "nested.yaml" else "lr"
    with pytest.raises(SystemExit, match=f"--config: .*{name}.*: {key} given more than once"):
        config.read_config_file(str(path))


def test_a_yaml_merge_key_still_reads_and_the_mappings_own_key_overrides_it(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b\n  x: 1\nrest:\n  <<: *b\n  y: 2\nover:\n  <<: *b\n  x: 3\n")
    read = config.read_config_file(str(path))
    assert read["rest"] == {"x": 1, "y": 2} and read["over"] == {"x": 3}  # YAML's rule: the explicit key wins


def test_the_duplicate_is_named_on_its_own_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-6\ngroup_size: 4\nlr: 2e-6\n")
    with pytest.raises(SystemExit, match="line 3: lr given more than once \\(first on line 1\\)"):
        config.read_config_file(str(path))


def test_a_fixed_template_file_not_in_utf8_names_its_line(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"Multiply first.\nthen \xff add\n")
    with pytest.raises(SystemExit, match=f"--fixed_template: {path}:2: not UTF-8 text"):
        config.check_config(train.Config(algo="grpo", fixed_template=str(path)))


def test_a_reward_may_return_numpys_bool_and_print_at_import(tmp_path, capsys):
    import verify
    from data import Problem

    module = tmp_path / "loud_rewards.py"
    module.write_text("import numpy\nprint('loading my judge')\n\n"
                      "def flag(response, problem):\n    return numpy.bool_('yes' in response)\n")
    check_fn = verify.load_reward(f"{module}:flag")
    assert check_fn("yes", Problem("q", "?", "1")).reward == 1.0 and check_fn("no", Problem("q", "?", "1")).reward == 0.0
    out = capsys.readouterr()
    assert out.out == "" and "loading my judge" in out.err  # stdout stays --dry_run's JSON alone


def test_dry_run_json_survives_a_reward_that_prints_at_import(tmp_path):
    import json
    import subprocess
    import sys

    module = tmp_path / "chatty.py"
    module.write_text("print('hello from the reward module')\n\ndef score(response, problem):\n    return 1.0\n")
    out = subprocess.run([sys.executable, "train.py", f"--reward={module}:score", "--dry_run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["reward"] == f"{module}:score"


# ----------------------------------------------------------------------------- a user's reward is untrusted code

SLOW_AND_BROKEN = '''import math
import time


def sleepy(response, problem):
    if "boxed" in response:
        return 1.0
    time.sleep(30)


def nan_when_wrong(response, problem):
    return 1.0 if "boxed" in response else math.nan


def raises_later(response, problem):
    if "boxed" not in response:
        raise KeyError("judge")
    return 1.0


CALLS = []


def judge_goes_down(response, problem):  # 1 start-up call + 12 a step: the 21st call is in step 2
    CALLS.append(problem.id)
    if len(CALLS) > 20:
        raise ConnectionError("judge down")
    return 1.0 if "boxed" in response else 0.0


def raises_on_p1(response, problem):
    if problem.id == "p1":
        raise KeyError("judge")
    return 1.0 if "boxed" in response else 0.0
'''


@pytest.fixture()
def rewards_module(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(SLOW_AND_BROKEN)
    yield str(path)
    import verify

    verify.set_policy(60.0, "stop")  # the process-wide default again


def test_a_reward_that_sleeps_is_bounded_and_the_policy_decides(rewards_module):
    import time

    import verify
    from data import Problem

    check_fn = verify.load_reward(f"{rewards_module}:sleepy")
    verify.set_policy(0.3, "stop")
    start = time.perf_counter()
    with pytest.raises(verify.RewardError, match=r"sleepy took more than 0.3 s on problem q1 \(--reward_timeout\)"):
        check_fn("no box", Problem("q1", "?", "1"))
    assert time.perf_counter() - start < 5
    verify.set_policy(0.3, "zero")
    verdicts = [check_fn(text, Problem("q2", "?", "1")) for text in ("no box", "\\boxed{1}", "still none")]
    assert [(v.reward, v.reason) for v in verdicts] == [(0.0, "failed"), (1.0, "custom"), (0.0, "failed")]
    assert verify.take_failures() == 2 and verify.take_failures() == 0
    time.sleep(0.5)  # a deadline signal that might arrive late is ignored, never fatal


@pytest.mark.parametrize("fn", ["nan_when_wrong", "raises_later"])
def test_a_reward_failing_mid_run_stops_in_one_line_or_scores_zero_and_is_counted(fn, rewards_module, tiny_model,
                                                                                 tmp_path, capsys):
    """The gold answer scores, so the start-up check passes; the policy's wrong answers fail later."""
    from conftest import read_metrics, tiny_config

    flags = [f"--model={tiny_model}", "--backend=hf", "--algo=grpo", "--dev_data=", "--max_steps=2", "--save_every=1",
             f"--out_dir={tmp_path}", "--run_name=r", "--max_tokens=6", "--group_size=4", "--prompts_per_step=3",
             f"--reward={rewards_module}:{fn}", "--autocast_bf16=False"]
    with pytest.raises(SystemExit) as stopped:
        train.main(flags)
    assert isinstance(stopped.value.code, str) and f"{fn} " in stopped.value.code and " problem " in stopped.value.code
    assert "\n" not in stopped.value.code and "no checkpoint yet" in stopped.value.code  # it failed in step 1
    out = train.train(tiny_config(tiny_model, tmp_path, algo="grpo", reward=f"{rewards_module}:{fn}",
                                  reward_errors="zero", run_name="z"))
    metrics = read_metrics(tmp_path / "z")
    assert len(metrics) == 2 and metrics[-1]["reward_failures"] == out["counts"]["reward_failures"] > 0
    assert metrics[0]["reward_failures"] <= metrics[1]["reward_failures"]  # cumulative, every step
    assert "calls of the custom --reward failed" in capsys.readouterr().out  # and in the closing summary


def test_a_reward_stopping_the_run_saves_the_last_completed_step_and_resume_goes_on(rewards_module, tiny_model,
                                                                                     tmp_path):
    """No periodic checkpoint: the judge fails in step 2, so step 1 is saved (not the step in flight, whose
    rollouts were never all scored) and the error says where; --resume=auto continues from step 2."""
    from conftest import read_metrics

    flags = [f"--model={tiny_model}", "--backend=hf", "--algo=grpo", "--dev_data=", "--max_steps=3", "--save_every=0",
             f"--out_dir={tmp_path}", "--run_name=r", "--max_tokens=6", "--group_size=4", "--prompts_per_step=3",
             "--autocast_bf16=False"]
    with pytest.raises(SystemExit) as stopped:
        train.main([*flags, f"--reward={rewards_module}:judge_goes_down"])
    run = tmp_path / "r"
    assert "judge_goes_down" in stopped.value.code and "judge down" in stopped.value.code
    assert f"the last completed step saved in {run / 'ckpt-000001'}" in stopped.value.code
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000001"]
    assert torch.load(run / "ckpt-000001" / "trainer.pt", weights_only=False)["loop"]["step"] == 1
    assert [m["step"] for m in read_metrics(run)] == [1]
    cfg = config.resolve_settings(train.Config(), [*flags, "--resume=auto", "--reward=ours"])[0]  # the judge is back
    out = train.train(cfg, given={"resume", "reward"})
    assert out["step"] == 3 and [m["step"] for m in read_metrics(run)] == [1, 2, 3]


def test_eval_keeps_what_it_generated_when_the_reward_fails(rewards_module, tmp_path):
    import json

    import eval as evaluation

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(3)))
    out = tmp_path / "e.json"
    code = evaluation.main([f"--data={data}", "--backend=hf", "--k=0", "--max_tokens=4", f"--out={out}",
                            f"--reward={rewards_module}:raises_later"])
    assert code == 1 and not out.exists()
    kept = [json.loads(line) for line in (tmp_path / "e.unscored.jsonl").read_text().splitlines()]
    assert [len(r["responses"]) for r in kept] == [1, 1, 1] and all(r["benchmark"] == str(data) for r in kept)
    assert [(r["id"], r["answer"], r["greedy"]) for r in kept] == [("p0", "1", True), ("p1", "2", True), ("p2", "3", True)]
    assert evaluation.main([f"--data={data}", f"--out={tmp_path}"]) == 2  # a folder: said before anything loads


def test_eval_stops_every_rank_when_one_ranks_reward_fails_and_keeps_what_each_generated(rewards_module, tiny_model,
                                                                                        tmp_path):
    """torchrun, 2 ranks: p1 is rank 1's and its reward raises. No rank waits in the gather: both exit, rank 1's
    answers kept unscored, rank 0's scored; the benchmark finished before it is written with its stopping point."""
    import json
    import subprocess
    import sys

    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text(json.dumps({"id": "p9", "problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    second.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                              for i in range(3)))
    out = tmp_path / "e.json"
    args = [f"--model={tiny_model}", "--backend=hf", "--dtype=float32", f"--data={first},{second}", "--k=0",
            "--max_tokens=4", f"--out={out}", f"--reward={rewards_module}:raises_on_p1"]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
                          "eval.py", *args], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert two.returncode != 0 and "raises_on_p1" in two.stderr and "KeyError" in two.stderr
    kept = {r: [json.loads(x) for x in (tmp_path / f"e.unscored.rank-{r}.jsonl").read_text().splitlines()]
            for r in (0, 1)}
    assert [x["id"] for x in kept[0]] == ["p0", "p2"] and all("rewards" in x for x in kept[0])  # scored
    assert len(kept[1]) == 1 and "rewards" not in kept[1][0] and kept[1][0]["benchmark"] == str(second)
    written = json.loads(out.read_text())
    assert written["stopped_at"] == str(second) and list(written["results"]) == [str(first)]


def test_eval_refuses_a_bad_out_or_a_non_finite_flag_before_anything_loads(tmp_path, capsys):
    import eval as evaluation

    (tmp_path / "afile").write_text("")
    for flags, says in ((["--out=" + str(tmp_path / "new") + "/"], "is a folder"),
                        (["--out=" + str(tmp_path / "afile" / "x.json")], "cannot make its folder"),
                        ([f"--out={tmp_path / 'e.json'}", "--temperature=nan"], "--temperature must be a finite number"),
                        ([f"--out={tmp_path / 'e.json'}", "--reward_timeout=inf"], "--reward_timeout must be a finite")):
        assert evaluation.main(["--data=nowhere.jsonl", *flags]) == 2  # the data file is not even read
        assert says in capsys.readouterr().err


def test_eval_names_a_problem_too_long_for_the_model_before_any_engine(tmp_path, capsys):
    import json

    import eval as evaluation

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "ok", "problem": "What is 1 + 1?", "answer": "2"}) + "\n" +
                    json.dumps({"id": "huge", "problem": "1 + " * 20_000 + "1", "answer": "20001"}) + "\n")
    for backend in ("vllm", "hf"):
        code = evaluation.main([f"--data={data}", f"--backend={backend}", "--k=0", f"--out={tmp_path / 'e.json'}"])
        err = capsys.readouterr().err
        assert code == 2 and "problem huge" in err and "over the model's 8,192" in err, err


def test_eval_counts_the_reward_calls_the_zero_policy_scored(rewards_module, tmp_path, capsys):
    import json

    import eval as evaluation

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(3)))
    out = tmp_path / "e.json"
    assert evaluation.main([f"--data={data}", "--backend=hf", "--k=2", "--max_tokens=4", f"--out={out}",
                            f"--reward={rewards_module}:raises_later", "--reward_errors=zero"]) == 0
    failed = json.loads(out.read_text())["results"][str(data)]["reward_failures"]
    assert failed == 9  # 3 problems x (2 samples + greedy), none boxed in 4 tokens
    assert f"{failed} calls of the custom --reward failed" in capsys.readouterr().out


def test_a_training_dev_set_scored_outside_0_1_is_called_a_mean_reward(tiny_model, tmp_path, capsys):
    import json

    from conftest import tiny_config

    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"id": f"d{i}", "problem": f"What is {i} + 2?", "answer": str(i + 2)}) + "\n"
                           for i in range(2)))
    path = tmp_path / "two.py"
    path.write_text("def two(response, problem):\n    return 2.0\n")
    train.train(tiny_config(tiny_model, tmp_path, dev_data=str(dev), eval_every=1, eval_k=0, reward=f"{path}:two"))
    out = capsys.readouterr().out
    assert "dev greedy mean reward (rewards outside [0, 1]): 2.000 before" in out and "accuracy: 2.000" not in out
    assert "(mean rewards: the reward ranges over [2, 2])" in out


def test_rewards_outside_0_1_are_not_reported_as_accuracies():
    import scoring

    greedy = [{"rewards": [2.0], "extracted": ["2"], "truncated": [False]}, {"rewards": [0.0], "extracted": [None],
                                                                             "truncated": [False]}]
    sampled = [{"rewards": [2.0, 0.5], "extracted": ["2", "3"], "lengths": [1, 1]},
               {"rewards": [0.0, 0.0], "extracted": [None, None], "lengths": [1, 1]}]
    row = scoring.summarize(greedy, sampled, 2)
    assert row["greedy"] == 1.0 and (row["reward_min"], row["reward_max"]) == (0.0, 2.0)  # a mean reward, flagged
    assert row["pass@1"] == 0.5 and row["pass@2"] == 0.5  # solved = reward > 0: problem 1 always, problem 2 never
    binary = scoring.summarize(greedy[:1] and [{**greedy[0], "rewards": [1.0]}], [{**sampled[0], "rewards": [1.0, 0.0]}], 2)
    assert "reward_max" not in binary and binary["pass@1"] == 0.5


# ----------------------------------------------------------------------------- files: encodings, folders, names


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path):
    from data import DataError, load_jsonl

    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"id": "a", "problem": "What is 1 + 1?", "answer": "2"}\n'
                     b'{"id": "b", "problem": "caf\xe9?", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not UTF-8 text \(byte 28 of the line: b'\\xe9'\)"):
        load_jsonl(str(data))
    assert load_jsonl(str(data), skip_bad=True)[1] == 1  # --skip_bad skips it like any bad row
    settings = tmp_path / "run.yaml"
    settings.write_bytes(b"lr: 1e-6\n# caf\xe9\n")
    with pytest.raises(SystemExit, match=r"--config: .*run.yaml line 2: not UTF-8 text"):
        config.read_config_file(str(settings))


def test_an_out_dir_that_cannot_be_written_is_one_line_before_anything_loads(tmp_path, tiny_model):
    from conftest import tiny_config

    afile = tmp_path / "a_file"
    afile.write_text("x")
    for out_dir in (str(afile), str(afile / "runs"), "/proc/p2o-runs"):  # a file, under a file, read-only
        with pytest.raises(SystemExit, match=f"--out_dir={out_dir}: cannot write there"):
            train.train(tiny_config(tiny_model, tmp_path, out_dir=out_dir))


def test_a_new_run_does_not_take_over_a_run_folder_and_resume_does(tmp_path, tiny_model):
    """Reusing a run's name is the user's choice: without --resume, one line naming the run and how
    to continue it; the old run's files stay where they are."""
    from conftest import parity_reward, read_metrics, tiny_config

    train.train(tiny_config(tiny_model, tmp_path, max_steps=1, save_every=1), reward_fn=parity_reward)
    before = sorted(os.listdir(tmp_path / "t"))
    with pytest.raises(SystemExit, match=r"--run_name=t: .* holds a run \(checkpoints up to step 1\); continue it "
                                         r"with --resume=auto --run_name=t"):
        train.train(tiny_config(tiny_model, tmp_path, max_steps=2), reward_fn=parity_reward)
    assert sorted(os.listdir(tmp_path / "t")) == before and "abandoned" not in before
    train.train(tiny_config(tiny_model, tmp_path, max_steps=2, resume="auto"), reward_fn=parity_reward)
    assert [m["step"] for m in read_metrics(tmp_path / "t")] == [1, 2]


# ----------------------------------------------------------------------------- late failures, made early


def test_a_truncated_weight_file_is_named_at_start_up_for_training_resume_and_eval(tiny_model, tmp_path):
    import shutil

    import eval as evaluation
    from conftest import parity_reward, tiny_config

    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    weights = copy / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 100)
    with pytest.raises(SystemExit, match=r"model.safetensors: truncated or corrupt \(.* bytes; its header says"):
        train.train(tiny_config(tiny_model, tmp_path, model=str(copy)))
    with pytest.raises(SystemExit, match=r"model.safetensors: truncated or corrupt"):  # before any engine starts
        evaluation.main([f"--model={copy}", "--backend=hf", f"--out={tmp_path / 'e.json'}"])
    train.train(tiny_config(tiny_model, tmp_path, max_steps=1, save_every=1), reward_fn=parity_reward)
    ckpt = tmp_path / "t" / "ckpt-000001" / "model.safetensors"
    with open(ckpt, "r+b") as f:
        f.truncate(50)
    with pytest.raises(SystemExit, match="ckpt-000001/model.safetensors: "):
        train.train(tiny_config(tiny_model, tmp_path, max_steps=2, resume="auto"), reward_fn=parity_reward)


def test_lora_targets_and_a_problem_too_long_for_the_model_are_named_before_the_run_folder(tiny_model, tmp_path):
    import json

    from conftest import tiny_config

    with pytest.raises(SystemExit, match=r"--lora_targets=nonexistent: nonexistent is not a linear layer"):
        train.train(tiny_config(tiny_model, tmp_path, lora_rank=4, lora_targets="nonexistent"))
    data = tmp_path / "d.jsonl"  # the tiny model has 512 positions; one problem is far longer
    rows = [{"id": "short", "problem": "What is 1 + 1?", "answer": "2"},
            {"id": "huge", "problem": "word " * 5000, "answer": "1"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match=r"over the model's 512 positions: .*problem huge, [0-9,]+ tokens"):
        train.train(tiny_config(tiny_model, tmp_path, train_data=str(data), run_name="long"))
    assert not (tmp_path / "long").exists()  # nothing was left behind


def test_a_full_disk_is_one_line_and_the_last_checkpoint_stands(tiny_model, tmp_path, monkeypatch):
    import errno

    flags = [f"--model={tiny_model}", "--backend=hf", "--algo=grpo", "--dev_data=", "--max_steps=2", "--save_every=1",
             f"--out_dir={tmp_path}", "--run_name=full", "--max_tokens=6", "--group_size=4", "--prompts_per_step=3",
             "--autocast_bf16=False", "--reward=examples/short_answer.py:exact_match"]
    monkeypatch.chdir(ROOT)
    saves, real_save = [], torch.save

    def filling_disk(obj, path, *args, **kwargs):
        saves.append(path)
        if len(saves) > 1:  # the first checkpoint is written; the disk is full by the second
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", filling_disk)
    with pytest.raises(SystemExit) as stopped:
        train.main(flags)
    assert "No space left on device; the run stopped, its last checkpoint stands" in stopped.value.code
    assert os.readlink(tmp_path / "full" / "latest") == "ckpt-000001"
    assert not any(n.startswith(".partial") for n in os.listdir(tmp_path / "full"))  # nothing half-written


def test_sigterm_on_the_shipped_model_saves_the_step_and_exits_143(tmp_path):
    """End to end, as a preempted job: `python train.py` on the shipped model gets SIGTERM during a
    step, finishes it, saves it and exits 128 + 15; --resume=auto continues from that step."""
    import subprocess
    import sys

    flags = ["--backend=hf", "--algo=grpo", "--prompts_per_step=2", "--group_size=2", "--max_tokens=12",
             "--dev_data=", "--save_every=0", f"--out_dir={tmp_path}", "--run_name=s"]
    proc = subprocess.Popen([sys.executable, "train.py", "--max_steps=40", *flags], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    for line in proc.stdout:
        if "step 1/40 " in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=600)[0]
    assert proc.returncode == 128 + signal.SIGTERM and "stopped by signal 15" in rest
    step = int(os.readlink(tmp_path / "s" / "latest").split("-")[1])
    assert 1 <= step < 40
    done = subprocess.run([sys.executable, "train.py", f"--max_steps={step + 1}", "--resume=auto", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "resuming from " in done.stdout and f"step {step + 1}/{step + 1} " in done.stdout


def test_a_background_writer_on_a_read_only_disk_dies_quietly_and_other_thread_errors_still_show():
    import errno
    import functools
    import threading

    shown = []

    def fail(error):
        def run():
            raise error
        t = threading.Thread(target=run)
        t.start()
        t.join()

    old = threading.excepthook
    threading.excepthook = functools.partial(runs.quiet_disk_errors, default=shown.append)  # the default hook prints
    try:
        fail(OSError(errno.EROFS, "Read-only file system", "tb/events"))  # main() names it when the main thread meets it
        fail(ValueError("a real bug"))
    finally:
        threading.excepthook = old
    assert [type(a.exc_value) for a in shown] == [ValueError]
