"""forward.py: the pooled hidden states CLIPO reads, as its release pools them, packed or not."""

import torch

from conftest import load_tiny
from forward import hidden_means


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
