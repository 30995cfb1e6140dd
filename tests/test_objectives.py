"""Issue 53: GSPO, GSPO-token, CISPO and the engine-mismatch corrections (grpo.POLICY_LOSSES,
grpo.SAMPLER_CORRECTIONS). Each loss and gradient against a float64 reference written from the
paper's formula, loop by loop; the edge cases by hand; what each reduces to with one update per
batch; the whole update (mini-batches, PPO epochs) against an objective it must equal; and the
combinations refused at start-up."""

import math

import pytest
import torch

import config
import grpo
import train
from conftest import load_tiny, update_config

DEN = grpo.Denominators


def batch(seed=0, B=4, T=5):
    """float64 logp (a leaf: its gradient is d loss / d log pi_t), old log-probs off by up to 0.3, a ragged mask."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.6
    mask = torch.ones(B, T, dtype=torch.bool)
    for i in range(B):
        mask[i, T - i:] = False  # row i has T - i tokens
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)[:B]
    return logp, old, mask, adv


def grad_of(loss, logp):
    (g,) = torch.autograd.grad(loss, logp)
    return g


def loss_of(objective, logp, old, adv, mask, agg, eps=(0.2, 0.2), **kw):
    n_tokens, n_rows = mask.sum().item(), mask.shape[0]
    loss, sums = grpo.policy_loss(logp, old, adv, mask, DEN(n_tokens, n_rows, n_tokens), eps_low=eps[0],
                                  eps_high=eps[1], loss_agg=agg, max_len=mask.shape[1], objective=objective, **kw)
    return loss, sums


# ----------------------------------------------------------------------------- float64 references


def reference_gspo(logp, old, adv, mask, lo, hi):
    """GSPO eq. (5)-(7): J = 1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(1/|y_i| sum_t log ratio).
    Its gradient by hand: -A_i s_i / (G |y_i|) on every token of a response whose clip does not bind, else 0."""
    G = logp.shape[0]
    value, grad = 0.0, torch.zeros_like(logp)
    for i in range(G):
        ts = [t for t in range(logp.shape[1]) if mask[i, t]]
        s = math.exp(sum(logp[i, t].item() - old[i, t].item() for t in ts) / len(ts))
        a = adv[i].item()
        unclipped, clipped = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
        value += max(unclipped, clipped) / G
        if unclipped >= clipped:  # the clip does not bind: the unclipped term carries the gradient
            for t in ts:
                grad[i, t] = -a * s / (G * len(ts))
    return value, grad


def reference_cispo(logp, old, adv, mask, lo, hi):
    """MiniMax-M1 eq. (4): J = 1/sum|o_i| sum_i,t sg(clip(r_it, 1 - lo, 1 + hi)) A_i log pi_it; gradient by hand."""
    D = mask.sum().item()
    value, grad = 0.0, torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                w = min(max(math.exp(logp[i, t].item() - old[i, t].item()), 1 - lo), 1 + hi)
                value += -w * adv[i].item() * logp[i, t].item() / D
                grad[i, t] = -w * adv[i].item() / D
    return value, grad


@pytest.mark.parametrize("objective", ["gspo", "gspo_token"])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.03, 0.04), (3e-4, 4e-4)])
def test_gspo_loss_and_gradient_match_the_paper_in_float64(objective, eps):
    for seed in range(3):
        logp, old, mask, adv = batch(seed)
        loss, sums = loss_of(objective, logp, old, adv, mask, "seq-mean-token-mean", eps)
        value, grad = reference_gspo(logp, old, adv, mask, *eps)
        assert loss.item() == pytest.approx(value, abs=1e-12)
        torch.testing.assert_close(grad_of(loss, logp), grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("eps", [(0.2, 0.28), (1.0, 3.0), (0.01, 0.01)])
def test_cispo_loss_and_gradient_match_minimax_m1_in_float64(eps):
    for seed in range(3):
        logp, old, mask, adv = batch(seed)
        loss, sums = loss_of("cispo", logp, old, adv, mask, "token-mean", eps)
        value, grad = reference_cispo(logp, old, adv, mask, *eps)
        assert loss.item() == pytest.approx(value, abs=1e-12)
        torch.testing.assert_close(grad_of(loss, logp), grad, atol=1e-12, rtol=0)
        ratio = (logp - old).exp()
        assert sums["clipped_tokens"] == (((ratio < 1 - eps[0]) | (ratio > 1 + eps[1])) & mask).sum().item()


def test_cispo_keeps_a_gradient_where_ppo_clips_it():
    """A token far beyond the clip with A > 0: PPO's gradient there is 0, CISPO's is -(1 + eps_high) A / D."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, -2.0]], dtype=torch.float64)  # ratio e^0.5 = 1.65 on the first token, 1 on the second
    mask, adv = torch.ones(1, 2, dtype=torch.bool), torch.tensor([2.0], dtype=torch.float64)
    ppo = grad_of(loss_of("ppo", logp, old, adv, mask, "token-mean")[0], logp)
    cispo = grad_of(loss_of("cispo", logp, old, adv, mask, "token-mean")[0], logp)
    assert ppo.tolist() == [[0.0, -1.0]]
    assert cispo.tolist() == [[pytest.approx(-1.2 * 2 / 2), pytest.approx(-1.0)]]


