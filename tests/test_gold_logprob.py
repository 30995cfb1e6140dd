"""experiments/gold_logprob.py: the confirmatory study's primary outcome against the model's own
cross-entropy, one problem at a time, and the fact's tokens."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import gold_logprob  # noqa: E402

from data import Problem, load_jsonl  # noqa: E402
from prompts import problem_messages  # noqa: E402
from prompts import encode_prompt  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def test_logprobs_equal_the_models_loss_one_problem_at_a_time(hf_model, tokenizer):
    problems = load_jsonl("fictional-heldout")[0][:5]
    problems.append(Problem(id="boxed", problem="What is 2 + 2?", answer="4", solution="2 + 2 = \\boxed{4}.",
                            source=""))  # a solution that already boxes its answer: nothing appended
    rows = gold_logprob.gold_logprobs(hf_model, tokenizer, problems, fact="13", batch=4)  # padded batches
    for p, row in zip(problems, rows):
        text = p.solution if p.id == "boxed" else f"{p.solution} The answer is \\boxed{{{p.answer}}}."
        prompt = encode_prompt(tokenizer, problem_messages(p))
        response = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + response])
        labels = torch.tensor([[-100] * len(prompt) + response])
        with torch.no_grad():
            loss = hf_model(input_ids=ids, labels=labels).loss.item()  # mean NLL over the response tokens
        assert row["tokens"] == len(response)
        assert row["logp_mean"] == pytest.approx(-loss, abs=1e-4)
        assert row["logp_sum"] == pytest.approx(-loss * len(response), abs=2e-3)
    assert rows[-1]["fact_logp"] is None  # no "13" in it
    summary = gold_logprob.summary(rows)
    assert summary["problems"] == 6 and summary["logp_mean"] == pytest.approx(sum(r["logp_mean"] for r in rows) / 6)
    assert summary["fact_logp"] == pytest.approx(sum(r["fact_logp"] for r in rows[:5]) / 5)


def test_fact_positions_spell_the_fact(tokenizer):
    text = "1 trog is 13 mibs, so 10 × 13 = 130. The answer is \\boxed{130}."
    at = gold_logprob.fact_positions(tokenizer, text, "13")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert at and at == list(range(at[0], at[-1] + 1))  # contiguous
    assert tokenizer.decode([ids[i] for i in at]).strip() == "13"  # the first "13" and nothing more
    assert tokenizer.decode(ids[:at[0]]).strip() == "1 trog is"
    assert gold_logprob.fact_positions(tokenizer, text, "17") == [] and gold_logprob.fact_positions(tokenizer, text, "") == []


def test_a_problem_without_a_solution_is_a_clear_error(hf_model, tokenizer):
    with pytest.raises(SystemExit, match="no-sol"):
        gold_logprob.gold_logprobs(hf_model, tokenizer, [Problem(id="no-sol", problem="?", answer="1")])
