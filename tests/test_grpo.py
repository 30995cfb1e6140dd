"""grpo.py: advantages, log-probs, entropy, PPO-clip (clip-higher, dual clip), k3 KL and step-level aggregation against hand values and float64 references."""

import math
import os
import subprocess
import sys

import pytest
import torch

from grpo import (Denominators, aggregate, entropy, group_advantages, head_logprobs, k3_kl, make_batch, policy_loss,
                  ppo_clip_token_loss, scatter_rows, step_denominators, token_logprobs)


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0],
                      [1.0, 0.0, 0.0, 0.0]])
    a = group_advantages(r)
    # unbiased std of [1,0,0,1] = sqrt(1/3); of [1,0,0,0] = 0.5
    s = math.sqrt(1 / 3)
    expected = torch.tensor([[0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], [0.0] * 4, [0.0] * 4,
                             [0.75 / 0.5, -0.25 / 0.5, -0.25 / 0.5, -0.25 / 0.5]])
    assert torch.allclose(a, expected, atol=1e-5)
    assert torch.allclose(group_advantages(r, norm="none")[3], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    assert torch.equal(group_advantages(torch.tensor([[1.0]])), torch.tensor([[0.0]]))
    with pytest.raises(ValueError):
        group_advantages(r, norm="batch")


def test_token_logprobs_equal_negative_cross_entropy_and_entropy_is_true_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    for t in (1.0, 0.6):
        lp = token_logprobs(logits, tokens, t)
        ce = torch.nn.functional.cross_entropy((logits / t).reshape(-1, 11), tokens.reshape(-1), reduction="none")
        assert torch.allclose(lp, -ce.reshape(3, 5), atol=1e-6)
        p = torch.softmax(logits.double() / t, -1)
        assert torch.allclose(entropy(logits, t).double(), -(p * p.log()).sum(-1), atol=1e-5)


def head_case(n=9, h=6, v=13, dtype=torch.float64, seed=2):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_()
    weight = (2 * torch.randn(v, h, generator=g, dtype=dtype)).requires_grad_()  # logits of a few nats
    return hidden, weight, torch.randint(0, v, (n,), generator=g)


@pytest.mark.parametrize("chunk", [1, 4, 9, 100])
def test_head_logprobs_equal_the_full_logits_in_float64(chunk):
    """Chunked LM-head log-probs, entropy and gradients (hidden and head weight) against the
    [N, V] logits path in float64, for chunks that do and do not divide N."""
    hidden, weight, targets = head_case()
    upstream = torch.linspace(-1.0, 2.0, len(targets), dtype=torch.float64)  # any d loss / d logp
    for t in (1.0, 0.6):
        logp, ent = head_logprobs(hidden, weight, targets, t, chunk, with_entropy=True)
        grads = torch.autograd.grad((logp * upstream).sum(), (hidden, weight))
        full = torch.log_softmax(hidden @ weight.T / t, -1)  # [N, V]
        want = full.gather(1, targets[:, None]).squeeze(1)
        want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight))
        assert logp.dtype == torch.float64 and not ent.requires_grad
        torch.testing.assert_close(logp, want, atol=1e-12, rtol=0)
        torch.testing.assert_close(ent, -(full.exp() * full).sum(-1), atol=1e-12, rtol=0)
        for got, exp in zip(grads, want_grads):
            torch.testing.assert_close(got, exp, atol=1e-12, rtol=0)


def test_head_logprobs_pass_gradcheck_and_take_no_tokens():
    hidden, weight, targets = head_case(n=5, v=7)
    assert torch.autograd.gradcheck(lambda a, b: head_logprobs(a, b, targets, 0.7, chunk=2)[0], (hidden, weight))
    empty = head_logprobs(hidden[:0], weight, targets[:0], 1.0, 4, with_entropy=True)
    assert empty[0].shape == empty[1].shape == (0,)