# ----------------------------------------------------------------------------- edge cases, by hand


def test_a_response_exactly_at_the_clip_bound_keeps_its_gradient_and_one_past_it_loses_it():
    """eps = 0: the bound is s = 1. At it the loss is -A and each token's gradient -A / (G n): the clip binds
    only beyond the bound. One response above it with A > 0 is clipped (gradient 0); with A < 0 it is not."""
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0], [-1.1, -1.1], [-1.1, -1.1]], dtype=torch.float64)  # s = 1, e^0.1, e^0.1
    adv, mask = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64), torch.ones(3, 2, dtype=torch.bool)
    for objective in ("gspo", "gspo_token"):
        loss, sums = loss_of(objective, logp, old, adv, mask, "seq-mean-token-mean", eps=(0.0, 0.0))
        s = math.exp(0.1)
        assert loss.item() == pytest.approx((-1.0 - 1.0 + s) / 3, abs=1e-12)  # row 2: max(-A s, -A 1) = s
        expected = torch.tensor([[-1 / 6, -1 / 6], [0.0, 0.0], [s / 6, s / 6]], dtype=torch.float64)
        torch.testing.assert_close(grad_of(loss, logp), expected, atol=1e-12, rtol=0)
        assert sums["clipped_tokens"] == 2  # the response beyond the bound, both of its tokens


def test_a_fully_masked_response_adds_nothing_and_no_nan():
    """A row with no trained token (every CRM weight 0, or no response): loss and gradient as without it."""
    logp, old, mask, adv = batch(1)
    mask[2] = False
    for objective, agg in (("gspo", "seq-mean-token-mean"), ("gspo_token", "seq-mean-token-mean"),
                           ("cispo", "token-mean"), ("ppo", "token-mean")):
        loss, _ = loss_of(objective, logp, old, adv, mask, agg)
        g = grad_of(loss, logp)
        assert torch.isfinite(g).all() and (g[2] == 0).all()
        keep = [0, 1, 3]
        sub = logp.detach()[keep].clone().requires_grad_()
        n_tokens = mask[keep].sum().item()
        alone, _ = grpo.policy_loss(sub, old[keep], adv[keep], mask[keep], DEN(n_tokens, 4, n_tokens),
                                    loss_agg=agg, objective=objective)  # the same denominators: 4 rows
        assert loss.item() == pytest.approx(alone.item(), abs=1e-12)
        torch.testing.assert_close(g[keep], grad_of(alone, sub), atol=1e-12, rtol=0)


