"""GRPO math in plain PyTorch: tensors in, tensors out, no state (docs/METHOD.md §3).

Shapes: G groups (prompts) of K rollouts; B = G·K rows; T = response positions of a batch.

    rewards = [[1., 0., 0., 1.]]                         # [G=1, K=4]
    group_advantages(rewards)  -> [[0.866, -0.866, -0.866, 0.866]]   # (r - mean) / (std + 1e-6)

Standard deviation convention: UNBIASED (divide by K - 1), as torch.std and the verl/TRL GRPO
implementations; pinned by tests/test_grpo.py. An all-equal group gets advantage 0 everywhere.

Loss of one optimizer step (PPO-clip, per token t of row i, advantage A_i):
    rho_t  = exp(clamp(logp_new - logp_old, -20, 20))
    l_t    = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high))       (eps_high = 0.28: DAPO clip-higher)
    dual clip (A < 0 only, c > 1): l_t = min(l_t, -A c)
    + beta * k3(logp_new, logp_ref)                                         (beta = 0 by default)
Aggregation over the WHOLE step (all gradient-accumulation micro-batches together):
    token-mean               sum_i,t w l / N_tokens(step)                  (DAPO, P²O; default)
    seq-mean-token-mean      mean_i [ sum_t w l / n_tokens(i) ]           (original GRPO)
    seq-mean-token-sum-norm  sum_i,t w l / (N_rows(step) * L_max)          (Dr. GRPO)
`w` is an optional per-token weight (the P²O Context Ratio Mask plugs in here); the
denominators count the valid tokens whatever their weight.

With one update per rollout batch the old policy IS the current one: rho = 1 at evaluation, the
loss value is -mean(A) (about 0), and its gradient is exactly the policy gradient
-mean(A grad logp). A loss of ~0 is expected, not a bug.
"""

from dataclasses import dataclass

import torch

LOG_RATIO_CLAMP = 20.0
KL_CLAMP = 10.0


def group_advantages(rewards, norm="group", eps=1e-6):
    """[G, K] rewards -> [G, K] advantages. norm: 'group' (GRPO) or 'none' (Dr. GRPO: r - mean)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if norm == "none":
        return centred
    if norm != "group":
        raise ValueError(f"adv_norm must be 'group' or 'none', got {norm!r}")
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)  # one rollout: no group statistics, no signal
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)


def token_logprobs(logits, tokens, temperature=1.0):
    """log softmax(logits / T) at the given tokens. logits [B, T, V] predict tokens [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, T, V]
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]


def entropy(logits, temperature=1.0):
    """Entropy of the sampling distribution softmax(logits / T) per position: [B, T, V] -> [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def k3_kl(logp, ref_logp):
    """k3 estimator of KL(pi || ref) per token: exp(d) - d - 1 with d = ref - logp; >= 0, 0 iff equal."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (d.exp() - d - 1).clamp(max=KL_CLAMP)


def ppo_clip_token_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2, dual_clip=0.0):
    """Per-token PPO-clip loss and where the clip was active.
    logp, old_logp [B, T]; advantages [B] -> (loss [B, T], clipped [B, T] bool)."""
    adv = advantages.unsqueeze(1)  # [B, 1]
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip > 0:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or 0 = off), got {dual_clip}")
        cap = -adv * dual_clip  # only binds where A < 0
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(capped, cap.expand_as(loss), loss)
        was_clipped = was_clipped | capped
    return loss, was_clipped


def aggregate(token_loss, mask, mode, step_tokens, step_rows, max_len=None, weight=None):
    """Sum this micro-batch's share of the step loss. Summing the returned values over all
    micro-batches of a step gives the step loss, whatever the micro-batch split.
    token_loss, mask, weight [B, T]; step_tokens / step_rows: valid tokens / rows in the WHOLE step."""
    w = mask if weight is None else mask * weight
    if mode == "token-mean":
        return (token_loss * w).sum() / step_tokens
    if mode == "seq-mean-token-mean":
        per_row = (token_loss * w).sum(1) / mask.sum(1).clamp(min=1)  # [B]
        return per_row.sum() / step_rows
    if mode == "seq-mean-token-sum-norm":
        if not max_len:
            raise ValueError("seq-mean-token-sum-norm needs max_len (the generation length cap)")
        return (token_loss * w).sum() / (step_rows * max_len)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def make_batch(prompts, responses, pad_id):
    """Right-padded rows [prompt + response] and the mask of response tokens (EOS included:
    the mask comes from lengths, never from comparing with pad_id, which may equal EOS).

    make_batch([[5, 6], [7]], [[8, 2], [9, 9, 9, 2]], pad_id=2) ->
        input_ids     [[5, 6, 8, 2, 2],      attention [[1, 1, 1, 1, 0],
                       [7, 9, 9, 9, 2]]                 [1, 1, 1, 1, 1]]
        response_mask [[0, 0, 1, 1, 0],
                       [0, 1, 1, 1, 1]]
    Token j is predicted by the logits at position j - 1, so the loss uses
    targets = input_ids[:, 1:] and loss_mask = response_mask[:, 1:].
    """
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, L]
    attention = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, L]
    response_mask = torch.zeros((len(prompts), width), dtype=torch.bool)  # [B, L]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        input_ids[i, :n] = torch.tensor(p + r)
        attention[i, :n] = 1
        response_mask[i, len(p):n] = True
    return input_ids, attention, response_mask


