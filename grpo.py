"""GRPO math in plain PyTorch: tensors in, tensors out, no state (docs/METHOD.md §3).

Shapes: G groups (prompts) of K rollouts; B = G·K rows; T = response positions of a batch.

    rewards = [[1., 0., 0., 1.]]                         # [G=1, K=4]
    group_advantages(rewards)  -> [[0.866, -0.866, -0.866, 0.866]]   # (r - mean) / (std + 1e-6)

Standard deviation convention: UNBIASED (divide by K - 1), as torch.std and the verl/TRL GRPO
implementations; pinned by tests/test_grpo.py. An all-equal group gets advantage 0 everywhere.

Loss of one optimizer step (`policy_loss`, per token t of row i, advantage A = A_i + b_it: the row's
group advantage plus a method's per-token term, train.token_advantages, 0 by default):
    rho_t  = exp(clamp(logp_new - logp_old, -20, 20))
    l_t    = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high))       (eps_high = 0.28: DAPO clip-higher)
    dual clip (A < 0 only, c > 1): l_t = min(l_t, -A c)
    w_t    = crm_t * min(exp(logp_old - logp_sampler), C)                     (CRM weight x TIS; 1 when off)
    loss   = agg(w l) + beta * agg(k3(logp_new, logp_ref))                   (beta = 0 by default; the KL
             term is one of train.py's auxiliary terms: its own denominator, never weighted)
Aggregation over the WHOLE step (all gradient-accumulation micro-batches together):
    token-mean               sum_i,t w l / D                               (DAPO, P²O; default)
    seq-mean-token-mean      mean_i [ sum_t w l / n_tokens(i) ]           (original GRPO)
    seq-mean-token-sum-norm  sum_i,t w l / (N_rows(step) * L_max)          (Dr. GRPO)
D counts the step's response tokens whatever their weight (the reference code), or, with
crm_denominator=kept, their CRM weight mass (`step_denominators`). The KL term is never
weighted and always divides by the token count.

With one update per rollout batch the old policy IS the current one: rho = 1 at evaluation, the
loss value is -mean(A) (about 0), and its gradient is exactly the policy gradient
-mean(A grad logp). A loss of ~0 is expected, not a bug.
"""

import math
from dataclasses import dataclass

import torch

LOG_RATIO_CLAMP = 20.0
KL_CLAMP = 10.0


def group_advantages(rewards, norm="group", eps=1e-6):
    """[G, K] rewards -> [G, K] advantages. norm: 'group' (GRPO), 'none' (Dr. GRPO: r - mean) or
    'raw' (A = r, no baseline: with 0/1 rewards, maximum likelihood on the correct rollouts)."""
    if norm == "raw":
        return rewards.clone()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if norm == "none":
        return centred
    if norm != "group":
        raise ValueError(f"adv_norm must be 'group', 'none' or 'raw', got {norm!r}")
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