def test_head_logprobs_under_bf16_autocast_round_like_an_autocast_linear():
    """Under autocast the head's matmul runs in bf16 as nn.Linear's would; results are fp32 and
    within bf16 rounding of today's path (an autocast F.linear, then token_logprobs)."""
    hidden, weight, targets = head_case(n=12, h=16, v=50, dtype=torch.float32)
    with torch.autocast("cpu", torch.bfloat16):
        logp, _ = head_logprobs(hidden, weight, targets, 1.0, chunk=5)
        logits = torch.nn.functional.linear(hidden, weight)
    assert logits.dtype == torch.bfloat16 and logp.dtype == torch.float32
    torch.testing.assert_close(logp, token_logprobs(logits[None], targets[None])[0], atol=1e-4, rtol=0)
    g_chunked = torch.autograd.grad(logp.sum(), weight)[0]
    g_today = torch.autograd.grad(token_logprobs(logits[None], targets[None]).sum(), weight)[0]
    assert g_chunked.dtype == torch.float32
    torch.testing.assert_close(g_chunked, g_today, atol=0.05, rtol=0.02)  # bf16 products, summed in fp32 vs bf16


def reference_loss(logp, old, adv, eps_low, eps_high, dual):
    """float64 scalar-by-scalar reference of the PPO-clip token loss."""
    out = torch.zeros_like(logp, dtype=torch.float64)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            a = float(adv[i])
            rho = math.exp(float(logp[i, t]) - float(old[i, t]))
            loss = max(-a * rho, -a * min(max(rho, 1 - eps_low), 1 + eps_high))
            if dual and a < 0:
                loss = min(loss, -a * dual)
            out[i, t] = loss
    return out


@pytest.mark.parametrize("eps_low, eps_high, dual", [(0.2, 0.2, 0.0), (0.2, 0.28, 0.0), (0.2, 0.2, 3.0)])
def test_ppo_loss_matches_float64_reference(eps_low, eps_high, dual):
    g = torch.Generator().manual_seed(1)
    old = torch.randn(4, 6, generator=g, dtype=torch.float64) - 2
    logp = old + 1.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)  # ratios far outside the clip
    adv = torch.tensor([1.3, -0.7, 0.0, -2.0], dtype=torch.float64)
    loss, _ = ppo_clip_token_loss(logp, old, adv, eps_low, eps_high, dual)
    assert torch.allclose(loss, reference_loss(logp, old, adv, eps_low, eps_high, dual), atol=1e-12)


def test_gradient_is_zero_exactly_where_the_clip_is_active():
    old = torch.zeros(2, 4, dtype=torch.float64)
    # ratios: 0.5 (below), 1.0 (inside), 1.1 (inside), 1.5 (above)
    logp = torch.log(torch.tensor([[0.5, 1.0, 1.1, 1.5]] * 2, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, clipped = ppo_clip_token_loss(logp, old, adv)
    loss.sum().backward()
    # A > 0: the upper clip binds (ratio 1.5); A < 0: the lower clip binds (ratio 0.5)
    assert clipped.tolist() == [[False, False, False, True], [True, False, False, False]]
    assert (logp.grad[clipped] == 0).all()
    assert (logp.grad[~clipped] != 0).all()
    # unclipped gradient of -A*rho wrt logp is -A*rho
    assert torch.allclose(logp.grad[0, :3], -torch.tensor([0.5, 1.0, 1.1], dtype=torch.float64))


def test_single_update_loss_is_minus_mean_advantage_with_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([1.0, -0.5])
    mask = torch.ones(2, 2)
    loss, _ = ppo_clip_token_loss(logp, logp.detach(), adv)
    total = aggregate(loss, mask, "token-mean", step_tokens=4, step_rows=2)
    total.backward()
    assert total.item() == pytest.approx(-(1.0 * 2 - 0.5 * 2) / 4)
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25], [0.125, 0.125]]))


