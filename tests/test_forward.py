"""forward.py: the pooled hidden states CLIPO reads, as its release pools them, packed or not; packed
rows under FlexAttention in one row (grpo.one_row), equal to the padded layout."""

import pytest
import torch

from conftest import load_tiny
from forward import hidden_means, row_logprobs


def test_hidden_means_pool_as_released_and_packing_changes_nothing(tiny_model):
    """The sum of the final hidden states (after the last norm) at a response's tokens except its
    last, divided by its length, from a plain forward of each row alone; the same with every row
    in one padded batch and with the rows of a prompt packed together."""
    model = load_tiny(tiny_model).eval()
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [5, 6, 7]]
    responses = [[11, 12, 13, 2], [14, 2], [15, 16, 17, 18, 2], [19]]
    want = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            states = model.base_model(input_ids=torch.tensor([p + r])).last_hidden_state[0].double()  # [P + R, H]
            want.append(states[len(p):len(p) + len(r) - 1].sum(0) / len(r))  # tokens 0 .. R - 2; one token: 0
    want = torch.stack(want)
    assert torch.count_nonzero(want[3]) == 0  # a one-token response: no state the engine fed back
    for shared in (False, True):
        for chunk in (1, 3, 4):
            got = hidden_means(model, prompts, responses, pad_id=2, chunk_size=chunk, shared=shared)
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert hidden_means(model, [], [], pad_id=2, chunk_size=2).shape == (0, model.config.hidden_size)


def packed_example():
    """Three prompts of 3-40 tokens with 1-3 responses of 1-60 tokens each (a few ending in EOS =
    pad = 2): pack_rows pads the two shorter sequences, 37% of its [3, Lp] is padding."""
    import random

    rng = random.Random(5)
    prompts, responses = [], []
    for n, count in ((40, 3), (3, 1), (12, 2)):
        prompt = [rng.randrange(3, 200) for _ in range(n)]
        for k in range(count):
            prompts.append(prompt)
            responses.append([rng.randrange(3, 200) for _ in range(rng.randrange(1, 60))] + [2] * (k % 2))
    return prompts, responses


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # expected on the CPU
def test_flex_in_one_row_equals_the_padded_layout_and_the_row_layout(tiny_model, monkeypatch):
    """N5: under FlexAttention the packed sequences go end to end in one row (grpo.one_row),
    no padding. float64, forward only (the CPU has no flex backward): the log-probs and the pooled
    states equal those of the padded [S, Lp] layout (the layout before one_row) and of the rows
    unpacked (one row per response, plain SDPA)."""
    from transformers import AutoModelForCausalLM

    import grpo
    from model import use_packed_flex

    model = use_packed_flex(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64,
                                                                 attn_implementation="sdpa")).eval()
    prompts, responses = packed_example()
    padded = grpo.pack_rows(prompts, responses, 2)
    assert padded.input_ids.shape[0] == 3 and (padded.block == -2).float().mean() > 0.35
    with torch.no_grad():
        one_row = row_logprobs(model, prompts, responses, pad_id=2, temperature=0.7, shared=True)
        pooled = hidden_means(model, prompts, responses, pad_id=2, chunk_size=6, shared=True)
        with monkeypatch.context() as m:  # the padded layout: one_row leaves the tensors as they are
            m.setattr(grpo, "one_row", lambda *tensors: tensors)
            before = row_logprobs(model, prompts, responses, pad_id=2, temperature=0.7, shared=True)
            pooled_before = hidden_means(model, prompts, responses, pad_id=2, chunk_size=6, shared=True)
        rows = row_logprobs(model, prompts, responses, pad_id=2, temperature=0.7)
        pooled_rows = hidden_means(model, prompts, responses, pad_id=2, chunk_size=6)
    for a, b, c in zip(one_row, before, rows):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
        torch.testing.assert_close(a, c, atol=1e-12, rtol=0)
    torch.testing.assert_close(pooled, pooled_before, atol=1e-6, rtol=0)  # pooled states are fp32
    torch.testing.assert_close(pooled, pooled_rows, atol=1e-6, rtol=0)


def test_one_row_layout_gives_the_padded_layouts_logprobs_and_gradients(tiny_model):
    """The one-row layout itself (what FlexAttention is given), forwarded here with the dense
    SDPA mask of the same rule (the CPU has no flex backward): float32 log-probs, entropies and
    every parameter's gradient equal those of pack_rows' padded layout."""
    import grpo
    from forward import response_logprobs

    prompts, responses = packed_example()
    ids, attention, response_mask = grpo.make_batch(prompts, responses, 2)
    mask = response_mask[:, 1:]
    padded = grpo.pack_rows(prompts, responses, 2)
    one_row = grpo.Packed(*grpo.one_row(padded.input_ids, padded.block, padded.position_ids, padded.index))
    assert one_row.input_ids.shape == (1, int((padded.block != -2).sum()))
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    results = []
    for packed in (padded, one_row):
        model = load_tiny(tiny_model)
        logp, ent = response_logprobs(model, ids, attention, mask, 0.7, with_entropy=True, packed=packed)
        (logp * weights).sum().backward()
        results.append((logp.detach(), ent, {n: q.grad for n, q in model.named_parameters()}))
    (a, ent_a, grad_a), (b, ent_b, grad_b) = results
    torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-6)  # fp32: ~1 ulp at |logp| ~ 15
    torch.testing.assert_close(ent_b, ent_a, atol=2e-5, rtol=0)
    for name in grad_a:
        torch.testing.assert_close(grad_b[name], grad_a[name], atol=1e-5, rtol=1e-4)
