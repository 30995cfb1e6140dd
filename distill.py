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
(as in the reference code; grpo.policy_loss). Whether masked tokens still count in the token-mean
denominator is `crm_denominator` (grpo.step_denominators; reference code: they do).

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


def row_crm_weights(plain_logp, tilde_logp, low=0.01, high=10.0, soft=False):
    """One templated row's CRM weights [n] from its n response tokens' old log-probs under x
    and under x~, and their sums.

        plain_logp = tensor([-0.5, -0.5, -0.5]);  tilde_logp = tensor([-0.5, -9.0, -0.6])
        log c = [0.0, 8.5, 0.1] -> c = [1.0, 4915, 1.1]; 4915 > 10 is out of band
        -> (tensor([1., 0., 1.]), CrmSums(templated_tokens=3, out_of_band_tokens=1, weight_sum=2.0, log_ratio_sum=8.6))
    """
    if len(plain_logp) != len(tilde_logp):
        raise ValueError(f"{len(plain_logp)} plain and {len(tilde_logp)} templated log-probs")
    w, log_c = crm_weights(plain_logp.float(), tilde_logp.float(), low, high, soft)  # [n]
    out_of_band = int(((log_c < math.log(low)) | (log_c > math.log(high))).sum())
    return w, CrmSums(len(w), out_of_band, w.sum().item(), log_c.sum().item())


def crm_rows(plain, tilde, low=0.01, high=10.0, soft=False):
    """The CRM weights of a step's rows from their pre-update log-probs under x and under x~
    (forward.two_context_logprobs; None for a row without a template) -> (weights, sums):
    weights[i] row i's [n_i] tensor (None for a plain row), the CrmSums of every templated row
    given. Pass all the step's rows, also those of groups that will not be forwarded (the kept
    denominator and the logged masked fraction count them)."""
    weights, sums = [None] * len(plain), CrmSums()
    for i, (p, t) in enumerate(zip(plain, tilde)):
        if t is not None:
            weights[i], row_sums = row_crm_weights(p, t, low, high, soft)
            sums += row_sums
    return weights, sums
