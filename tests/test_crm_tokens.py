"""experiments/crm_tokens.py: per-token context ratios of one response on the default model."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import crm_tokens  # noqa: E402

from data import Problem  # noqa: E402
from prompts import problem_messages  # noqa: E402
from prompts import encode_prompt  # noqa: E402

QUESTION, RESPONSE = "How many snigs are in 2 plonks?", "2 plonks = 2 × 13 = 26 snigs. The answer is \\boxed{26}."


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def test_no_template_means_ratio_one_everywhere(hf_model, tokenizer):
    rows = crm_tokens.token_ratios(hf_model, tokenizer, QUESTION, RESPONSE, "")
    assert len(rows) == len(tokenizer(RESPONSE, add_special_tokens=False)["input_ids"])
    assert all(c == pytest.approx(0.0, abs=1e-5) and not masked for _, _, _, c, masked in rows)


def test_log_probs_match_the_models_own_loss_and_the_mask_matches_the_band(hf_model, tokenizer):
    template = "Every big unit here is 13 of its small unit: n big units = n × 13 small units."
    low, high = 0.05, 5.0
    rows = crm_tokens.token_ratios(hf_model, tokenizer, QUESTION, RESPONSE, template, low, high,
                                   temperature=1.0)  # HF's loss below is at temperature 1
    problem = Problem(id="crm", problem=QUESTION, answer="0", solution="", source="")
    for column, tmpl in ((1, ""), (2, template)):  # independent: HF's cross-entropy over the response labels
        prompt = encode_prompt(tokenizer, problem_messages(problem, tmpl))
        response = tokenizer(RESPONSE, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + response])
        labels = torch.tensor([[-100] * len(prompt) + response])
        with torch.no_grad():
            mean_nll = hf_model(ids, labels=labels).loss.item()
        assert sum(r[column] for r in rows) == pytest.approx(-mean_nll * len(response), rel=1e-4)
    for _, p, q, c, masked in rows:
        assert c == pytest.approx(p - q, abs=1e-5)
        assert masked == (c < math.log(low) or c > math.log(high))
    assert any(masked for *_, masked in rows)  # the template changes some token's odds beyond 5x