class _HeadLogprobs(torch.autograd.Function):
    """log p(target) and entropy at the LM head, `chunk` tokens at a time. Forward keeps only
    each token's log-sum-exp; backward recomputes a chunk's logits and forms
    d logp / d z = (onehot(target) - softmax(z)) / T there, so no [N, V] tensor ever exists."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, dtype, with_entropy):
        out = torch.promote_types(dtype, torch.float32)  # fp32 under bf16 autocast, fp64 stays fp64
        logp = hidden.new_empty(len(targets), dtype=out)  # [N]
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        w = weight.to(dtype)
        for s in range(0, len(targets), chunk):
            z = (hidden[s:s + chunk].to(dtype) @ w.T).to(out).div_(temperature)  # [c, V]
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            logp[s:s + chunk] = z.gather(1, targets[s:s + chunk, None]).squeeze(1) - lse[s:s + chunk]
            if with_entropy:  # H = lse - sum_v p_v z_v, the sum as a batched dot (no [c, V] product)
                ent[s:s + chunk] = lse[s:s + chunk] - (torch.softmax(z, -1).unsqueeze(1) @ z.unsqueeze(2)).view(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, targets, lse = ctx.saved_tensors
        T, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        w = weight.to(dtype)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_weight else None
        for s in range(0, len(targets), chunk):
            h = hidden[s:s + chunk].to(dtype)
            dz = (h @ w.T).to(lse.dtype).div_(T)  # [c, V] the logits, recomputed; then in place:
            dz.sub_(lse[s:s + chunk, None]).exp_()  # softmax
            g = grad_logp[s:s + chunk, None]  # [c, 1]
            dz.mul_(-g).scatter_add_(1, targets[s:s + chunk, None], g)  # d logp / d z = onehot - softmax
            dlogits = dz.div_(T).to(dtype)  # [c, V]
            if need_hidden:
                grad_hidden[s:s + chunk] = (dlogits @ w).to(hidden.dtype)
            if need_weight:  # fp32 (fp64) sum over chunks
                grad_weight += (dlogits.T @ h).to(grad_weight.dtype)
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        return grad_hidden, grad_weight, None, None, None, None, None


def head_logprobs(hidden, weight, targets, temperature=1.0, chunk=1024, with_entropy=False):
    """Log-probs of `targets` under softmax(hidden @ weight.T / T) and (with_entropy, no gradient)
    the entropy, without the [N, V] logits: `chunk` tokens at a time, recomputed in backward.
    hidden [N, H], weight [V, H] (the LM head, no bias), targets [N] -> (logp [N], entropy [N] or
    None), fp32 (fp64 for fp64 inputs). Under autocast the head's matmuls run in the autocast
    dtype, as an autocast nn.Linear would. The same numbers as token_logprobs(hidden @ weight.T)
    and entropy(...) (tests/test_grpo.py, float64), with the memory of one chunk's logits."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    with torch.autocast(device, enabled=False):
        logp, ent = _HeadLogprobs.apply(hidden, weight, targets, float(temperature), max(int(chunk), 1), dtype,
                                        with_entropy)
    return logp, (ent if with_entropy else None)


def k3_kl(logp, ref_logp):
    """k3 estimator of KL(pi || ref) per token: exp(d) - d - 1 with d = ref - logp; >= 0, 0 iff equal."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (d.exp() - d - 1).clamp(max=KL_CLAMP)


def clipped_surrogate(ratio, adv, eps_low, eps_high):
    """PPO's pessimistic surrogate of a ratio: (max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), where the clip won)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def per_token(advantages):
    """Advantages [B] (one per row) or [B, T] (per token) -> a tensor that broadcasts against [B, T]."""
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


def ppo_clip_token_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2, dual_clip=0.0):
    """Per-token PPO-clip loss and where the clip was active. logp, old_logp [B, T]; advantages [B]
    (one per row) or [B, T] (per token: a row's A plus a method's per-token term) -> (loss [B, T],
    clipped [B, T] bool)."""
    adv = per_token(advantages)  # [B, 1] or [B, T]
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]
    loss, was_clipped = clipped_surrogate(ratio, adv, eps_low, eps_high)
    if dual_clip > 0:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or 0 = off), got {dual_clip}")
        cap = -adv * dual_clip  # only binds where A < 0
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(capped, cap.expand_as(loss), loss)
        was_clipped = was_clipped | capped
    return loss, was_clipped


# ---------------------------------------------------------------- the policy objectives (--policy_loss)
# Each: (logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip) -> (loss [B, T], clipped [B, T] bool),
# a token loss that policy_loss weights (CRM, sampler correction) and aggregates like any other. A new
# objective of this kind is one function and one entry in POLICY_LOSSES (docs/METHOD.md §3).


def ppo_loss(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip):
    """GRPO / DAPO: the token ratio, PPO-clipped per token (ppo_clip_token_loss)."""
    return ppo_clip_token_loss(logp, old_logp, advantages, eps_low, eps_high, dual_clip)


def sequence_log_ratio(logp, old_logp, mask):
    """[B, 1]: the mean over each row's masked tokens of log pi/pi_old (0 for a row with none)."""
    m = mask.to(logp.dtype)
    return ((logp - old_logp) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)