@dataclass
class Packed:
    """Rows that share a prompt, packed as one sequence: the prompt once, then each response."""
    input_ids: torch.Tensor  # [S, Lp] one sequence per distinct prompt, right-padded
    attention: torch.Tensor  # [S, 1, Lp, Lp] bool: query i sees key j (a 4D mask, used as is)
    position_ids: torch.Tensor  # [S, Lp] every response continues its prompt's positions
    index: torch.Tensor  # [N] flat positions in [S * Lp] that predict the rows' response tokens

    def to(self, device):
        return Packed(*(t.to(device) for t in (self.input_ids, self.attention, self.position_ids, self.index)))


def pack_rows(prompts, responses, pad_id):
    """The rows of make_batch(prompts, responses) with each distinct prompt forwarded once.

    Rows with the same prompt become one sequence [prompt, response_1, response_2, ...]. A
    response token attends to the prompt and to the earlier tokens of its own response only,
    and takes the positions it has in its own row, so every token is computed exactly as in its
    own row. `index` lists, for the N response tokens in make_batch's order (row by row, i.e.
    the order of response_mask[:, 1:].nonzero()), the packed position whose hidden state
    predicts it: the prompt's last position for a first token (shared by the responses), else
    the previous token of the same response.

    pack_rows([[5, 6], [5, 6], [7]], [[8, 2], [9, 9, 2], [4, 2]], pad_id=0) ->
        input_ids [[5, 6, 8, 2, 9, 9, 2],        position_ids [[0, 1, 2, 3, 2, 3, 4],
                   [7, 4, 2, 0, 0, 0, 0]]                      [0, 1, 2, 0, 0, 0, 0]]
        index     [1, 2, 1, 4, 5, 7, 8]    (row 0: 1, 2; row 1: 1, 4, 5; row 2: 7 + 0, 7 + 1)
    """
    segments = {}  # prompt -> row indices, in first-seen order
    for i, p in enumerate(prompts):
        segments.setdefault(tuple(p), []).append(i)
    width = max(len(p) + sum(len(responses[i]) for i in rows) for p, rows in segments.items())
    S = len(segments)
    input_ids = torch.full((S, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((S, width), dtype=torch.long)
    block = torch.full((S, width), -1, dtype=torch.long)  # -1: prompt (seen by all), k: response k, -2: padding
    predictor = [None] * len(prompts)
    for s, (p, rows) in enumerate(segments.items()):
        n = len(p)
        input_ids[s, :n] = torch.tensor(p)
        position_ids[s, :n] = torch.arange(n)
        offset = n
        for k, i in enumerate(rows):
            r = len(responses[i])
            input_ids[s, offset:offset + r] = torch.tensor(responses[i])
            position_ids[s, offset:offset + r] = torch.arange(n, n + r)
            block[s, offset:offset + r] = k
            predictor[i] = [s * width + n - 1] + [s * width + offset + j for j in range(r - 1)]
            offset += r
        block[s, offset:] = -2
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # [Lp, Lp]
    q, kv = block.unsqueeze(2), block.unsqueeze(1)  # [S, Lp, 1], [S, 1, Lp]
    # padding attends like a response of its own (a query must see at least one key)
    attention = causal & ((kv == -1) | (q == kv))  # [S, Lp, Lp]
    index = torch.tensor([j for i in range(len(prompts)) for j in predictor[i]], dtype=torch.long)
    return Packed(input_ids, attention.unsqueeze(1), position_ids, index)
