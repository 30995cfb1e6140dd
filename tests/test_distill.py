import math

import pytest
import torch

from distill import crm_stats, crm_weights, distill_row
from grpo import aggregate, ppo_clip_token_loss
from prompts import FORMAT_INSTRUCTION, apply_template, build_messages, user_text
from rollout import Sample


def test_crm_mask_at_and_around_the_bounds():
    c = torch.tensor([0.005, 0.0099, 0.01, 0.0101, 1.0, 9.99, 10.0, 10.01, 50.0], dtype=torch.float64)
    templated = torch.full_like(c, -3.0)
    plain = templated + torch.log(c)  # log c = plain - templated
    w, log_c = crm_weights(plain, templated)
    assert torch.allclose(log_c, torch.log(c))
    assert w.tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0]  # the band is inclusive
    soft, _ = crm_weights(plain, templated, soft=True)
    expected = [0.01 / 0.005, 0.01 / 0.0099, 1, 1, 1, 1, 1, 10 / 10.01, 10 / 50]
    assert torch.allclose(soft, torch.tensor(expected, dtype=torch.float64))
    w2, _ = crm_weights(plain, templated, low=0.5, high=2.0)
    assert w2.tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0]


def test_crm_stats():
    w = torch.tensor([1.0, 0.0, 1.0, 0.0])
    log_c = torch.tensor([0.1, 5.0, -0.3, 0.0])
    templated = torch.tensor([True, True, True, False])
    s = crm_stats(w, log_c, templated)
    assert s["crm_masked_fraction"] == pytest.approx(1 / 3)
    assert s["crm_mean_log_ratio"] == pytest.approx((0.1 + 5.0 - 0.3) / 3)
    assert crm_stats(w, log_c, torch.zeros(4, dtype=torch.bool))["templated_tokens"] == 0


def test_rebuilt_row_has_identical_response_ids_and_the_original_prompt(model_path):
    from transformers import AutoTokenizer

    from rollout import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_path)
    plain = encode_prompt(tok, build_messages("What is 7 + 4 × 3?", fewshot=True))
    templated = encode_prompt(tok, build_messages("What is 7 + 4 × 3?", template="Multiply first.", fewshot=True))
    assert templated != plain and len(templated) > len(plain)
    sample = Sample(templated, [22, 33, 2], "x", "stop")
    prompt_ids, response_ids = distill_row(plain, sample)
    assert prompt_ids == plain and response_ids == [22, 33, 2]


def test_template_application_keeps_the_answer_format_in_the_original_text():
    x = user_text("What is 7 + 4 × 3?")
    assert x == "What is 7 + 4 × 3?\n" + FORMAT_INSTRUCTION
    assert apply_template(x, "  Multiply first.  ") == "Multiply first.\n\n" + x
    assert apply_template(x, "   ") == x
    msgs = build_messages("What is 7 + 4 × 3?", template="Multiply first.", fewshot=True)
    assert len(msgs) == 7 and msgs[-1]["content"].endswith(FORMAT_INSTRUCTION)
    assert msgs[-1]["content"].startswith("Multiply first.\n\n")
    assert all("Multiply first." not in m["content"] for m in msgs[:-1])  # few-shot turns untouched


def test_all_ones_mask_equals_plain_grpo_loss():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    old = logp.detach() + 0.05 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.float64)
    loss, _ = ppo_clip_token_loss(logp, old, adv)
    w, _ = crm_weights(old, old)  # c = 1 everywhere: all inside the band
    assert torch.equal(w, torch.ones_like(w))
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        a = aggregate(loss, mask, mode, 15, 3, max_len=5)
        b = aggregate(loss, mask, mode, 15, 3, max_len=5, weight=w)
        assert torch.equal(a, b)
