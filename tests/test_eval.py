"""eval.py: unbiased pass@k, the paper's protocol, per-source summaries, the table and the CLI on bad data."""

import itertools
import json
import math
import os
import subprocess
import sys

import pytest

import eval as evaluation
import scoring
from data import Problem
from scoring import answer_records, pass_at_k, pass_ks, summarize_records
from rollout import Sample


@pytest.mark.parametrize("n, c", [(1, 0), (1, 1), (4, 2), (6, 1), (8, 5), (16, 3), (16, 16)])
def test_pass_at_k_equals_enumeration(n, c):
    """Independent expectation: the fraction of all k-subsets of the n samples holding a hit."""
    samples = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        expected = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_large_n_is_stable():
    assert pass_at_k(1000, 1, 10) == pytest.approx(1 - math.comb(999, 10) / math.comb(1000, 10))
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_default_protocol():
    assert scoring.default_k(30) == 16 and scoring.default_k(500) == 0
    assert pass_ks(16) == [1, 2, 4, 8, 16] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(0) == []


class ScriptedEngine:
    """Answers from a script: {(problem_text, temperature > 0): [responses]}."""

    def __init__(self, script):
        self.script = script

    def generate(self, prompts, n=1, temperature=1.0, **_):
        counts = n if isinstance(n, list) else [n] * len(prompts)  # per prompt, as rollout.py's engines
        temperatures = temperature if isinstance(temperature, list) else [temperature] * len(prompts)
        out = []
        for messages, n, temperature in zip(prompts, counts, temperatures):
            question = messages[-1]["content"].split("\n")[0]
            texts = self.script[(question, temperature > 0)]
            assert len(texts) == n
            out.append([Sample([1], [5] * (i + 1), t, "length" if t == "..." else "stop")
                        for i, t in enumerate(texts)])
        return out


def test_evaluate_by_hand():
    problems = [Problem("a", "What is 1 + 1?", "2", source="builtin/add1"),
                Problem("b", "What is 2 × 3?", "6", source="builtin/mul1")]
    engine = ScriptedEngine({
        ("What is 1 + 1?", False): ["\\boxed{2}"],
        ("What is 1 + 1?", True): ["\\boxed{2}", "\\boxed{3}", "...", "\\boxed{2}"],
        ("What is 2 × 3?", False): ["6"],
        ("What is 2 × 3?", True): ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}", "..."],
    })
    records = answer_records(engine, problems, k=4, progress=False)
    overall, by_source = summarize_records(records, 4)
    assert overall["greedy"] == 0.5 and overall["greedy_boxed"] == 0.5
    assert overall["avg@4"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert overall["pass@1"] == pytest.approx(overall["avg@4"])
    assert overall["pass@2"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6)) / 2)  # C(2,2)/C(4,2), C(3,2)/C(4,2)
    assert overall["pass@4"] == 1.0
    assert by_source["builtin/mul1"]["greedy"] == 0.0 and by_source["builtin/add1"]["avg@4"] == 0.5
    assert records[0]["rewards"] == [1.0] and records[0]["sampled"]["rewards"] == [1, 0, 0, 1]
    assert records[1]["sampled"]["extracted"] == ["5", "5", "6", None]
    assert records[0]["fewshot_turns"] == 3 and "What is 1 + 1?" in records[0]["prompt"]


def test_a_template_is_applied_to_every_prompt():
    class Recorder:
        def generate(self, messages, n=1, **_):
            self.seen = [m[-1]["content"] for m in messages]
            return [[Sample([1], [2], "\\boxed{12}", "stop")] * k for k in (n if isinstance(n, list) else [n] * len(messages))]

    engine = Recorder()
    problem = Problem("z", "How many blarps are in 2 zogs?", "14", source="fictional/zog")
    (record,) = answer_records(engine, [problem], template="1 zog = 7 blarps.")
    assert engine.seen[0].startswith("1 zog = 7 blarps.\n\nHow many blarps are in 2 zogs?")
    assert record["rewards"] == [0.0] and record["fewshot_turns"] == 3


