"""experiments/scoring_noise.py: one checkpoint scored under several sampling seeds, one engine."""

import json
import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import compare  # noqa: E402
import scoring_noise  # noqa: E402


def test_scores_per_seed_and_their_spread(tmp_path, monkeypatch):
    """A scripted engine whose samples are right for the first `seed` of k: avg@4 is seed / 4 on
    every set, avg@2 min(seed, 2) / 2; greedy always wrong. Seeds 0, 1, 3 -> avg@4 0, 0.25, 0.75
    (mean 1/3, sd 0.3819 by hand), avg@2 0, 0.5, 1 (mean 0.5, sd 0.5). One engine, never pushed."""
    import rollout
    from data import Problem, load_jsonl

    task = compare.TASKS["fictional"]
    problems = [p for name in (task.test, task.heldout) for p in load_jsonl(name)[0]]
    made = []

    class Engine:
        def generate(self, prompts, n=1, temperature=0.0, seed=None, **_):
            out = []
            for messages, k, t in zip(prompts, n, temperature):
                text = messages[-1]["content"]
                answer = next(p.answer for p in problems if p.problem in text)
                if t == 0.0:
                    out.append([rollout.Sample([1], [2], "\\boxed{7}", "stop")])
                else:
                    out.append([rollout.Sample([1], [2], f"\\boxed{{{answer}}}" if j < seed else "\\boxed{7}", "stop")
                                for j in range(k)])
            return out

        def push_weights(self, weights):
            raise AssertionError("the same checkpoint is not pushed again")

    def make(*args, **kwargs):
        made.append(args)
        return Engine()

    monkeypatch.setattr(rollout, "make_rollout", make)
    assert isinstance(problems[0], Problem)
    out = tmp_path / "noise.json"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # resolve_model checks that a folder is a model
    assert scoring_noise.main(["--task=fictional", f"--model={model}", "--seeds=0,1,3", "--k=4", "--k_templated=2",
                               "--backend=hf", f"--out={out}"]) == 0
    result = json.loads(out.read_text())
    assert len(made) == 1 and result["seeds"] == [0, 1, 3]
    assert [result["scores"][s]["heldout"]["overall"]["avg@4"] for s in ("0", "1", "3")] == [0.0, 0.25, 0.75]
    four = result["spread"]["test"]["avg@4"]
    assert four["mean"] == pytest.approx(1 / 3) and four["sd"] == pytest.approx(0.38188, abs=1e-5)
    assert four["sd"] == pytest.approx(statistics.stdev([0.0, 0.25, 0.75]))
    two = result["spread"]["heldout_templated"]["avg@2"]
    assert (two["mean"], two["sd"], two["min"], two["max"]) == pytest.approx((0.5, 0.5, 0.0, 1.0))
    assert result["spread"]["heldout"]["greedy"]["max"] == 0.0