def test_k3_is_nonnegative_and_zero_at_equality():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(100, generator=g), torch.randn(100, generator=g)
    assert (k3_kl(a, b) >= 0).all()
    assert torch.equal(k3_kl(a, a), torch.zeros(100))
    d = b - a
    assert torch.allclose(k3_kl(a, b), (d.exp() - d - 1).clamp(max=10))


def split_sum(token_loss, mask, mode, sizes, max_len=None):
    step_tokens, step_rows = mask.sum(), mask.shape[0]
    total, start = 0.0, 0
    for n in sizes:
        sl = slice(start, start + n)
        width = int(mask[sl].sum(1).max())  # each micro-batch padded only to its own longest row
        total = total + aggregate(token_loss[sl, :width], mask[sl, :width], mode, step_tokens,
                                  step_rows, max_len)
        start += n
    return total


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_invariance(mode):
    """k micro-batches of uneven lengths give the same loss and gradient as one batch."""
    g = torch.Generator().manual_seed(3)
    lengths = [1, 7, 3, 5, 2, 8]
    mask = torch.zeros(6, 8)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    logp = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    loss, _ = ppo_clip_token_loss(logp, logp.detach() + 0.1, adv)
    whole = aggregate(loss, mask, mode, mask.sum(), 6, max_len=8)
    (grad_whole,) = torch.autograd.grad(whole, logp, retain_graph=True)
    parts = split_sum(loss, mask, mode, [1, 3, 2], max_len=8)
    (grad_parts,) = torch.autograd.grad(parts, logp)
    assert torch.allclose(whole, parts) and torch.allclose(grad_whole, grad_parts)
    if mode == "token-mean":  # every valid token weighs 1 / N_tokens(step), whatever its row
        nonzero = grad_whole[mask.bool()] / (-adv.unsqueeze(1).expand(6, 8)[mask.bool()] * math.exp(-0.1))  # rho = exp(-0.1), inside the clip
        assert torch.allclose(nonzero, torch.full_like(nonzero, 1 / mask.sum().item()), atol=1e-4)


def test_aggregation_values_by_hand():
    loss = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token-mean", 3, 2).item() == pytest.approx(2.0)
    assert aggregate(loss, mask, "seq-mean-token-mean", 3, 2).item() == pytest.approx((1.5 + 3) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", 3, 2, max_len=4).item() == pytest.approx(6 / 8)
    weight = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]])  # a masked token still counts below
    assert aggregate(loss, mask, "token-mean", 3, 2, weight=weight).item() == pytest.approx(5 / 3)


def test_make_batch_keeps_eos_in_the_mask_even_when_pad_equals_eos():
    ids, attn, mask = make_batch([[5, 6], [7]], [[8, 2], [9, 9, 9, 2]], pad_id=2)
    assert ids.tolist() == [[5, 6, 8, 2, 2], [7, 9, 9, 9, 2]]
    assert attn.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert mask.int().tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]
    # the loss positions: the EOS (2) of both rows is a target with mask 1
    targets, loss_mask = ids[:, 1:], mask[:, 1:]
    assert targets[loss_mask].tolist() == [8, 2, 9, 9, 9, 2]


