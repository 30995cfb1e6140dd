"""Context distillation and the Context Ratio Mask (SPEC §5).

A rollout y~ was sampled under the templated prompt x~ = T(x, z). P²O trains on it under the
ORIGINAL prompt x: the row keeps y~'s token ids unchanged and swaps in x's prompt ids, so the
skill the template unlocked moves into the weights and no template is needed at inference.

    row = distill_row(original_prompt_ids=[1, 9, 9], sample)   # sample.prompt_ids were x~'s
    row -> ([1, 9, 9], sample.response_ids)

Context Ratio Mask: with the pre-update weights, per response token
    c_t = pi_old(y_t | x, y<t) / pi_old(y_t | x~, y<t)
Tokens with c_t outside [crm_low, crm_high] (default [0.01, 10], inclusive) get weight 0 in the
policy loss: they are tokens the template made far more (or less) likely than the plain prompt
would, i.e. where distillation would push hardest on a context the model will not see. The soft
variant scales them by bound / c_t instead. Plain rows have weight 1. Whether masked tokens still
count in the token-mean denominator is train.py's `crm_denominator` (reference code: they do).
"""

import math

import torch


def distill_row(original_prompt_ids, sample):
    """(prompt ids of x, response ids of y~): the training row of a templated rollout."""
    return list(original_prompt_ids), list(sample.response_ids)


def crm_weights(logp_plain, logp_templated, low=0.01, high=10.0, soft=False):
    """Per-token loss weights from old log-probs under x and under x~ (same shape, e.g. [N]).
    Returns (weights, log_c). Hard: 1 inside [low, high], else 0. Soft: clip(c, low, high) / c."""
    log_c = logp_plain - logp_templated
    lo, hi = math.log(low), math.log(high)
    inside = (log_c >= lo) & (log_c <= hi)
    if not soft:
        return inside.to(logp_plain.dtype), log_c
    clipped = log_c.clamp(lo, hi)
    return torch.exp(clipped - log_c), log_c  # = clip(c) / c: 1 inside, bound / c outside


def crm_stats(weights, log_c, templated):
    """Fraction of templated tokens masked (weight < 1) and their mean log c_t.
    weights, log_c [N]; templated [N] bool (the token belongs to a templated row)."""
    n = int(templated.sum())
    if n == 0:
        return {"crm_masked_fraction": 0.0, "crm_mean_log_ratio": 0.0, "templated_tokens": 0}
    return {"crm_masked_fraction": (weights[templated] < 1).float().mean().item(),
            "crm_mean_log_ratio": log_c[templated].mean().item(), "templated_tokens": n}
