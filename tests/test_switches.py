"""The reference-code switches of train.py, on hand-computed values: fix_importance_ratio,
warmup_from_zero and the reward rule's wiring (verify.py and gepa.py test the rules themselves)."""

import math

import pytest
import torch

import grpo
import train
from conftest import load_tiny, tiny_config, update_config


def hand_micro_batch(tilde_logp, advantage):
    """One row of two response tokens; token 0 has an old log-prob under x~, token 1 does not."""
    mask = torch.tensor([[True, True]])
    return train.MicroBatch(
        input_ids=torch.zeros(1, 3, dtype=torch.long), attention=torch.ones(1, 3), loss_mask=mask,
        advantages=torch.tensor([advantage]), sampler_logp=torch.zeros(1, 2), sampler_mask=torch.zeros(1, 2, dtype=torch.bool),
        tilde_old=(torch.tensor([[tilde_logp, 0.0]]), torch.tensor([[True, False]])),
        rows=[train.Row([0], [0, 0], advantage)])


@pytest.mark.parametrize("tilde_p, advantage, dual_clip, loss, grads", [
    # rho_0 = 0.5 / 0.25 = 2, rho_1 = 1 (no x~ value: the current log-prob, detached). Token-mean over 2 tokens.
    (0.25, 1.0, 0.0, (-1.2 - 1.0) / 2, [0.0, -0.5]),   # A > 0: rho 2 is clipped to 1.2, no gradient through it
    (0.25, -1.0, 0.0, (2.0 + 1.0) / 2, [1.0, 0.5]),    # A < 0: max(2, 1.2) = 2, d(-A rho)/d logp = -A rho = 2
    (0.125, -1.0, 3.0, (3.0 + 1.0) / 2, [0.0, 0.5]),   # rho 4 > c = 3: the dual clip caps the loss at -A c
])
def test_fix_importance_ratio_takes_the_old_policy_under_x_tilde(monkeypatch, tilde_p, advantage, dual_clip, loss, grads):
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]], requires_grad=True)
    monkeypatch.setattr(train, "response_logprobs", lambda *args, **kwargs: (logp, None))
    cfg = train.Config(autocast_bf16=False, dual_clip=dual_clip)
    part = train.Part([], grpo.Denominators(2, 1, 2), {}, 1)
    out, _ = train.micro_batch_loss(None, hand_micro_batch(math.log(tilde_p), advantage), cfg, part, [],
                                    with_entropy=False)
    out.backward()
    assert out.item() == pytest.approx(loss, abs=1e-6)
    assert logp.grad[0].tolist() == pytest.approx(grads, abs=1e-6)


@pytest.mark.parametrize("crm", [True, False])
def test_the_pre_update_pass_gives_templated_rows_their_x_tilde_log_probs(tiny_model, crm):
    """A distilled row's old log-probs under x~ come from the CRM pass (also with --crm=False,
    when no CRM weight is kept) and equal a forward of the row under x~; plain rows get none."""
    model = load_tiny(tiny_model)
    Row = train.Row
    rows = [Row([5, 6, 7], [9, 10, 2], 1.0), Row([5, 6, 7], [11, 12, 2], -1.0, tilde_prompt_ids=[30, 31, 5, 6, 7])]
    cfg = update_config(fix_importance_ratio=True, crm=crm)
    parts, sums = train.prepare_mini_batches(model, None, rows, cfg, pad_id=2, n_groups=1, terms=[])
    with torch.no_grad():
        expected = train.row_logprobs(model, [[30, 31, 5, 6, 7]], [[11, 12, 2]], 2, 1.0)[0]
    (batch,) = parts[0].batches
    plain, templated = sorted(batch.rows, key=lambda r: r.tilde_prompt_ids is not None)  # the pass's copies
    assert plain.tilde_old_logp is None
    assert torch.allclose(templated.tilde_old_logp, expected, atol=1e-5)
    assert (templated.crm_weight is not None) == crm and sums["crm_templated_tokens"] == (3 if crm else 0)
    assert all(r.crm_weight is None and r.tilde_old_logp is None for r in rows)  # the step's rows are left as they were
    values, known = batch.tilde_old
    assert int(known.sum()) == 3  # the templated row's three response positions
    assert torch.allclose(values[known], expected, atol=1e-5)