def test_pack_rows_worked_example():
    """The docstring example of grpo.pack_rows, by hand: rows 0 and 1 share [5, 6]."""
    from grpo import attention_mask_for, pack_rows

    p = pack_rows([[5, 6], [5, 6], [7]], [[8, 2], [9, 9, 2], [4, 2]], pad_id=0)
    assert p.input_ids.tolist() == [[5, 6, 8, 2, 9, 9, 2], [7, 4, 2, 0, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4], [0, 1, 2, 0, 0, 0, 0]]
    assert p.index.tolist() == [1, 2, 1, 4, 5, 7, 8]
    assert p.block.tolist() == [[-1, -1, 0, 0, 1, 1, 1], [-1, 0, 0, -2, -2, -2, -2]]
    # sequence 0: the prompt (0, 1) is seen by all; response 1 (4-6) never sees response 0 (2, 3)
    assert attention_mask_for(p.block, "sdpa")[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0, 0],
                                                [1, 1, 0, 0, 0, 0, 0],
                                                [1, 1, 1, 0, 0, 0, 0],
                                                [1, 1, 1, 1, 0, 0, 0],
                                                [1, 1, 0, 0, 1, 0, 0],
                                                [1, 1, 0, 0, 1, 1, 0],
                                                [1, 1, 0, 0, 1, 1, 1]]
    # the index picks, for make_batch's response tokens in order, the position that predicts each
    ids, _, mask = make_batch([[5, 6], [5, 6], [7]], [[8, 2], [9, 9, 2], [4, 2]], pad_id=0)
    targets = ids[:, 1:][mask[:, 1:]]
    assert targets.tolist() == [8, 2, 9, 9, 2, 4, 2]
    flat, firsts = p.input_ids.flatten(), {0, 2, 5}  # each row's first response token: predicted by its prompt
    for n, (i, target) in enumerate(zip(p.index.tolist(), targets.tolist())):
        assert flat[i + 1] == target if n not in firsts else flat[i] == [6, 6, 7][[0, 2, 5].index(n)]


def tile_sets(mask, tile, length):
    """A BlockMask's (partial tiles, full tiles) as dense [S, 1, T, T] booleans."""
    from torch.nn.attention.flex_attention import BlockMask

    return [BlockMask.from_kv_blocks(n, i, BLOCK_SIZE=tile, seq_lengths=(length, length)).to_dense().bool()
            for n, i in ((mask.kv_num_blocks, mask.kv_indices), (mask.full_kv_num_blocks, mask.full_kv_indices))]


def random_packing(rng, sequences, prompt_max=300, response_max=400):
    """pack_rows of `sequences` prompts of 1-prompt_max tokens, each with 1-5 responses of
    1-response_max tokens."""
    from grpo import pack_rows

    prompts, responses = [], []
    for _ in range(sequences):
        prompt = [rng.randint(3, 50) for _ in range(rng.randint(1, prompt_max))]
        for _ in range(rng.randint(1, 5)):
            prompts.append(prompt)
            responses.append([rng.randint(3, 50) for _ in range(rng.randint(1, response_max))])
    return pack_rows(prompts, responses, 0)


@pytest.mark.parametrize("seed", range(6))
def test_packed_block_mask_equals_create_block_mask_tile_for_tile(seed):
    """The block mask built from the packing's segments lists exactly the partial and the full
    tiles that torch's create_block_mask finds by evaluating `sees` on every (q, kv): random
    packings (1-3 prompts of 1-300 tokens, 1-5 responses of 1-400), both as pack_rows pads them
    ([S, Lp]) and end to end in one row (one_row, the flex layout: the sequences' boundaries fall
    inside tiles), tiles of 16-128, lengths not a multiple of the tile."""
    import random

    from torch.nn.attention.flex_attention import create_block_mask

    from grpo import one_row, packed_block_mask, segments, sees

    rng = random.Random(seed)
    p = random_packing(rng, rng.randint(1, 3))
    for block in (p.block, one_row(p.input_ids, p.block, p.position_ids, p.index)[1]):
        S, L = block.shape
        segment, prompt = segments(block)
        for tile in (16, 48, 128):
            ours = packed_block_mask(block, tile)
            dense = create_block_mask(lambda b, h, q, kv: sees(segment, prompt, b, q, kv), S, None, L, L,
                                      device="cpu", BLOCK_SIZE=tile)
            for mine, theirs in zip(tile_sets(ours, tile, L), tile_sets(dense, tile, L)):
                assert torch.equal(mine, theirs)
            # the rule itself on the partial tiles: the last position sees position 0 (row 0's
            # first prompt) unless one row holds several sequences
            last_sees_first = ours.mask_mod(0, 0, torch.tensor(L - 1), torch.tensor(0))
            assert bool(last_sees_first) == (block is p.block or p.block.shape[0] == 1)


