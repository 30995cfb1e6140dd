"""Context distillation and the Context Ratio Mask (docs/METHOD.md §4).

A rollout y~ was sampled under the templated prompt x~ = T(x, z). P²O trains on it under the
ORIGINAL prompt x: the row keeps y~'s token ids unchanged and swaps in x's prompt ids, so the
skill the template unlocked moves into the weights and no template is needed at inference.

    row = distill_row(original_prompt_ids=[1, 9, 9], sample)   # sample.prompt_ids were x~'s
    row -> ([1, 9, 9], sample.response_ids)

Context Ratio Mask: with the pre-update weights, per response token
    c_t = pi_old(y_t | x, y<t) / pi_old(y_t | x~, y<t)
Tokens with c_t outside [crm_low, crm_high] (default [0.01, 10], inclusive) get weight 0 in the
policy-gradient term: they are tokens the template made far more (or less) likely than the plain
prompt would, i.e. where distillation would push hardest on a context the model will not see.
Plain rows have weight 1. The weight multiplies the policy-gradient term only, never the KL term
(as in the reference code). Whether masked tokens still count in the token-mean denominator is
train.py's `crm_denominator` (reference code: they do).

Soft variant (`soft=True`), our choice: an out-of-band token is scaled by how far log c_t lies
outside the band, w = exp(-dist(log c_t, [log low, log high])), i.e. high / c_t above the band
and c_t / low below it; always in (0, 1]. The reference code scales by bound / c_t on both sides,
which gives a token below the band a weight up to ~1/c_t (e.g. 200x at c_t = 5e-5): an
up-weighting of exactly the tokens the mask exists to distrust.
"""

import math
from dataclasses import dataclass

import torch


def distill_row(original_prompt_ids, sample):
    """(prompt ids of x, response ids of y~): the training row of a templated rollout."""
    return list(original_prompt_ids), list(sample.response_ids)


def crm_weights(logp_plain, logp_templated, low=0.01, high=10.0, soft=False):
    """Per-token loss weights from old log-probs under x and under x~ (same shape, e.g. [N]).
    Returns (weights, log_c). Hard: 1 inside [low, high], else 0. Soft: high / c above the band,
    c / low below it (1 inside)."""
    log_c = logp_plain - logp_templated
    lo, hi = math.log(low), math.log(high)
    if not soft:
        inside = (log_c >= lo) & (log_c <= hi)
        return inside.to(logp_plain.dtype), log_c
    outside_by = (log_c - log_c.clamp(lo, hi)).abs()  # 0 inside the band
    return torch.exp(-outside_by), log_c


@dataclass
class CrmSums:
    """Sums over the templated tokens of a step (logged as fractions and means at the end)."""
    templated_tokens: int = 0
    out_of_band_tokens: int = 0  # c_t outside [low, high]: weight 0 (hard) or < 1 (soft)
    weight_sum: float = 0.0  # sum of the weights of templated tokens
    log_ratio_sum: float = 0.0  # sum of log c_t

    def __add__(self, other):
        return CrmSums(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))


def crm_token_weights(loss_mask, plain_logp, tilde_logp, low=0.01, high=10.0, soft=False):
    """The CRM weights of one padded micro-batch, and their sums.

    loss_mask [B, T] bool marks the positions that predict response tokens. plain_logp and
    tilde_logp hold one entry per row: None for a row without a template (weight 1), else the
    [n_b] old log-probs of row b's n_b response tokens, in order, under x and under x~.
    Returns (weights [B, T], CrmSums); positions off the mask get weight 1 (the mask zeroes them).

        loss_mask  = [[T, T, F],             plain_logp = [None, tensor([-0.5, -0.5, -0.5])]
                      [T, T, T]]             tilde_logp = [None, tensor([-0.5, -9.0, -0.6])]
        log c (row 1) = [0.0, 8.5, 0.1] -> c = [1.0, 4915, 1.1]; 4915 > 10 is out of band
        weights    = [[1., 1., 1.],
                      [1., 0., 1.]]
        CrmSums(templated_tokens=3, out_of_band_tokens=1, weight_sum=2.0, log_ratio_sum=8.6)
    """
    weights = torch.ones(loss_mask.shape, dtype=torch.float32, device=loss_mask.device)  # [B, T]
    sums = CrmSums()
    for b, (plain, tilde) in enumerate(zip(plain_logp, tilde_logp)):
        if plain is None:
            continue
        positions = loss_mask[b].nonzero().squeeze(1)  # [n_b]
        if len(positions) != len(plain) or len(plain) != len(tilde):
            raise ValueError(f"row {b}: {len(positions)} response positions, {len(plain)} plain and "
                             f"{len(tilde)} templated log-probs")
        w, log_c = crm_weights(plain.float(), tilde.float(), low, high, soft)  # [n_b]
        weights[b, positions] = w.to(weights.device)
        sums += CrmSums(len(w), int(((log_c < math.log(low)) | (log_c > math.log(high))).sum()),
                        w.sum().item(), log_c.sum().item())
    return weights, sums