def test_a_one_token_response_makes_gspo_the_token_ratio():
    """|y| = 1: s_i = r_i, so GSPO and GSPO-token are PPO-clip, value and gradient."""
    logp, old, _, adv = batch(2, T=1)
    mask = torch.ones(4, 1, dtype=torch.bool)
    ppo, _ = loss_of("ppo", logp, old, adv, mask, "seq-mean-token-mean")
    g = grad_of(ppo, logp)
    for objective in ("gspo", "gspo_token"):
        loss, _ = loss_of(objective, logp, old, adv, mask, "seq-mean-token-mean")
        assert loss.item() == pytest.approx(ppo.item(), abs=1e-12)
        torch.testing.assert_close(grad_of(loss, logp), g, atol=1e-12, rtol=0)


def test_gspo_token_with_per_token_advantages_has_a_gradient_path_per_token():
    """GSPO-token (eq. 13): s_it = sg[s_i] pi_t / sg[pi_t] with A_it: the gradient on token t is -A_it s_i / (G n_i)
    where A_it s_i is not clipped. With A_it = A_i it is GSPO's (test above)."""
    logp, old, mask, _ = batch(3)
    adv = torch.linspace(-1, 1, 20, dtype=torch.float64).reshape(4, 5)
    loss, _ = loss_of("gspo_token", logp, old, adv, mask, "seq-mean-token-mean", eps=(0.05, 0.05))
    expected = torch.zeros_like(logp)
    for i in range(4):
        n = mask[i].sum().item()
        s = math.exp(((logp[i] - old[i])[mask[i]]).mean().item())
        for t in range(n):
            a = adv[i, t].item()
            if -a * s >= -a * min(max(s, 0.95), 1.05):
                expected[i, t] = -a * s / (4 * n)
    torch.testing.assert_close(grad_of(loss, logp), expected, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- what each reduces to


@pytest.mark.parametrize("objective, agg", [("gspo", "seq-mean-token-mean"), ("gspo_token", "seq-mean-token-mean"),
                                            ("cispo", "token-mean"), ("cispo", "seq-mean-token-mean")])
def test_with_one_update_a_batch_each_objective_is_grpos_policy_gradient(objective, agg):
    """old = None (the ratio is 1): GSPO's gradient is GRPO's under the sequence mean (the paper's eq. 10 at s = 1:
    1/G sum_i A_i 1/|y_i| sum_t grad log pi); CISPO's is the REINFORCE gradient with group advantages
    (MiniMax-M1 eq. 4 at r = 1), GRPO's under any aggregation."""
    logp, _, mask, adv = batch(4)
    ppo, _ = loss_of("ppo", logp, None, adv, mask, agg)
    loss, sums = loss_of(objective, logp, None, adv, mask, agg)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(ppo, logp), atol=1e-12, rtol=0)
    assert sums["clipped_tokens"] == 0