def gspo_loss(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip):
    """GSPO (Zheng et al. 2025): one ratio a response, s_i = exp(mean_t log pi/pi_old), clipped per
    response; each token carries its response's loss, so seq-mean-token-mean gives mean_i of it. The
    gradient of s_i runs through every token of the response."""
    adv = per_token(advantages)
    s = torch.exp(sequence_log_ratio(logp, old_logp, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, 1]
    return clipped_surrogate(s.expand_as(logp), adv, eps_low, eps_high)


def gspo_token_loss(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip):
    """GSPO-token: s_it = sg[s_i] pi(y_t) / sg[pi(y_t)], the value of s_i with each token's own gradient
    path; with one advantage a response it equals GSPO in value and gradient. Written as PPO-clip with
    the old log-prob moved to logp - log s_i (detached), so that exp(logp - old) = s_i exp(logp - sg logp)."""
    shifted_old = logp.detach() - sequence_log_ratio(logp.detach(), old_logp, mask)
    return ppo_clip_token_loss(logp, shifted_old, advantages, eps_low, eps_high, 0.0)


def cispo_loss(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip):
    """CISPO (MiniMax-M1, Chen et al. 2025): -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A log pi_t. The clipped
    weight is a coefficient, so a token beyond the clip keeps its gradient (bounded), unlike PPO's."""
    adv = per_token(advantages)
    ratio = torch.exp((logp - old_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -adv * weight * logp, weight != ratio


POLICY_LOSSES = {"ppo": ppo_loss, "gspo": gspo_loss, "gspo_token": gspo_token_loss, "cispo": cispo_loss}
SEQUENCE_RATIO = ("gspo",)  # objectives whose gradient runs through a whole response's ratio (no token weights)


# ---------------------------------------------------------------- engine/trainer mismatch (--sampler_correction)
# Each: (d = log pi_old - log pi_sampler [B, T], known [B, T] bool, band) -> (weight [B, T], touched [B, T] bool).
# The weight multiplies the policy term's tokens (1 where the engine's log-prob is unknown); `touched`: where
# it is not 1. Sequence forms give every token of a response its response's weight.


def token_tis(d, known, band):
    """Truncated importance sampling per token: min(pi_old / pi_sampler, C)."""
    r = d.exp()
    return torch.where(known, r.clamp(max=band[0]), 1.0), known & (r > band[0])


def token_mask(d, known, band):
    """Token masking: drop a token whose pi_old / pi_sampler leaves [lo, hi] (weight 0), keep the others (1)."""
    r = d.exp()
    out = known & ((r < band[0]) | (r > band[1]))
    return (~out).to(d.dtype), out


def icepop(d, known, band):
    """IcePop (Ring-1T): the ratio pi_old / pi_sampler as the weight inside [lo, hi], 0 outside."""
    r = d.exp()
    out = known & ((r < band[0]) | (r > band[1]))
    return torch.where(out, 0.0, torch.where(known, r, 1.0)), out


def _per_response(d, known, mean):
    """[B, 1]: the log of the product (mean=False) or geometric mean (True) of each response's known token ratios."""
    k = known.to(d.dtype)
    total = (d * k).sum(1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return total / k.sum(1, keepdim=True).clamp(min=1) if mean else total


def seq_tis(d, known, band):
    """Sequence truncation: each response weighted min(prod_t pi_old / pi_sampler, C)."""
    r = _per_response(d, known, mean=False).exp()
    has = known.any(1, keepdim=True)
    return torch.where(has, r.clamp(max=band[0]), 1.0).expand_as(d), (has & (r > band[0])).expand_as(d)


def _sequence_mask(d, known, band, mean):
    r = _per_response(d, known, mean).exp()
    out = known.any(1, keepdim=True) & ((r < band[0]) | (r > band[1]))
    return (~out).to(d.dtype).expand_as(d), out.expand_as(d)


def seq_mask(d, known, band):
    """Sequence masking: drop a response whose product of token ratios leaves [lo, hi]."""
    return _sequence_mask(d, known, band, mean=False)


def geo_mask(d, known, band):
    """Sequence masking on the geometric mean of the token ratios (a length-free band, e.g. [0.999, 1.001])."""
    return _sequence_mask(d, known, band, mean=True)


SAMPLER_CORRECTIONS = {  # name -> (function, the band's values, the level it acts at)
    "token_tis": (token_tis, ("C",), "token"), "token_mask": (token_mask, ("lo", "hi"), "token"),
    "icepop": (icepop, ("lo", "hi"), "token"), "seq_tis": (seq_tis, ("C",), "sequence"),
    "seq_mask": (seq_mask, ("lo", "hi"), "sequence"), "geo_mask": (geo_mask, ("lo", "hi"), "sequence"),
}


def parse_correction(text, tis_cap=0.0):
    """'token_mask:0.5,2' -> ('token_mask', (0.5, 2.0)); '' -> None, or ('token_tis', (tis_cap,)) with tis_cap > 0
    (--tis_cap=C is token_tis:C). ValueError naming what is wrong."""
    if not text:
        return ("token_tis", (tis_cap,)) if tis_cap > 0 else None
    name, _, band = text.partition(":")
    if name not in SAMPLER_CORRECTIONS:
        raise ValueError(f"the correction is one of {' | '.join(SAMPLER_CORRECTIONS)}, got {name!r}")
    keys = SAMPLER_CORRECTIONS[name][1]
    try:
        values = tuple(float(v) for v in band.split(","))
    except ValueError:
        values = ()
    if len(values) != len(keys) or not all(math.isfinite(v) and v > 0 for v in values) \
            or (len(values) == 2 and values[0] >= values[1]):
        form = "C > 0" if len(keys) == 1 else "lo,hi with 0 < lo < hi"
        raise ValueError(f"{name} takes {name}:{','.join(keys)} ({form}), got {text!r}")
    return name, values


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
    raise ValueError(f"unknown loss aggregation {mode!r} (one of {', '.join(LOSS_AGGS)})")


LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class Denominators:
    """The normalisers of one optimizer step: sums over ALL its rows (every micro-batch, every rank)."""
    tokens: float  # response tokens of the step's rows (forwarded or not)
    rows: int  # rows of the step
    pg: float  # the policy-gradient term's token-mean denominator: `tokens`, or (crm_denominator=kept) the weight mass


def step_denominators(tokens, rows, crm_templated_tokens=0, crm_weight_sum=0.0, crm_denominator="all"):
    """all: masked tokens still count (the reference code). kept: a templated token counts its CRM
    weight (0 masked, < 1 soft-masked), a plain token 1, so D = tokens - templated + sum(w).
    The CRM sums must cover EVERY templated row of the step, forwarded or not: a skipped group
    (all-zero advantages) still has its tokens in `tokens`.

        step_denominators(66, 12, crm_templated_tokens=30, crm_weight_sum=23.0, crm_denominator="kept")
        -> Denominators(tokens=66, rows=12, pg=59.0)
    """
    if crm_denominator not in ("all", "kept"):
        raise ValueError(f"crm_denominator must be 'all' or 'kept', got {crm_denominator!r}")
    kept = tokens - crm_templated_tokens + crm_weight_sum
    return Denominators(tokens, rows, max(kept if crm_denominator == "kept" else tokens, 1e-9))


def policy_loss(logp, old_logp, advantages, mask, denominators, *, eps_low=0.2, eps_high=0.2, dual_clip=0.0,
                loss_agg="token-mean", max_len=None, crm_weight=None, sampler_logp=None, sampler_mask=None,
                tis_cap=0.0, objective="ppo", correction=None):
    """One micro-batch's share of the step loss (summed over the step's micro-batches it is the
    step loss, whatever the split) and sums for the logs. All tensors [B, T]; advantages [B, T]
    or [B] (one per row).

    logp         log-probs under the weights being trained (with grad)
    old_logp     pi_old's (None: one update per batch, so rho = 1: logp.detach())
    mask         bool: positions that predict a response token
    crm_weight   Context Ratio Mask weights (1 on plain rows; None: all 1)
    objective    a key of POLICY_LOSSES: the token loss (ppo: PPO-clip; gspo, gspo_token, cispo)
    sampler_logp the rollout engine's log-probs where sampler_mask is set: the logged mismatch
                 (|log pi_old - log pi_sampler|, KL k1 and k3 of engine against trainer, both
                 perplexities) and, with `correction` = (a key of SAMPLER_CORRECTIONS, its band),
                 a weight on the policy term's tokens; tis_cap = C > 0 is ('token_tis', (C,))

    The KL term is not here: train.py adds it as an auxiliary term (train.AuxTerm "kl": kl_beta x
    aggregate(k3_kl(logp, ref_logp)) over the tokens, its own denominator, never weighted).
    Returns (loss, sums): clipped_tokens, mismatch_tokens / _seqs / _abs_sum / _abs_max / _k1_sum / _k3_sum,
    trainer_nll_sum, sampler_nll_sum, corrected_tokens, corrected_seqs.
    """
    old_logp = logp.detach() if old_logp is None else old_logp
    pg, clipped = POLICY_LOSSES[objective](logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip)
    weight = crm_weight
    sums = {"clipped_tokens": (clipped & mask).sum().item(), "mismatch_tokens": 0, "mismatch_abs_sum": 0.0,
            "mismatch_abs_max": 0.0}
    correction = correction or parse_correction("", tis_cap)
    if sampler_logp is not None:
        fix = mismatch_sums(old_logp, sampler_logp, sampler_mask, correction, sums)
        if fix is not None:  # the rollouts came from the engine, not from pi_old
            weight = fix if weight is None else weight * fix
    m = mask.to(logp.dtype)
    return aggregate(pg, m, loss_agg, denominators.pg, denominators.rows, max_len, weight), sums


def mismatch_sums(old_logp, sampler_logp, known, correction, sums):
    """The trainer-vs-engine diagnostics over the tokens whose engine log-prob is known, added to `sums`, and
    the correction's weight [B, T] (None without one). With d = log pi_old - log pi_sampler on tokens the
    engine sampled: k1 = -d and k3 = exp(d) - 1 - d estimate KL(engine || trainer); the perplexities are
    exp of the mean negative log-prob on each side."""
    d = old_logp - sampler_logp
    on = d[known]  # [n]
    k3 = on.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sums.update(mismatch_tokens=on.numel(), mismatch_seqs=known.any(1).sum().item(),
                mismatch_abs_sum=on.abs().sum().item(), mismatch_abs_max=on.abs().max().item() if on.numel() else 0.0,
                mismatch_k1_sum=-on.sum().item(), mismatch_k3_sum=(k3.exp() - 1 - k3).sum().item(),
                trainer_nll_sum=-old_logp[known].sum().item(), sampler_nll_sum=-sampler_logp[known].sum().item())
    if correction is None:
        return None
    fn = SAMPLER_CORRECTIONS[correction[0]][0]
    weight, touched = fn(d, known, correction[1])
    sums.update(corrected_tokens=(touched & known).sum().item(), corrected_seqs=(touched & known).any(1).sum().item())
    return weight


def scatter_rows(values, mask, fill=0.0):
    """Per-row 1-D values onto the response positions of a padded batch: ([B, T] float, [B, T] bool
    where a row had values). values[b] is None (left at `fill`) or holds one entry per set
    position of mask[b], in order.

        scatter_rows([[-0.5, -0.1], None], tensor([[F, T, T], [T, T, F]]))
        -> ([[0., -0.5, -0.1], [0., 0., 0.]], [[F, T, T], [F, F, F]])
    """
    out = torch.full(mask.shape, fill, dtype=torch.float32, device=mask.device)
    known = torch.zeros_like(mask)
    for b, row in enumerate(values):
        if row is None:
            continue
        positions = mask[b].nonzero().squeeze(1)  # [n_b]
        if len(positions) != len(row):
            raise ValueError(f"row {b}: {len(positions)} response positions, {len(row)} values")
        out[b, positions] = torch.as_tensor(row, dtype=torch.float32, device=mask.device)
        known[b, positions] = True
    return out, known


def mini_batch_rows(rows, n_groups, mini_batches, first=0):
    """The rows (anything with .group and .kind) of each of an update's mini-batches: runs of whole
    groups (a row's group: its group's index among the step's n_groups), and the rows of no group
    (group None: a method's own) dealt to them in turn, the first to mini-batch `first` (mod their
    number; torchrun: the loose rows of the lower ranks, so the dealing continues across ranks).
    A group outside the step's is an error.

        mini_batch_rows([r0 (group 0), r1 (group 1), r2 (group 2), a (None), b (None)], 3, 2)
        -> [[r0, r1, a], [r2, b]]
    """
    size = -(-n_groups // mini_batches)  # groups per mini-batch, rounded up
    parts, loose = [[] for _ in range(-(-n_groups // size))], first
    for r in rows:
        if r.group is None:
            parts[loose % len(parts)].append(r)
            loose += 1
        elif 0 <= r.group < n_groups:
            parts[r.group // size].append(r)
        else:
            raise ValueError(f"a {r.kind} row of group {r.group}, but the step has {n_groups} groups "
                             "(a method's row of no group has group=None)")
    return parts


def micro_chunks(rows, size, shared):
    """Training rows (anything with prompt_ids and response_ids lists) -> micro-batches of at
    most `size` rows. Unshared: sorted by length (less padding).
    Shared (pack_rows): the rows of one prompt stay together -- a group under x, or the
    rollouts of one template under x~ in the ablation -- and whole such segments fill each
    micro-batch (a segment longer than `size` is cut), similar lengths together."""
    if not shared:
        rows = sorted(rows, key=lambda r: len(r.prompt_ids) + len(r.response_ids))
        return [rows[i:i + size] for i in range(0, len(rows), size)]
    segments = {}
    for r in rows:
        segments.setdefault(tuple(r.prompt_ids), []).append(r)
    pieces = [seg[i:i + size] for seg in segments.values() for i in range(0, len(seg), size)]
    pieces.sort(key=lambda piece: len(piece[0].prompt_ids) + sum(len(r.response_ids) for r in piece))
    chunks = []
    for piece in pieces:
        if chunks and len(chunks[-1]) + len(piece) <= size:
            chunks[-1] = chunks[-1] + piece
        else:
            chunks.append(piece)
    return chunks


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
    block: torch.Tensor  # [S, Lp] -1: the prompt (seen by every response), k: response k, -2: padding
    position_ids: torch.Tensor  # [S, Lp] every response continues its prompt's positions
    index: torch.Tensor  # [N] flat positions in [S * Lp] that predict the rows' response tokens

    def to(self, device):
        return Packed(*(t.to(device) for t in (self.input_ids, self.block, self.position_ids, self.index)))


def pack_rows(prompts, responses, pad_id):
    """The rows of make_batch(prompts, responses) with each distinct prompt forwarded once.

    Rows with the same prompt become one sequence [prompt, response_1, response_2, ...]. A
    response token attends to the prompt and to the earlier tokens of its own response only
    (`sees`), and takes the positions it has in its own row, so every token is computed exactly
    as in its own row. `index` lists, for the N response tokens in make_batch's order (row by
    row, i.e. the order of response_mask[:, 1:].nonzero()), the packed position whose hidden
    state predicts it: the prompt's last position for a first token (shared by the responses),
    else the previous token of the same response.

    pack_rows([[5, 6], [5, 6], [7]], [[8, 2], [9, 9, 2], [4, 2]], pad_id=0) ->
        input_ids [[5, 6, 8, 2, 9, 9, 2],        position_ids [[0, 1, 2, 3, 2, 3, 4],
                   [7, 4, 2, 0, 0, 0, 0]]                      [0, 1, 2, 0, 0, 0, 0]]
        block     [[-1, -1, 0, 0, 1, 1, 1],
                   [-1, 0, 0, -2, -2, -2, -2]]
        index     [1, 2, 1, 4, 5, 7, 8]    (row 0: 1, 2; row 1: 1, 4, 5; row 2: 7 + 0, 7 + 1)
    """
    segments = {}  # prompt -> row indices, in first-seen order
    for i, p in enumerate(prompts):
        segments.setdefault(tuple(p), []).append(i)
    width = max(len(p) + sum(len(responses[i]) for i in rows) for p, rows in segments.items())
    S = len(segments)
    input_ids = torch.full((S, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((S, width), dtype=torch.long)
    block = torch.full((S, width), -1, dtype=torch.long)
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
    index = torch.tensor([j for i in range(len(prompts)) for j in predictor[i]], dtype=torch.long)
    return Packed(input_ids, block, position_ids, index)


def segments(block):
    """Block ids [B, L] (pack_rows', or one_row's) -> (segment, prompt), both [B, L]: each
    position's segment (a prompt, a response, or padding) numbered along its row, and the
    segment of its sequence's prompt. A row may hold several packed sequences end to end
    (one_row): a sequence starts where the ids return to -1; padding belongs to the sequence
    before it, as a response of its own.

    segments([[-1, -1, 0, 0, 1, -1, 0, 1, 1]]) -> segment [[0, 0, 1, 1, 2, 3, 4, 5, 5]]
                                                 prompt  [[0, 0, 0, 0, 0, 3, 3, 3, 3]]
    """
    segment = torch.nn.functional.pad((block[:, 1:] != block[:, :-1]).cumsum(1), (1, 0))  # [B, L]
    prompt = torch.where(block == -1, segment, -1).cummax(1).values  # [B, L]
    return segment, prompt


def sees(segment, prompt, b, q, kv):
    """The packing rule on `segments`: in row b, query position q attends key position kv iff
    kv <= q and kv is in q's own segment or in its sequence's prompt. A response sees its prompt
    and its own earlier tokens, never another response or another sequence (padding attends
    like a response of its own: a query must see at least one key). Indices broadcast; also
    FlexAttention's mask_mod."""
    return (kv <= q) & ((segment[b, kv] == segment[b, q]) | (segment[b, kv] == prompt[b, q]))


PACKED_FLEX = "sdpa+flex"  # model.use_packed_flex: FlexAttention for packed rows, SDPA for every other mask
PACKED_ATTENTION = ("sdpa", "eager", PACKED_FLEX)  # attention implementations packing is exact under


def one_row(input_ids, block, position_ids, index):
    """pack_rows' S sequences [S, Lp] end to end in one row [1, ΣL], their padding dropped, and
    `index` pointed at the same tokens there. The block ids still tell the sequences apart (each
    starts with its prompt, -1), so `sees` and packed_block_mask keep them apart; no padding is
    left for the linear layers or the attention to compute.

    pack_rows([[7], [5, 6], [5, 6]], [[4, 2], [8, 2], [9, 9, 2]], pad_id=0) and one_row of it ->
        input_ids    [[7, 4, 2, 0, 0, 0, 0],        [[7, 4, 2, 5, 6, 8, 2, 9, 9, 2]]
                      [5, 6, 8, 2, 9, 9, 2]]
        block        [[-1, 0, 0, -2, -2, -2, -2],   [[-1, 0, 0, -1, -1, 0, 0, 1, 1, 1]]
                      [-1, -1, 0, 0, 1, 1, 1]]
        position_ids [[0, 1, 2, 0, 0, 0, 0],        [[0, 1, 2, 0, 1, 2, 3, 2, 3, 4]]
                      [0, 1, 2, 3, 2, 3, 4]]
        index        [0, 1, 8, 9, 8, 11, 12]        [0, 1, 4, 5, 4, 7, 8]
    """
    keep = (block != -2).flatten()  # [S * Lp]
    place = keep.cumsum(0) - 1  # [S * Lp] a kept position's place in the row
    return (input_ids.flatten()[keep][None], block.flatten()[keep][None], position_ids.flatten()[keep][None],
            place[index])


def packed_inputs(input_ids, block, position_ids, index, implementation):
    """pack_rows' tensors as a model under `implementation` takes them -> (input_ids,
    attention_mask, position_ids, index). PACKED_FLEX: one_row with its BlockMask, so only the
    real tokens' tiles are computed (the padded [S, Lp] layout also computed the padding
    queries', which attend all earlier padding: 79% of the tiles of a CRM micro-batch of 2 x 4
    rows with 4,096-token answers, bench/packing.py). sdpa and eager (the CPU) keep the [S, Lp]
    sequences: they compute a dense mask's whole square whatever it allows, so one row would
    trade S Lp^2 for (ΣL)^2."""
    if implementation == PACKED_FLEX:
        input_ids, block, position_ids, index = one_row(input_ids, block, position_ids, index)
    return input_ids, attention_mask_for(block, implementation), position_ids, index


def attention_mask_for(block, implementation):
    """Block ids [S, L] (pack_rows' or one_row's) as `implementation` reads an attention mask.
    sdpa: a boolean [S, 1, L, L], True = attend. eager ADDS its mask to the scores (a boolean
    would add 1 or 0 and let every token see every other): 0 where allowed, the float32 minimum
    elsewhere. PACKED_FLEX: a FlexAttention BlockMask of the same rule, which lets the kernel
    skip the blocks no query of a tile attends (responses never see each other), built from the
    packing's segments (packed_block_mask: no [L, L] tensor). flash-attention kernels take no
    such mask: refused (train.py checks this before training)."""
    S, L = block.shape
    if implementation == PACKED_FLEX:
        return packed_block_mask(block)
    segment, prompt = segments(block)
    positions = torch.arange(L, device=block.device)
    allowed = sees(segment, prompt, torch.arange(S, device=block.device)[:, None, None], positions[:, None], positions)
    allowed = allowed.unsqueeze(1)  # [S, 1, L, L]
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min)
    raise ValueError(f"shared-prompt packing needs attn_implementation {' or '.join(PACKED_ATTENTION)}, the model "
                     f"uses {implementation!r}: load it with one of those, or set --shared_prompt=False")


def packed_block_mask(block, tile=128):
    """The FlexAttention BlockMask of `sees` for block ids [S, L] (pack_rows' or one_row's),
    built from the packing's structure instead of evaluating the rule on the [L, L] square
    (torch's create_block_mask, uncompiled, materialises [S, 1, L, L] tensors: ~3 S L^2 bytes,
    16 GB for one group of 6 x 12k tokens). Memory and time are O(S (L / tile)^2).

    Along a row the segments are numbered in order with none skipped (`segments`), so a tile of
    positions holds every segment from its smallest to its largest; the prompts never decrease,
    so a tile's smallest is its first position's. For query tile i (segments q_low .. q_high,
    prompts p_low .. p_high) and key tile j (segments k_low .. k_high):
      some key attended  iff j <= i and (k_high >= q_low or the key tile holds p_low): exact, as
                         tiles are aligned (j = i: the diagonal holds (q, q); j < i: every key
                         precedes every query, and only the tile's first segment and its first
                         sequence's prompt can have begun before it)
      every key attended iff j < i and every key segment is attended by every query: those are
                         {q_low, p_low} if the query tile is one segment, {p_low} if it is one
                         sequence, else none; a key tile of two segments is both (k_high - k_low
                         = 1: the prompt's end and the first response's start)
    Positions past the row's end form a segment and a sequence of their own, so no tile holding
    them is full. The tiles where some but not every key is attended are computed with `sees` as
    the mask_mod. Equal, tile for tile, to create_block_mask's result (tests/test_grpo.py)."""
    from torch.nn.attention.flex_attention import BlockMask

    S, L = block.shape
    T = -(-L // tile)
    segment, prompt = segments(block)
    end = int(segment.max()) + 1  # past the end: a segment and a sequence of their own
    segment_tiles, prompt_tiles = (torch.nn.functional.pad(t, (0, T * tile - L), value=end).view(S, T, tile)
                                   for t in (segment, prompt))
    low, high = segment_tiles.amin(-1), segment_tiles.amax(-1)  # [S, T]
    p_low, p_high = prompt_tiles.amin(-1), prompt_tiles.amax(-1)  # [S, T]
    qi, kj = torch.arange(T, device=block.device)[:, None], torch.arange(T, device=block.device)[None, :]
    q_low, q_high, qp_low, qp_high = low[:, :, None], high[:, :, None], p_low[:, :, None], p_high[:, :, None]
    k_low, k_high = low[:, None, :], high[:, None, :]
    some = (kj <= qi) & ((k_high >= q_low) | ((k_low <= qp_low) & (qp_low <= k_high)))  # [S, T, T]

    def by_every_query(k):  # [S, 1, T] key segments -> [S, T, T]: attended by every query of the tile
        return ((k == qp_low) & (qp_low == qp_high)) | ((k == q_low) & (q_low == q_high))
    every = (kj < qi) & by_every_query(k_low) & by_every_query(k_high) & (k_high - k_low <= 1)
    partial = some & ~every

    def listed(dense):  # [S, T, T] -> per query tile: how many key tiles, which (in order, padded)
        order = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return dense.sum(-1).to(torch.int32)[:, None], order[:, None]
    return BlockMask.from_kv_blocks(*listed(partial), *listed(every), BLOCK_SIZE=tile,
                                    mask_mod=lambda b, h, q, kv: sees(segment, prompt, b, q, kv), seq_lengths=(L, L))