def test_bad_data_file_exits_nonzero_with_location(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "1", "problem": "p", "answer": "1"}) + "\n{broken\n")
    assert evaluation.main([f"--data={path}"]) == 2
    assert f"{path}:2: invalid JSON" in capsys.readouterr().err


def test_eval_cli_end_to_end(vllm_engine, tmp_path, monkeypatch, capsys):
    """The CLI on a small file, reusing the session engine instead of starting another (a second
    in-process engine would tear down the first one's vLLM state when it is freed)."""
    rows = [{"id": f"r{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1), "source": "builtin/add1"}
            for i in range(3)]
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    made = {}
    monkeypatch.setattr(evaluation, "make_rollout", lambda *a, **k: made.update(k) or vllm_engine)
    out = tmp_path / "res.json"
    assert evaluation.main([f"--data={path}", "--k=2", "--max_tokens=32", f"--out={out}"]) == 0
    from prompts import encode_prompt

    longest = max(len(encode_prompt(vllm_engine.tokenizer, evaluation.problem_messages(
        Problem(r["id"], r["problem"], r["answer"], source=r["source"])))) for r in rows)
    assert made["max_model_len"] == longest + 32 and made["gpu_memory_utilization"] == 0.9
    result = json.loads(out.read_text())["results"][str(path)]
    assert result["k"] == 2 and result["overall"]["problems"] == 3
    assert 0.0 <= result["overall"]["greedy"] <= 1.0
    samples = [json.loads(x) for x in (tmp_path / "res.samples.jsonl").read_text().splitlines()]
    assert [s["id"] for s in samples] == ["r0", "r1", "r2"] and len(samples[0]["sampled"]["responses"]) == 2
    assert "greedy" in capsys.readouterr().out


def test_eval_under_torchrun_shards_problems_and_rank0_merges(tiny_model, tmp_path):
    """torchrun --nproc_per_node=2 eval.py: each rank answers every other problem with its own
    engine (HF backend here), rank 0 writes one result with every problem in data order; the
    greedy answers equal a single process's."""
    rows = [{"id": f"r{i}", "problem": f"What is {i} + {i + 3}?", "answer": str(2 * i + 3),
             "source": "builtin/add1" if i % 2 else "builtin/add2"} for i in range(5)]
    path = tmp_path / "five.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [f"--model={tiny_model}", "--backend=hf", "--dtype=float32", f"--data={path}", "--k=2", "--max_tokens=6"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29531",
                          "eval.py", *args, f"--out={tmp_path / 'two.json'}"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    assert evaluation.main([*args, f"--out={tmp_path / 'one.json'}"]) == 0
    samples = {n: [json.loads(x) for x in (tmp_path / f"{n}.samples.jsonl").read_text().splitlines()]
               for n in ("one", "two")}
    assert [r["id"] for r in samples["two"]] == [f"r{i}" for i in range(5)]  # every problem once, in data order
    assert [r["responses"] for r in samples["two"]] == [r["responses"] for r in samples["one"]]  # greedy
    assert all(len(r["sampled"]["responses"]) == 2 for r in samples["two"])
    result = json.loads((tmp_path / "two.json").read_text())["results"][str(path)]
    assert result["overall"]["problems"] == 5 and set(result["by_source"]) == {"builtin/add1", "builtin/add2"}
    assert [p.name for p in tmp_path.glob("two*rank*")] == ["two.engine-rank1.log"]  # rank 1: its engine's log only


def test_eval_takes_a_runs_latest_link_as_model(tiny_model, tmp_path, capsys):
    """Issue 10: `python eval.py --model=runs/<run>/latest` loads the checkpoint it links to; a run
    folder itself (not a model) is a one-line error."""
    import shutil

    from runs import link_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(tiny_model, run / "ckpt-000002")
    link_checkpoint(str(run), "latest", 2)
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(2)))
    args = ["--backend=hf", "--dtype=float32", f"--data={data}", "--k=0", "--max_tokens=4"]
    assert evaluation.main([f"--model={run / 'latest'}", *args, f"--out={tmp_path / 'e.json'}"]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["results"][str(data)]["overall"]["problems"] == 2
    with pytest.raises(SystemExit, match="not a model folder"):
        evaluation.main([f"--model={run}", *args])


def test_the_engine_context_holds_the_longest_prompt_and_max_tokens(model_path, tmp_path, monkeypatch):
    """eval.py sizes vLLM's context from the data (vLLM's own 2,048 default cut answers short
    without a word): the longest prompt as the engine will see it, plus --max_tokens; a given
    --max_model_len too short for that is an error naming both."""
    from transformers import AutoTokenizer

    from prompts import problem_messages
    from prompts import encode_prompt

    rows = [{"id": "a", "problem": "What is 1 + 1?", "answer": "2"},
            {"id": "b", "problem": "What is " + " + ".join(["7"] * 60) + "?", "answer": "420"}]
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = evaluation.load_jsonl(str(path))[0]
    tok = AutoTokenizer.from_pretrained(model_path)
    longest = len(encode_prompt(tok, problem_messages(problems[1], "Be careful.", fmt="default")))
    assert longest > len(encode_prompt(tok, problem_messages(problems[0], "Be careful.", fmt="default")))
    args = evaluation.argparse.Namespace(max_tokens=3000, max_model_len=0, prompt_format="default")
    assert evaluation.eval_context(model_path, problems, args, "Be careful.") == longest + 3000
    args.max_model_len = longest + 2999
    with pytest.raises(SystemExit, match=f"cannot hold the longest prompt \\({longest} tokens\\)"):
        evaluation.eval_context(model_path, problems, args, "Be careful.")
    args.max_model_len = 8192
    assert evaluation.eval_context(model_path, problems, args, "Be careful.") == 8192


def test_majority_vote_groups_equivalent_answers_and_breaks_ties_by_first_answer():
    from scoring import majority_reward

    # gold 1/2: "0.5" and "\frac{1}{2}" are one vote (2) against "7" (1) -> the right answer wins
    assert majority_reward(["0.5", "7", "\\frac{1}{2}"], [1.0, 0.0, 1.0]) == 1.0
    # three "3" against two halves, and unboxed samples do not vote -> wrong
    assert majority_reward(["1/2", "\\frac{1}{2}", "3", "3", None, "3"], [1, 1, 0, 0, 0, 0]) == 0.0
    assert majority_reward(["5", "4"], [0.0, 1.0]) == 0.0 and majority_reward(["4", "5"], [1.0, 0.0]) == 1.0  # tie
    assert majority_reward([None, None], [0.0, 0.0]) == 0.0
    row = scoring.summarize([{"rewards": [1.0], "extracted": ["2"], "truncated": [False]}] * 2,
                               [{"rewards": [0.0, 1.0, 1.0], "extracted": ["3", "2", "2"], "lengths": [1, 1, 1]},
                                {"rewards": [0.0, 0.0, 1.0], "extracted": ["3", "3", "2"], "lengths": [1, 1, 1]}], 3)
    assert row["maj@3"] == 0.5 and row["avg@3"] == pytest.approx(0.5)


def test_a_checkpoint_passes_on_its_training_settings_and_flags_win(tmp_path):
    import torch

    ckpt = tmp_path / "ckpt-000010"
    ckpt.mkdir()
    (ckpt / "train_config.json").write_text(json.dumps({
        "prompt_format": "official", "chat_template_kwargs": '{"enable_thinking": false}', "max_tokens": 77,
        "temperature": 0.3, "lr": 1e-6}))
    args = evaluation.parse_args([f"--model={ckpt}", "--temperature=0.9"])
    assert evaluation.inherit_settings(args) == {"prompt_format": "official", "max_tokens": 77,
                                                  "chat_template_kwargs": '{"enable_thinking": false}'}
    assert (args.prompt_format, args.max_tokens, args.temperature, args.top_p) == ("official", 77, 0.9, 1.0)
    old = tmp_path / "old"  # a checkpoint written before train_config.json: its trainer.pt's config
    old.mkdir()
    torch.save({"config": {"max_tokens": 55, "top_p": 0.95}, "loop": {}}, old / "trainer.pt")
    args = evaluation.parse_args([f"--model={old}"])
    assert evaluation.inherit_settings(args) == {"max_tokens": 55, "top_p": 0.95}
    assert (args.prompt_format, args.max_tokens, args.temperature) == ("default", 55, 0.6)
    args = evaluation.parse_args(["--model=Qwen/Qwen3-0.6B"])  # not a folder: the defaults
    assert evaluation.inherit_settings(args) == {} and args.max_tokens == 256


def test_eval_of_a_run_checkpoint_uses_its_prompt_format_and_chat_kwargs(tiny_model, tmp_path, monkeypatch, capsys):
    import shutil

    ckpt = tmp_path / "run" / "ckpt-000002"
    shutil.copytree(tiny_model, ckpt)
    (ckpt / "train_config.json").write_text(json.dumps({"prompt_format": "official", "max_tokens": 5,
                                                        "chat_template_kwargs": '{"enable_thinking": false}'}))
    made = {}
    real = evaluation.make_rollout

    def record(backend, path, **options):
        made.update(options)
        return real(backend, path, **options)
    monkeypatch.setattr(evaluation, "make_rollout", record)
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"id": "a", "problem": "What is 1 + 2?", "answer": "3"}) + "\n")
    out = tmp_path / "res.json"
    assert evaluation.main([f"--model={ckpt}", "--backend=hf", "--dtype=float32", f"--data={path}", "--k=0",
                            f"--out={out}"]) == 0
    printed = capsys.readouterr().out
    assert "settings of the run that trained" in printed and "--prompt_format='official'" in printed
    assert made["chat_template_kwargs"] == {"enable_thinking": False}
    sample = json.loads((tmp_path / "res.samples.jsonl").read_text())
    assert sample["prompt"].startswith("Let's think step by step") and max(sample["lengths"]) <= 5
    assert json.loads(out.read_text())["config"]["max_tokens"] == 5
    assert (tmp_path / "res.engine.log").exists()  # library logs go beside the results