def test_the_whole_update_off_policy_gspo_is_ppo_on_one_token_responses_and_cispo_is_ppo_without_a_clip(tiny_model):
    """policy_update with 2 mini-batches x 2 PPO epochs (the ratio leaves 1 after the first step): on one-token
    responses GSPO and GSPO-token take PPO's steps exactly; with a band no ratio leaves, CISPO's gradient
    sg(r) A grad log pi is PPO's unclipped grad(r A). Same SGD steps, so the same weights."""
    Row = train.Row
    rows = [Row([5 + i, 6], [9 + i], a, group=i // 2) for i, a in enumerate([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])]
    runs = {}
    for name, over in {"ppo": {}, "gspo": dict(policy_loss="gspo"), "gspo_token": dict(policy_loss="gspo_token"),
                       "ppo_wide": dict(eps_low=1.0, eps_high=1e6),
                       "cispo_wide": dict(policy_loss="cispo", eps_low=1.0, eps_high=1e6)}.items():
        model = load_tiny(tiny_model).double()
        cfg = update_config(**{**dict(ppo_epochs=2, mini_batches=2, loss_agg="seq-mean-token-mean", eps_low=0.01,
                                      eps_high=0.01), **over})
        update = train.policy_update(model, None, torch.optim.SGD(model.parameters(), lr=2.0), rows, cfg, pad_id=2,
                                     n_groups=3)
        runs[name] = (update, {k: v.detach().clone() for k, v in model.state_dict().items()})
    assert runs["ppo"][0].sums["clipped_tokens"] > 0  # the ratio left 1 and the clip bound
    assert runs["cispo_wide"][0].sums["clipped_tokens"] == 0
    for a, b in (("gspo", "ppo"), ("gspo_token", "ppo"), ("cispo_wide", "ppo_wide")):
        assert runs[a][0].sums["clipped_tokens"] == runs[b][0].sums["clipped_tokens"]
        for k, v in runs[b][1].items():
            torch.testing.assert_close(runs[a][1][k], v, atol=1e-12, rtol=0, msg=f"{a} vs {b}: {k}")


def test_gspo_token_with_the_crm_takes_ppos_step_at_ratio_one(tiny_model):
    """P²O's distilled rows (CRM weights) under GSPO-token: with one update a batch s_i = 1, so each token's
    gradient is w_t A grad log pi / (G n_i), PPO-clip's under seq-mean-token-mean with the same CRM weights."""
    from conftest import some_rows

    out = []
    for objective in ("ppo", "gspo_token"):
        model = load_tiny(tiny_model).double()
        cfg = update_config(policy_loss=objective, loss_agg="seq-mean-token-mean", crm_low=0.9, crm_high=1.1)
        update = train.policy_update(model, None, torch.optim.SGD(model.parameters(), lr=1.0), some_rows(), cfg,
                                     pad_id=2)
        out.append((update, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    (u0, p0), (u1, p1) = out
    assert u0.sums["crm_templated_tokens"] > 0 and u0.sums["crm_out_of_band_tokens"] > 0  # the mask binds
    assert u1.loss == pytest.approx(u0.loss, abs=1e-12)
    for k in p0:
        torch.testing.assert_close(p1[k], p0[k], atol=1e-12, rtol=0)


def test_gspo_under_shared_prompts_equals_the_row_layout(tiny_model):
    """Packed rows (--shared_prompt) are laid out per row again before the loss: one ratio a response holds."""
    from test_train import shared_rows

    out = []
    for shared in (False, True):
        model = load_tiny(tiny_model)
        cfg = update_config(shared_prompt=shared, micro_batch_size=5, mini_batches=2, policy_loss="gspo", crm=False,
                            loss_agg="seq-mean-token-mean", eps_low=0.01, eps_high=0.01)
        rows = [r if r.tilde_prompt_ids is None else train.Row(r.prompt_ids, r.response_ids, r.advantage, group=r.group)
                for r in shared_rows()]
        update = train.policy_update(model, None, torch.optim.SGD(model.parameters(), lr=0.5), rows, cfg, pad_id=2)
        out.append((update, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    (u0, p0), (u1, p1) = out
    assert u1.loss == pytest.approx(u0.loss, abs=1e-6) and u1.sums["clipped_tokens"] == u0.sums["clipped_tokens"]
    for k in p0:
        torch.testing.assert_close(p1[k], p0[k], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- sampler corrections


def corrections_batch():
    d = torch.tensor([[0.0, math.log(1.5), math.log(3.0)], [-0.5, 0.2, 0.0], [math.log(0.4), 0.0, 0.0]],
                     dtype=torch.float64)  # log pi_old - log pi_sampler
    known = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    return d, known


def test_each_correction_weight_by_hand():
    d, known = corrections_batch()
    e = math.exp
    cases = {  # name, band -> (weight, touched) written out
        ("token_tis", (2.0,)): ([[1, 1.5, 2], [e(-0.5), e(0.2), 1], [0.4, 1, 1]], [[0, 0, 1], [0, 0, 0], [0, 0, 0]]),
        ("token_mask", (0.5, 2.0)): ([[1, 1, 0], [1, 1, 1], [0, 1, 1]], [[0, 0, 1], [0, 0, 0], [1, 0, 0]]),
        ("icepop", (0.5, 2.0)): ([[1, 1.5, 0], [e(-0.5), e(0.2), 1], [0, 1, 1]], [[0, 0, 1], [0, 0, 0], [1, 0, 0]]),
        # products 4.5, e^-0.3, 0.4 over the known tokens
        ("seq_tis", (2.0,)): ([[2] * 3, [e(-0.3)] * 3, [0.4] * 3], [[1] * 3, [0] * 3, [0] * 3]),
        ("seq_mask", (0.5, 2.0)): ([[0] * 3, [1] * 3, [0] * 3], [[1] * 3, [0] * 3, [1] * 3]),
        # geometric means 4.5^(1/3) = 1.65, e^-0.15 = 0.86, 0.4
        ("geo_mask", (0.5, 1.5)): ([[0] * 3, [1] * 3, [0] * 3], [[1] * 3, [0] * 3, [1] * 3]),
        ("geo_mask", (0.3, 2.0)): ([[1] * 3, [1] * 3, [1] * 3], [[0] * 3, [0] * 3, [0] * 3]),
    }
    for (name, band), (weight, touched) in cases.items():
        w, t = grpo.SAMPLER_CORRECTIONS[name][0](d, known, band)
        torch.testing.assert_close(w, torch.tensor(weight, dtype=torch.float64), atol=1e-12, rtol=0, msg=name)
        assert t.tolist() == [[bool(x) for x in row] for row in touched], name


def test_a_response_without_engine_log_probs_is_never_corrected():
    d = torch.tensor([[5.0, -5.0]], dtype=torch.float64)
    known = torch.zeros(1, 2, dtype=torch.bool)  # a distilled row: sampled under x~, its engine log-probs unknown
    for name, (fn, keys, _) in grpo.SAMPLER_CORRECTIONS.items():
        w, t = fn(d, known, (2.0,) if len(keys) == 1 else (0.5, 2.0))
        assert w.tolist() == [[1.0, 1.0]] and not t.any(), name


def test_the_mismatch_diagnostics_and_the_correction_in_the_loss_by_hand():
    """d = log pi_old - log pi_sampler on known tokens: k1 = mean(-d), k3 = mean(e^d - 1 - d), perplexities
    exp(mean nll) on each side; token_mask drops one token of the loss, counted in corrected_tokens/seqs."""
    d, known = corrections_batch()
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7], [-2.0, -0.1, -0.4]], dtype=torch.float64,
                        requires_grad=True)
    sampler = logp.detach() - d
    mask, adv = torch.ones(3, 3, dtype=torch.bool), torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    loss, s = loss_of("ppo", logp, None, adv, mask, "token-mean", sampler_logp=sampler, sampler_mask=known,
                      correction=("token_mask", (0.5, 2.0)))
    on = d[known]
    assert s["mismatch_tokens"] == 6 and s["mismatch_seqs"] == 3
    assert s["mismatch_k1_sum"] / 6 == pytest.approx(-on.mean().item(), abs=1e-12)
    assert s["mismatch_k3_sum"] / 6 == pytest.approx((on.exp() - 1 - on).mean().item(), abs=1e-12)
    assert math.exp(s["trainer_nll_sum"] / 6) == pytest.approx(math.exp(-logp.detach()[known].mean().item()))
    assert math.exp(s["sampler_nll_sum"] / 6) == pytest.approx(math.exp(-sampler[known].mean().item()))
    assert (s["corrected_tokens"], s["corrected_seqs"]) == (2, 2)
    kept = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.float64)
    assert loss.item() == pytest.approx(-(adv[:, None] * kept).sum().item() / 9, abs=1e-12)  # rho = 1, D = 9


def test_tis_cap_is_token_tis():
    logp, old, mask, adv = batch(5)
    sampler = old - 0.4 * torch.arange(5, dtype=torch.float64)
    a, sa = loss_of("ppo", logp, old, adv, mask, "token-mean", sampler_logp=sampler, sampler_mask=mask, tis_cap=1.5)
    b, sb = loss_of("ppo", logp, old, adv, mask, "token-mean", sampler_logp=sampler, sampler_mask=mask,
                    correction=("token_tis", (1.5,)))
    assert a.item() == b.item() and sa == sb and sa["corrected_tokens"] > 0


@pytest.mark.parametrize("text, parsed", [("", None), ("token_tis:2", ("token_tis", (2.0,))),
                                          ("geo_mask:0.999,1.001", ("geo_mask", (0.999, 1.001)))])
def test_parse_correction(text, parsed):
    assert grpo.parse_correction(text) == parsed


@pytest.mark.parametrize("text", ["tis:2", "token_tis", "token_tis:0", "token_mask:2", "token_mask:2,1",
                                  "seq_mask:0.5,nan", "seq_tis:1,2", "icepop:a,b"])
def test_a_malformed_correction_is_one_line(text):
    with pytest.raises(SystemExit, match="--sampler_correction: "):
        config.check_config(train.Config(sampler_correction=text))


# ----------------------------------------------------------------------------- combinations


@pytest.mark.parametrize("over, message", [
    (dict(policy_loss="gspo"), "--crm=False"),  # P²O's CRM on by default
    (dict(policy_loss="gspo", algo="grpo", tis_cap=2.0), "a token-level correction"),
    (dict(policy_loss="gspo", algo="grpo", sampler_correction="icepop:0.5,2"), "sequence-level correction"),
    (dict(policy_loss="gspo_token", fix_importance_ratio=True), "mix pi"),
    (dict(policy_loss="cispo", dual_clip=3.0), "--dual_clip=0"),
    (dict(tis_cap=2.0, sampler_correction="seq_mask:0.5,2"), "one correction at a time"),
    (dict(eps_low=1.5), "--eps_low must be <= 1"),
])
def test_a_combination_without_a_meaning_is_refused_in_one_line(over, message):
    with pytest.raises(SystemExit, match=message) as e:
        config.check_config(train.Config(**over))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("over", [
    dict(policy_loss="gspo", crm=False), dict(policy_loss="gspo", algo="grpo", sampler_correction="seq_tis:2"),
    dict(policy_loss="gspo", algo="grpo", sampler_correction="geo_mask:0.999,1.001"), dict(policy_loss="gspo_token"),
    dict(policy_loss="gspo_token", sampler_correction="token_mask:0.5,2"), dict(policy_loss="cispo", eps_low=1.0),
    dict(policy_loss="cispo", fix_importance_ratio=True), dict(policy_loss="gspo", algo="grpo", shared_prompt=True),
])
def test_the_combinations_with_a_meaning_pass(over):
    config.check_config(train.Config(**over))


@pytest.mark.parametrize("objective, correction, touched", [("gspo", "geo_mask:0.5,2", 0.0),
                                                             ("cispo", "token_mask:1.5,2", 1.0)])
def test_a_short_run_logs_the_mismatch_diagnostics_and_what_the_correction_touched(objective, correction, touched,
                                                                                  tiny_model, tmp_path):
    """HF rollouts carry the engine's log-probs: every metrics line has KL k1/k3, both perplexities and the
    corrected shares. Trainer and engine agree (fp32 both), so no ratio leaves [0.5, 2] and every one is
    below 1.5: a [1.5, 2] band drops every token and every response."""
    from conftest import read_metrics, tiny_config

    cfg = tiny_config(tiny_model, tmp_path, algo="grpo", policy_loss=objective, sampler_correction=correction,
                      loss_agg="seq-mean-token-mean", eps_low=3e-4 if objective == "gspo" else 1.0, save_every=0)
    out = train.train(cfg, reward_fn=lambda text, problem: float(len(text) % 2))
    assert out["step"] == 2
    for m in read_metrics(tmp_path / "t"):
        assert 0 <= m["sampler_kl_k3"] <= 0.01 and abs(m["sampler_kl_k1"]) <= 0.01
        assert m["trainer_ppl"] > 1 and abs(m["trainer_ppl"] / m["sampler_ppl"] - 1) < 0.01
        assert m["corrected_token_fraction"] == m["corrected_seq_fraction"] == touched