def test_fix_importance_ratio_with_two_mini_batches_by_hand(tiny_model):
    """mini_batches=2 stores old log-probs under x for every row; a distilled row's are replaced by
    its log-probs under x~. With lr 0 the weights stay put, so each mini-batch's loss is the
    PPO-clip formula on the pre-update log-probs, token-mean over that mini-batch."""
    Row = train.Row
    tilde = [30, 31, 5, 6, 7]
    rows = [Row([5, 6, 7], [9, 10, 2], 1.0, tilde_prompt_ids=tilde, group=0), Row([5, 6, 7], [11, 2], -1.0, group=0),
            Row([8, 4], [12, 13, 2], 0.5, group=1), Row([8, 4], [15, 2], -0.5, group=1)]
    model = load_tiny(tiny_model)
    with torch.no_grad():
        under_x, under_tilde = train.row_logprobs(model, [[5, 6, 7], tilde], [[9, 10, 2]] * 2, 2, 1.0)
    rho = (under_x - under_tilde).exp()
    templated = torch.maximum(-1.0 * rho, -1.0 * rho.clamp(0.8, 1.2)).sum().item()
    first = (templated + 1.0 * 2) / 5  # the plain row: rho = 1, -A per token; 3 + 2 tokens
    second = -(0.5 * 3 - 0.5 * 2) / 5
    cfg = update_config(mini_batches=2, fix_importance_ratio=True, crm=False, grad_clip=1e9)
    update = train.policy_update(model, None, torch.optim.SGD(model.parameters(), lr=0.0), rows, cfg, pad_id=2, n_groups=2)
    assert update.loss == pytest.approx((first + second) / 2, abs=1e-5)
    assert rho.min().item() < 0.8 or rho.max().item() > 1.2  # the clip is exercised: rho is not 1
    plain = train.policy_update(model, None, torch.optim.SGD(model.parameters(), lr=0.0), rows,
                                update_config(mini_batches=2, crm=False, grad_clip=1e9), pad_id=2, n_groups=2)
    assert plain.loss == pytest.approx(((-1.0 * 3 + 1.0 * 2) / 5 + second) / 2, abs=1e-5)  # off: rho = 1 everywhere


def test_fix_importance_ratio_is_off_by_default_and_needs_distillation():
    assert train.Config().fix_importance_ratio is False
    with pytest.raises(SystemExit, match="needs --context_distill=True"):
        train.check_config(train.Config(fix_importance_ratio=True, context_distill=False))


def test_warmup_factors_by_hand():
    ours = [train.warmup_factor(4, False, s) for s in range(6)]
    verl = [train.warmup_factor(4, True, s) for s in range(6)]
    assert ours == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert verl == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]  # verl's first optimizer step runs at lr 0
    assert train.warmup_factor(0, True, 0) == train.warmup_factor(0, False, 0) == 1.0  # no warm-up: full lr at once


def test_the_reward_setting_picks_the_rule_for_rollouts(tiny_model, tmp_path, monkeypatch):
    """--reward=official scores every rollout with verify.CHECKS['official'] (spied on here)."""
    import verify

    calls = []

    def spy(text, answer):
        calls.append(answer)
        return verify.Verdict(float(len(text) % 2 == 0), None, "spy")

    monkeypatch.setitem(verify.CHECKS, "official", spy)
    cfg = tiny_config(tiny_model, tmp_path, algo="grpo", max_steps=1, save_every=0, reward="official")
    train.train(cfg)
    assert len(calls) == 1 + cfg.prompts_per_step * cfg.group_size  # + the start-up try on a gold answer