def test_the_reward_rule_is_inherited_and_scores_the_answers(tmp_path):
    """--reward=official (from the checkpoint's run or a flag): two boxes score 0, a number within
    relative 1e-4 scores 1; ours scores the final box and wants the value exactly."""
    ckpt = tmp_path / "ckpt-000001"
    ckpt.mkdir()
    (ckpt / "train_config.json").write_text(json.dumps({"reward": "official"}))
    args = evaluation.parse_args([f"--model={ckpt}"])
    assert evaluation.inherit_settings(args) == {"reward": "official"} and args.reward == "official"
    assert evaluation.parse_args(["--model=x", "--reward=ours"]).reward == "ours"

    class Answers:
        def generate(self, messages, n=1, **_):
            return [[Sample([1], [2], text, "stop")] for text in ("\\boxed{3} no, \\boxed{4}", "\\boxed{100.005}")]

    problems = [Problem("a", "p", "4"), Problem("b", "q", "100")]
    ours = [r["rewards"][0] for r in answer_records(Answers(), problems, progress=False)]
    official = [r["rewards"][0] for r in answer_records(Answers(), problems, progress=False, reward="official")]
    assert ours == [1.0, 0.0] and official == [0.0, 1.0]


def test_the_engine_dtype_defaults_to_fp32_where_bf16_is_emulated(monkeypatch):
    import config

    made = []
    monkeypatch.setattr(evaluation, "make_rollout", lambda backend, path, dtype, **_: made.append(dtype))
    monkeypatch.setattr(evaluation, "resolve_model", lambda name: name)
    for emulated in (True, False):
        monkeypatch.setattr(config, "bf16_is_emulated", lambda device_type, e=emulated: e)
        for flag in ([], ["--dtype=bfloat16"]):
            args = evaluation.parse_args(["--model=m", "--backend=hf", *flag])
            evaluation.make_engine(args, {}, "", {}, 0)
    assert made == ["float32", "bfloat16", "bfloat16", "bfloat16"]  # a given --dtype stays


def test_a_reward_that_fails_on_a_gold_answer_is_one_line_before_any_engine(tmp_path, capsys):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": "q1", "problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    (tmp_path / "rewards.py").write_text("def broken(response, problem):\n    return None\n")
    assert evaluation.main([f"--data={path}", f"--reward={tmp_path / 'rewards.py'}:broken"]) == 2
    assert "returned None for problem q1" in capsys.readouterr().err
