"""distill.py: the rebuilt context-distillation row and the Context Ratio Mask (elementwise, per row, laid out
over a padded batch, and the CRM pass over a step's rows)."""

import math

import pytest
import torch

from distill import CrmSums, crm_rows, crm_weights, distill_row, row_crm_weights
from forward import two_context_logprobs
from grpo import aggregate, ppo_clip_token_loss, scatter_rows
from prompts import build_messages
from rollout import Sample


def test_crm_mask_at_and_around_the_bounds():
    c = torch.tensor([0.005, 0.0099, 0.01, 0.0101, 1.0, 9.99, 10.0, 10.01, 50.0], dtype=torch.float64)
    templated = torch.full_like(c, -3.0)
    plain = templated + torch.log(c)  # log c = plain - templated
    w, log_c = crm_weights(plain, templated)
    assert torch.allclose(log_c, torch.log(c))
    assert w.tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0]  # the band is inclusive
    soft, _ = crm_weights(plain, templated, soft=True)
    # below the band c / low, above it high / c: never more than 1 (bound / c below would be 2x, ~1.01x)
    expected = [0.005 / 0.01, 0.0099 / 0.01, 1, 1, 1, 1, 1, 10 / 10.01, 10 / 50]
    assert torch.allclose(soft, torch.tensor(expected, dtype=torch.float64))
    tiny = torch.tensor([math.log(5e-5)], dtype=torch.float64)  # c = 5e-5: the reference code's bound/c = 200
    assert crm_weights(tiny, torch.zeros(1, dtype=torch.float64), soft=True)[0].item() == pytest.approx(5e-3)
    w2, _ = crm_weights(plain, templated, low=0.5, high=2.0)
    assert w2.tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0]


def crm_token_weights(mask, plain, tilde, **kw):
    """Per-row CRM weights (distill.row_crm_weights) laid out on a padded batch (grpo.scatter_rows)."""
    weights, sums = [], CrmSums()
    for p, q in zip(plain, tilde):
        w, s = row_crm_weights(p, q, **kw) if p is not None else (None, CrmSums())
        weights.append(w)
        sums += s
    return scatter_rows(weights, mask, fill=1.0)[0], sums


def test_row_crm_weights_docstring_example():
    w, sums = row_crm_weights(torch.tensor([-0.5, -0.5, -0.5]), torch.tensor([-0.5, -9.0, -0.6]))
    assert w.tolist() == [1, 0, 1]
    assert (sums.templated_tokens, sums.out_of_band_tokens, sums.weight_sum) == (3, 1, 2.0)
    assert sums.log_ratio_sum == pytest.approx(0.0 + 8.5 + 0.1)
    with pytest.raises(ValueError, match="3 plain and 2 templated"):
        row_crm_weights(torch.zeros(3), torch.zeros(2))


def test_crm_token_weights_docstring_example():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    plain = [None, torch.tensor([-0.5, -0.5, -0.5])]
    tilde = [None, torch.tensor([-0.5, -9.0, -0.6])]
    w, sums = crm_token_weights(mask, plain, tilde)
    assert w.tolist() == [[1, 1, 1], [1, 0, 1]]
    assert (sums.templated_tokens, sums.out_of_band_tokens, sums.weight_sum) == (3, 1, 2.0)
    assert sums.log_ratio_sum == pytest.approx(0.0 + 8.5 + 0.1)


def test_crm_token_weights_scatter_to_each_rows_own_response_positions():
    # rows with different prompt lengths: responses start at different positions of the padded batch
    mask = torch.tensor([[False, False, True, True, False],
                         [False, True, True, True, True],
                         [True, True, False, False, False]])
    plain = [torch.tensor([-1.0, -1.0]), None, torch.tensor([-2.0, -2.0])]
    tilde = [torch.tensor([-1.0, -8.0]), None, torch.tensor([-0.1, -2.0])]  # c = [1, e^7]; [e^-1.9, 1]
    w, sums = crm_token_weights(mask, plain, tilde, soft=True)
    expected = torch.ones(3, 5)
    expected[0, 3] = 10 / math.exp(7.0)  # above the band: high / c
    expected[2, 0] = 1.0  # e^-1.9 = 0.15 is inside [0.01, 10]
    assert torch.allclose(w, expected)
    assert sums.templated_tokens == 4 and sums.out_of_band_tokens == 1
    assert sums.weight_sum == pytest.approx(3 + 10 / math.exp(7.0))
    both = sums + CrmSums(1, 1, 0.0, -5.0)
    assert (both.templated_tokens, both.out_of_band_tokens) == (5, 2)
    with pytest.raises(ValueError, match="row 0"):
        crm_token_weights(mask, [torch.zeros(3), None, None], [torch.zeros(3), None, None])