def test_one_row_docstring_example():
    """grpo.one_row's example: sequence 0 ([7] and one response) is padded by 4 in pack_rows'
    layout; in one row sequence 1 starts at 3, so its indices move back by 4."""
    from grpo import one_row, pack_rows, segments

    p = pack_rows([[7], [5, 6], [5, 6]], [[4, 2], [8, 2], [9, 9, 2]], pad_id=0)
    assert p.index.tolist() == [0, 1, 8, 9, 8, 11, 12]
    ids, block, positions, index = one_row(p.input_ids, p.block, p.position_ids, p.index)
    assert ids.tolist() == [[7, 4, 2, 5, 6, 8, 2, 9, 9, 2]]
    assert block.tolist() == [[-1, 0, 0, -1, -1, 0, 0, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 2, 3, 4]]
    assert index.tolist() == [0, 1, 4, 5, 4, 7, 8]
    assert ids[0, index].tolist() == p.input_ids.flatten()[p.index].tolist()  # the same tokens predict
    segment, prompt = segments(block)
    assert segment.tolist() == [[0, 1, 1, 2, 2, 3, 3, 4, 4, 4]] and prompt.tolist() == [[0, 0, 0, 2, 2, 2, 2, 2, 2, 2]]
    assert segments(torch.tensor([[-1, -1, 0, 0, 1, -1, 0, 1, 1]]))[1].tolist() == [[0, 0, 0, 0, 0, 3, 3, 3, 3]]


