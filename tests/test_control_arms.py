"""The control arms of the evidence (experiments/compare.py): --adv_norm=raw, --fixed_template
(rejection-sampling distillation), --algo=sft (gold solutions), and the token counts behind
the FLOPs column."""

import functools
import json
import os

import pytest
import torch

import grpo
import train
from data import Problem
from prompts import encode_prompt
from rollout import Sample
from prompts import problem_messages
from conftest import load_tiny, tiny_config


def test_raw_advantages_are_the_rewards():
    rewards = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert grpo.group_advantages(rewards, "raw").tolist() == rewards.tolist()
    with pytest.raises(ValueError, match="raw"):
        grpo.group_advantages(rewards, "mean")


def test_rejection_sampling_rows_are_the_correct_answers_under_the_plain_prompt(tiny_model):
    """adv_norm=raw + drop_failed_templated + crm=False: each correct templated rollout is a row
    of advantage 1 under x (the failures leave), with no x~ kept: maximum likelihood on them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    problem = Problem("q0", "How many mibs are in 2 trogs?", "26")
    samples = [Sample([1, 2, 3], [10 + i, 2], f"answer {i}", "stop", [-0.5, -0.1]) for i in range(4)]
    group = train.Group(problem, samples, ["Rule."] * 4, [1.0, 0.0, 1.0, 0.0])
    cfg = train.Config(group_size=4, adv_norm="raw", drop_failed_templated=True, crm=False)
    rows = train.training_rows([group], cfg, tok)
    plain = encode_prompt(tok, problem_messages(problem))
    assert [r.response_ids for r in rows] == [[10, 2], [12, 2]]
    assert all(r.advantage == 1.0 and r.prompt_ids == plain and r.tilde_prompt_ids is None for r in rows)


def test_gold_groups_end_with_the_boxed_answer_and_eos(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = train.Config()
    problems = [Problem("a", "How many pexs are in 3 zundles?", "39", solution="1 zundle is 13 pexs, so 3 × 13 = 39."),
                Problem("b", "What is 2 + 2?", "4", solution="2 + 2 = \\boxed{4}.")]
    groups = train.gold_groups(tok, {}, None, problems, {}, cfg, 0)
    first, second = (g.samples[0] for g in groups)
    assert first.text == "1 zundle is 13 pexs, so 3 × 13 = 39. The answer is \\boxed{39}."
    assert second.text == "2 + 2 = \\boxed{4}."  # a solution with its own boxed answer is kept as it is
    assert first.response_ids[-1] == tok.eos_token_id
    assert tok.decode(first.response_ids[:-1]) == first.text
    assert first.prompt_ids == encode_prompt(tok, problem_messages(problems[0]))
    assert groups[0].templates == [""] and groups[0].rewards == []  # scored by collect_groups
    with pytest.raises(SystemExit, match="c has no solution"):
        train.gold_groups(tok, {}, None, [Problem("c", "What is 1 + 1?", "2")], {}, cfg, 0)


def test_forward_tokens_by_hand():
    from runs import forward_tokens

    Row = train.Row
    rows = [Row([1, 2, 3], [4, 5], 1.0),  # trained: 5 tokens
            Row([1, 2, 3], [6], 0.0),  # zero advantage: not forwarded with a gradient
            Row([1, 2], [7, 8, 9], -0.5, tilde_prompt_ids=[9, 9, 9, 1, 2])]  # trained 5; CRM pass 5 + 8
    def count(cfg):  # the step's two rules: train.forwarded and train.passes
        terms = train.aux_terms(cfg)
        return forward_tokens(rows, cfg, functools.partial(train.forwarded, terms=terms), train.passes(cfg, terms))

    assert count(train.Config()) == {"train_fb_tokens": 10, "nograd_tokens": 13}
    # every row is forwarded (KL); old and reference forwards
    assert count(train.Config(ppo_epochs=2, kl_beta=0.1)) == {"train_fb_tokens": 2 * 14, "nograd_tokens": 13 + 2 * 14}


def gold_problems(path, solutions=True):
    rows = [{"id": f"g{n}", "problem": f"How many mibs are in {n} trogs?", "answer": str(13 * n),
             "solution": f"1 trog is 13 mibs, so {n} × 13 = {13 * n}." if solutions else "", "source": "fictional/trog"}
            for n in range(2, 8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sft_run_raises_the_gold_log_probs_and_counts_its_tokens(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    data = gold_problems(tmp_path / "gold.jsonl")
    cfg = tiny_config(tiny_model, tmp_path, algo="sft", train_data=data, group_size=1, prompts_per_step=3,
                      max_steps=3, lr=1e-3)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    problems = [Problem(f"g{n}", f"How many mibs are in {n} trogs?", str(13 * n),
                        solution=f"1 trog is 13 mibs, so {n} × 13 = {13 * n}.", source="fictional/trog") for n in (2, 3)]
    gold = train.gold_groups(tok, {}, None, problems, {}, cfg, 0)

    def gold_logp(model):
        with torch.no_grad():
            out = train.row_logprobs(model, [g.samples[0].prompt_ids for g in gold],
                                     [g.samples[0].response_ids for g in gold], 2, 1.0)
        return sum(x.sum().item() for x in out)

    before = gold_logp(load_tiny(tiny_model))
    result = train.train(cfg)
    after = gold_logp(result["policy"])
    assert after > before + 1.0  # three steps of maximum likelihood on these very rows
    counts = result["counts"]
    assert counts["train_tokens"] == 0 and counts["rollout_prefill_tokens"] == 0  # nothing sampled
    assert counts["train_fb_tokens"] > counts["gold_tokens"] > 0  # trained: prompts + the gold responses
    with open(os.path.join(tmp_path, "t", "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    assert [m["trained_rows"] for m in metrics] == [3, 3, 3]
    assert metrics[0]["loss"] == pytest.approx(-1.0, abs=1e-6)  # A = 1, ratio 1: token-mean of -A rho
    assert metrics[-1]["counts"]["gold_tokens"] == metrics[-1]["generated_tokens"] > 0  # the budget counts them


def test_sft_refuses_a_gold_solution_that_does_not_score(tiny_model, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "bad-1", "problem": "What is 2 + 2?", "answer": "4",
                                "solution": "2 + 2 = \\boxed{5}."}) + "\n")
    cfg = tiny_config(tiny_model, tmp_path, algo="sft", train_data=str(path), group_size=1, prompts_per_step=1,
                      max_steps=1)
    with pytest.raises(SystemExit, match="bad-1 does not score"):
        train.train(cfg)


def test_fixed_template_templates_every_rollout_from_the_first_step(tiny_model, tmp_path):
    template = tmp_path / "rule.txt"
    template.write_text("# the rule\nEvery trog is 13 mibs.\nA second line is not used.\n")
    data = gold_problems(tmp_path / "train.jsonl")
    cfg = tiny_config(tiny_model, tmp_path, algo="grpo", train_data=data, fixed_template=str(template), max_steps=2)
    train.train(cfg)
    with open(os.path.join(tmp_path, "t", "rollouts.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert {r["step"] for r in logged} == {1, 2}
    assert all(r["templates"] == ["Every trog is 13 mibs."] * cfg.group_size for r in logged)
    with open(os.path.join(tmp_path, "t", "metrics.jsonl")) as f:
        assert all(json.loads(line)["templated_row_fraction"] == 1.0 for line in f)


@pytest.mark.parametrize("over, message", [
    ({"algo": "p2o"}, "needs --algo=grpo"), ({"algo": "sft"}, "needs --algo=grpo"),
])
def test_fixed_template_needs_grpo(tmp_path, over, message):
    template = tmp_path / "rule.txt"
    template.write_text("Every trog is 13 mibs.\n")
    with pytest.raises(SystemExit, match=message):
        train.check_config(train.Config(fixed_template=str(template), **over))
    with pytest.raises(SystemExit, match="--fixed_template"):
        train.check_config(train.Config(algo="grpo", fixed_template=str(tmp_path / "none.txt")))