def test_soft_and_hard_count_the_same_out_of_band_tokens():
    mask = torch.ones(1, 4, dtype=torch.bool)
    plain = [torch.log(torch.tensor([0.001, 1.0, 50.0, 2.0]))]
    tilde = [torch.zeros(4)]
    hard_w, hard = crm_token_weights(mask, plain, tilde)
    soft_w, soft = crm_token_weights(mask, plain, tilde, soft=True)
    assert hard.out_of_band_tokens == soft.out_of_band_tokens == 2  # both sides of the band counted
    assert hard_w.tolist() == [[0, 1, 0, 1]]
    assert (soft_w <= 1).all() and soft_w[0, 0].item() == pytest.approx(0.1)  # c / low = 0.001 / 0.01


def test_two_context_pass_and_crm_cover_every_templated_row_in_chunks():
    """A scripted log-prob function: under x every token has log-prob -1, under x~ (prompt starts
    with 99) the k-th token of a row has -1 - k. So c_t = e^k: with the band [0.01, 10], tokens
    k >= 3 (e^3 = 20 > 10) are out of band. Chunks of 2 templated rows: x rows then x~ rows per call."""
    calls = []

    def old_logprobs(prompts, responses):
        calls.append([p[0] for p in prompts])
        return [torch.tensor([-1.0 - k * (p[0] == 99) for k in range(len(r))]) for p, r in zip(prompts, responses)]

    firsts, seconds = [[1], [1], [2], [3]], [[99, 1], None, [99, 2], [99, 3]]
    responses = [[5] * 5, [5] * 2, [5] * 4, [5] * 1]
    plain, tilde = two_context_logprobs(old_logprobs, firsts, seconds, responses, chunk_size=2)
    assert calls == [[1, 2, 99, 99], [3, 99]]  # the plain row is never forwarded
    assert plain[1] is None and tilde[1] is None
    assert tilde[0].tolist() == [-1, -2, -3, -4, -5] and tilde[3].tolist() == [-1]  # the x~ forwards, as they came
    assert plain[2].tolist() == [-1] * 4
    weights, sums = crm_rows(plain, tilde)
    assert weights[0].tolist() == [1, 1, 1, 0, 0] and weights[2].tolist() == [1, 1, 1, 0] and weights[3].tolist() == [1]
    assert weights[1] is None
    assert (sums.templated_tokens, sums.out_of_band_tokens, sums.weight_sum) == (10, 3, 7.0)
    assert sums.log_ratio_sum == pytest.approx(sum(range(5)) + sum(range(4)) + 0)
    assert two_context_logprobs(old_logprobs, [[1]], [None], [[5]], 2) == ([None], [None])  # no second prompt
    assert crm_rows([None], [None]) == ([None], CrmSums())
    assert len(calls) == 2  # ... and no forward


def test_rebuilt_row_has_identical_response_ids_and_the_original_prompt(model_path):
    from transformers import AutoTokenizer

    from prompts import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_path)
    plain = encode_prompt(tok, build_messages("What is 7 + 4 × 3?", fewshot=True))
    templated = encode_prompt(tok, build_messages("What is 7 + 4 × 3?", template="Multiply first.", fewshot=True))
    assert templated != plain and len(templated) > len(plain)
    sample = Sample(templated, [22, 33, 2], "x", "stop")
    prompt_ids, response_ids = distill_row(plain, sample)
    assert prompt_ids == plain and response_ids == [22, 33, 2]


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