def counted_tiles(sequences, tile):
    """(tiles some query attends, tiles every query attends all of) counted on a dense [L, L]
    rule written from the rows themselves, for sequences = [(prompt length, [response
    lengths])] end to end in one row; positions past the end attend nothing (as flex pads)."""
    owner = []  # per position: (sequence, -1 for its prompt or k for its response k)
    for s, (prompt, responses) in enumerate(sequences):
        owner += [(s, -1)] * prompt
        for k, r in enumerate(responses):
            owner += [(s, k)] * r
    L = len(owner)
    T = -(-L // tile)
    allowed = torch.zeros(T * tile, T * tile, dtype=torch.bool)
    for q in range(L):
        for kv in range(q + 1):
            allowed[q, kv] = owner[kv][0] == owner[q][0] and owner[kv][1] in (-1, owner[q][1])
    tiles = allowed.view(T, tile, T, tile).transpose(1, 2)  # [T, T, tile, tile]
    return int(tiles.any((-1, -2)).sum()), int(tiles.all(-1).all(-1).sum())


def test_one_row_block_mask_tiles_by_hand_and_by_a_dense_count():
    """One row of two sequences, tiles of 2: sequence 0 is a 3-token prompt with responses of 3
    and 2 tokens (positions 0-7), sequence 1 a 2-token prompt with one of 3 (8-12). The 7 query
    tiles {0,1} {2,3} {4,5} {6,7} {8,9} {10,11} {12} compute, below the diagonal, the full
    tiles (1,0) (2,0) (2,1) (3,0) (5,4) and the partial (3,1) (response 1 sees the prompt's 2,
    not response 0's 3) (6,4) (6,5) (the last tile is cut by the row's end): 5 full, 7 + 3
    partial; nothing across the sequences. Then random packings in one row against a dense count."""
    import random

    from grpo import one_row, pack_rows, packed_block_mask

    def counts(block, tile):
        mask = packed_block_mask(block, tile)
        full = int(mask.full_kv_num_blocks.sum())
        return int(mask.kv_num_blocks.sum()) + full, full

    p = pack_rows([[3, 4, 5]] * 2 + [[6, 7]], [[8] * 3, [9] * 2, [10] * 3], pad_id=0)
    block = one_row(p.input_ids, p.block, p.position_ids, p.index)[1]
    assert counts(block, 2) == (15, 5) == counted_tiles([(3, [3, 2]), (2, [3])], 2)
    rng = random.Random(0)
    for _ in range(4):
        sequences = [(rng.randint(1, 40), [rng.randint(1, 50) for _ in range(rng.randint(1, 4))])
                     for _ in range(rng.randint(2, 4))]
        prompts = [[3 + s] * n for s, (n, rs) in enumerate(sequences) for _ in rs]
        responses = [[9] * r for _, rs in sequences for r in rs]
        p = pack_rows(prompts, responses, 0)
        block = one_row(p.input_ids, p.block, p.position_ids, p.index)[1]
        for tile in (8, 16):
            assert counts(block, tile) == counted_tiles(sequences, tile)


def test_packed_block_mask_at_32k_tokens_allocates_no_square():
    """One packed group of 32,768 tokens (a 512-token prompt and 6 responses of 5,376): the mask is
    built in a fresh process with a peak RSS rise of a few MB (measured 9.4 MB here); one dense
    [L, L] boolean alone would be 1,024 MB, and create_block_mask raised it by 10.4 GB. Then the
    review's CRM micro-batch (N5) in one row (one_row: 10 sequences, 69,336 tokens; a dense
    boolean: 4.8 GB) in the same process: a peak rise of 27 MB in all here (its [542, 542] tile
    tables and their sorts)."""
    code = """
import resource, torch
from grpo import one_row, pack_rows, packed_block_mask
block = pack_rows([list(range(3, 515))] * 6, [[7] * 5376] * 6, 0).block
crm = pack_rows([[5] * 300] * 4 + [[6] * 300] * 4 + [[7 + i] * 400 for i in range(8)], [[9] * 4096] * 16, 0)
row = one_row(crm.input_ids, crm.block, crm.position_ids, crm.index)[1]
import torch.nn.attention.flex_attention
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mask = packed_block_mask(block)
print(block.shape[1], (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, mask.kv_num_blocks.shape[-1])
mask = packed_block_mask(row)
print(row.shape[1], (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, mask.kv_num_blocks.shape[-1])
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (length, rise_mb, tiles), (row_length, row_rise_mb, row_tiles) = (line.split() for line in out.stdout.splitlines())
    assert int(length) == 32768 and int(tiles) == 256
    assert float(rise_mb) < 64, rise_mb
    assert int(row_length) == 69336 and int(row_tiles) == 542
    assert float(row_rise_mb) < 64, row_rise_mb


# ----------------------------------------------------------------------------- the step loss (policy_loss)


def loss_inputs():
    """Two rows, three response positions (row 1 has two tokens). Row 0 is templated and CRM
    masks its middle token; row 1 was sampled by the engine with log pi_old - log pi_sampler =
    [log 1.5, log 3] (a distilled row has no engine log-probs under x)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    crm = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    sampler_mask = torch.tensor([[False, False, False], [True, True, False]])
    sampler = torch.zeros(2, 3, dtype=torch.float64)
    sampler[1, :2] = logp.detach()[1, :2] - torch.tensor([math.log(1.5), math.log(3.0)], dtype=torch.float64)
    return logp, mask, torch.tensor([1.0, -2.0], dtype=torch.float64), crm, sampler, sampler_mask


def test_step_denominators_and_the_kept_rule():
    assert step_denominators(66, 12) == Denominators(66, 12, 66)
    assert step_denominators(66, 12, 30, 23.0, "kept") == Denominators(66, 12, 59.0)  # 66 - 30 + 23
    assert step_denominators(66, 12, 30, 23.0, "all").pg == 66  # masked tokens still count (reference code)
    assert step_denominators(0, 0).pg > 0  # an empty step divides by a tiny number, never by 0
    with pytest.raises(ValueError, match="crm_denominator"):
        step_denominators(1, 1, crm_denominator="some")


def test_policy_loss_crm_times_tis_by_hand():
    """rho = 1 (one update per batch): l_t = -A w_t with w = CRM x min(pi_old / pi_sampler, 2).
    Row 0: -1 (1 + 0 + 1) = -2; row 1: +2 (1.5 + 2) = 7; over D = 5 tokens: 1.0. The gradient
    of a token is -A w_t / D; the masked token and the padding get none."""
    logp, mask, adv, crm, sampler, sampler_mask = loss_inputs()
    d = step_denominators(5, 2)
    loss, sums = policy_loss(logp, None, adv, mask, d, crm_weight=crm, sampler_logp=sampler,
                             sampler_mask=sampler_mask, tis_cap=2.0)
    assert loss.item() == pytest.approx(1.0)
    loss.backward()
    want = torch.tensor([[-1 / 5, 0.0, -1 / 5], [2 * 1.5 / 5, 2 * 2.0 / 5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, want)
    assert sums["mismatch_tokens"] == 2 and sums["clipped_tokens"] == 0
    assert sums["mismatch_abs_sum"] == pytest.approx(math.log(1.5) + math.log(3.0))
    assert sums["mismatch_abs_max"] == pytest.approx(math.log(3.0)) and "kl_sum" not in sums
    # kept: D = 5 - 3 templated tokens + their weight 2 = 4; without TIS row 1 weighs 1 + 1
    kept = step_denominators(5, 2, 3, 2.0, "kept")
    loss, _ = policy_loss(logp, None, adv, mask, kept, crm_weight=crm, sampler_logp=sampler, sampler_mask=sampler_mask)
    assert loss.item() == pytest.approx((-2 + 4) / 4)


def test_kl_term_is_not_weighted_and_divides_by_the_token_count():
    """k3 with ref = logp + log 2 is 2 - log 2 - 1 on each of the 5 tokens. train.py's KL term
    (AuxTerm 'kl') aggregates it unweighted over its own denominator, the 5 tokens, not the CRM's
    kept mass (4 here): + 0.5 x 5 (1 - log 2) / 5; the policy term is the same with or without it."""
    logp, mask, adv, crm, sampler, sampler_mask = loss_inputs()
    ref = logp.detach() + math.log(2.0)
    kept = step_denominators(5, 2, 3, 2.0, "kept")
    kl = k3_kl(logp, ref)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert kl[mask].tolist() == pytest.approx([k3] * 5)
    term = 0.5 * aggregate(kl, mask.double(), "token-mean", kept.tokens, kept.rows)
    assert term.item() == pytest.approx(0.5 * k3)
    assert "kl_sum" not in policy_loss(logp, None, adv, mask, kept, crm_weight=crm)[1]


def test_policy_loss_clips_before_weighting():
    """With pi_old given, rho = 1.5 on every token and eps 0.2: A > 0 takes the clipped 1.2 (no
    gradient), A < 0 the unclipped 1.5; then the weight multiplies. Row 0: -1 x 1.2 x (1 + 0 + 1);
    row 1: +2 x 1.5 x (1 + 1); over 5 tokens."""
    logp, mask, adv, crm, _, _ = loss_inputs()
    old = logp.detach() - math.log(1.5)
    loss, sums = policy_loss(logp, old, adv, mask, step_denominators(5, 2), crm_weight=crm)
    assert loss.item() == pytest.approx((-1.2 * 2 + 2 * 1.5 * 2) / 5)
    assert sums["clipped_tokens"] == 3  # row 0's three tokens
    loss.backward()
    assert (logp.grad[0] == 0).all() and logp.grad[1, 0].item() == pytest.approx(2 * 1.5 / 5)


def test_scatter_rows_docstring_example():
    mask = torch.tensor([[False, True, True], [True, True, False]])
    values, known = scatter_rows([[-0.5, -0.25], None], mask)
    assert values.tolist() == [[0.0, -0.5, -0.25], [0.0, 0.0, 0.0]]
    assert known.tolist() == [[False, True, True], [False, False, False]]
    assert scatter_rows([None, [2.0, 3.0]], mask, fill=1.0)[0].tolist() == [[1, 1, 1], [2, 3, 1]]
    with pytest.raises(ValueError, match="row 0: 2 response positions, 3 values"):
        scatter_rows([[1.0, 2.0, 3.0], None], mask)
