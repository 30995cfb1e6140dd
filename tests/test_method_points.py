"""The points a method plugs into (issue 51), each used by a test that is a method: a per-token
advantage term that goes through PPO-clip, CRM and TIS exactly as A does; a no-grad Pass that
the forwarding and FLOPs counts know; rows that carry their verified reward and problem id and
are never written by a pass; an AuxTerm whose weight follows the step, at a temperature of its
own, on rows of no group; a method's numbers in metrics.jsonl; one console line per step."""


import pytest
import torch

import grpo
import train
from conftest import load_tiny, parity_reward, read_metrics, tiny_config, update_config
from data import Problem
from rollout import Sample

Row = train.Row


def split_advantage(rows):
    """The same rows with each A moved into the per-token term: A' = 0, b_t = A + b_t."""
    return [Row(r.prompt_ids, r.response_ids, 0.0, r.tilde_prompt_ids, r.sampler_logp, r.group,
                token_advantage=[r.advantage + b for b in (r.token_advantage or [0.0] * len(r.response_ids))])
            for r in rows]


def mixed_rows():
    """Plain, templated (CRM) and engine-sampled (TIS) rows in two groups, one with a token term."""
    return [Row([5, 6, 7], [9, 10, 2], 1.0, group=0, sampler_logp=[-2.0, -3.5, -1.0]),
            Row([5, 6, 7], [11, 2], -1.0, group=0, token_advantage=[0.4, -0.3]),
            Row([8, 4], [12, 13, 14, 2], 0.5, tilde_prompt_ids=[30, 31, 8, 4], group=1),
            Row([8, 4], [15, 2], -0.5, group=1, sampler_logp=[-6.0, -0.2])]


@pytest.mark.parametrize("over", [
    dict(),
    dict(ppo_epochs=2, mini_batches=2, eps_low=0.01, eps_high=0.01, dual_clip=1.5),  # the ratio leaves 1 and clips
    dict(tis_cap=1.5, crm_low=0.9, crm_high=1.1, crm_soft=True),  # TIS and soft CRM weights below 1
    dict(loss_agg="seq-mean-token-sum-norm", crm_denominator="all", fix_importance_ratio=True, ppo_epochs=2),
])
def test_a_per_token_term_is_trained_exactly_as_the_advantage(tiny_model, over):
    """A row's A moved token by token into Row.token_advantage trains the same loss, gradient and
    weights through PPO-clip, dual clip, CRM, TIS and several optimizer steps."""
    cfg = update_config(lr=0.05, grad_clip=1e9, **over)
    models = [load_tiny(tiny_model).double() for _ in range(2)]
    outs = []
    for model, rows in zip(models, (mixed_rows(), split_advantage(mixed_rows()))):
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        outs.append(train.policy_update(model, None, opt, rows, cfg, pad_id=2, n_groups=2, terms=[]))
    assert outs[0].loss == pytest.approx(outs[1].loss, abs=1e-12)
    assert outs[0].sums["clipped_tokens"] == outs[1].sums["clipped_tokens"]
    assert outs[0].trained_rows == outs[1].trained_rows == 4
    assert max((a - b).abs().max().item() for a, b in zip(*(m.parameters() for m in models))) < 1e-12
    if "ppo_epochs" in over:
        assert outs[0].sums["clipped_tokens"] > 0  # the clip was exercised


def test_the_per_token_term_by_hand(tiny_model):
    """One update, ratio 1: loss = -sum_t (A + b_t) / D over the step's tokens, and its gradient is
    -sum_t (A + b_t) grad log p_t / D (float64, from the rows' own log-probs)."""
    model = load_tiny(tiny_model).double()
    rows = [Row([5, 6, 7], [9, 10, 2], 0.0, token_advantage=[0.3, 0.0, -0.2], group=0),
            Row([8], [11, 12, 13, 2], -1.0, group=0), Row([5, 6], [14, 2], 0.0, group=0)]
    out = train.policy_update(model, None, torch.optim.SGD(model.parameters(), lr=0.0), rows, update_config(),
                              pad_id=2, n_groups=1, terms=[])
    weights = [[0.3, 0.0, -0.2], [-1.0] * 4, [0.0, 0.0]]
    assert out.loss == pytest.approx(-sum(map(sum, weights)) / 9, abs=1e-7)  # advantages are held in fp32
    assert out.trained_rows == 2  # A = 0 and no token term: not forwarded; A = 0 with a term: forwarded
    reference = load_tiny(tiny_model).double()
    logp = train.row_logprobs(reference, [r.prompt_ids for r in rows], [r.response_ids for r in rows], 2, 1.0)
    (-sum((torch.tensor(w, dtype=torch.float64) * lp).sum() for w, lp in zip(weights, logp)) / 9).backward()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # one step of lr 1 from equal weights: the gradient itself
    train.policy_update(model, None, opt, rows, update_config(grad_clip=1e9), pad_id=2, n_groups=1, terms=[])
    for before, after, p in zip(load_tiny(tiny_model).double().parameters(), model.parameters(), reference.parameters()):
        assert torch.allclose(before - after, p.grad if p.grad is not None else torch.zeros_like(p), rtol=1e-6, atol=1e-8)


def test_the_forwarding_rule_reads_the_token_term():
    assert train.forwarded(Row([1], [2, 3], 0.0, token_advantage=[0.0, 0.1]), [])
    assert not train.forwarded(Row([1], [2, 3], 0.0, token_advantage=[0.0, 0.0]), [])
    rows = [Row([1], [2, 3], 0.5), Row([1], [4], 0.0, kind="gold")]
    assert train.with_token_advantages(rows, {0: [1, 2]})[0].token_advantage == [1.0, 2.0]
    assert rows[0].token_advantage is None  # a copy, not the row
    with pytest.raises(ValueError, match="row 0 .* has 2 response tokens; got 3 values"):
        train.with_token_advantages(rows, {0: [1, 2, 3]})
    with pytest.raises(ValueError, match="not a rollout"):
        train.with_token_advantages(rows, {1: [1]})


def test_rows_carry_the_verified_reward_and_problem_and_passes_write_copies():
    group = train.Group(Problem("p7", "q", "1"), [Sample([1, 2], [3, 2], "x", "stop", logprobs=[-1.0, -1.0])] * 4,
                        [""] * 4, [1.0, 1.0, 0.0, 0.0], bonus=[-0.3, 0.0, 0.0, 0.0])
    rows = train.training_rows([group], train.Config(group_size=4), tokenizer=None)
    assert [r.reward for r in rows] == [1.0, 1.0, 0.0, 0.0] and {r.problem_id for r in rows} == {"p7"}
    assert rows[0].advantage < rows[1].advantage  # the advantages read the shaped reward, the row the verified one
    counted = train.Pass("len", lambda r: r.reward > 0, len, run=lambda run, rs: [len(r.response_ids) for r in rs])
    out = train.run_passes(None, rows, [counted])
    assert [r.data for r in out] == [{"len": 2}, {"len": 2}, {}, {}] and all(r.data == {} for r in rows)


def test_mini_batches_take_rows_of_no_group_in_turn_and_refuse_a_group_outside_the_step():
    rows = [Row([1], [2], 1.0, group=g) for g in (0, 1, 2)] + [Row([1], [2], 0.0, kind="gold") for _ in range(3)]
    parts = grpo.mini_batch_rows(rows, 3, 2)  # groups 0-1 and 2; the three loose rows dealt 0, 1, 0
    assert [[(r.group, r.kind) for r in p] for p in parts] == [
        [(0, "rollout"), (1, "rollout"), (None, "gold"), (None, "gold")], [(2, "rollout"), (None, "gold")]]
    later = grpo.mini_batch_rows(rows, 3, 2, first=1)  # torchrun: a lower rank dealt one loose row already
    assert [sum(r.group is None for r in p) for p in later] == [1, 2]
    with pytest.raises(ValueError, match="a gold row of group 5, but the step has 3 groups"):
        grpo.mini_batch_rows(rows + [Row([1], [2], 0.0, group=5, kind="gold")], 3, 2)


def test_a_term_at_its_own_temperature_with_a_weight_that_follows_the_step(tiny_model):
    """A supervised term (temperature 1.0) beside rollouts sampled at 0.6: its loss is coef(step) x the
    NLL of its rows at T = 1, not at T = 0.6; GRPO's loss is the one without it."""
    model = load_tiny(tiny_model)
    gold = [Row([5, 6], [9, 10, 11, 2], 0.0, kind="gold"), Row([8], [12, 2], 0.0, kind="gold")]
    def nll(logp, b):  # run only on micro-batches that hold its rows (here: not the rollouts', at 0.6)
        assert any(r.kind == "gold" for r in b.rows)
        return -logp

    sft = train.AuxTerm("sft", "gold", lambda step: 0.5 ** step, nll, temperature=1.0)
    cfg = update_config(temperature=0.6, mini_batches=2)
    rollouts = [Row([5, 6, 7], [9, 10, 2], 1.0, group=0), Row([8], [11, 12, 13, 2], -1.0, group=1)]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = train.policy_update(model, None, opt, rollouts + gold, cfg, pad_id=2, n_groups=2, terms=[sft], step=3)
    base = train.policy_update(model, None, opt, rollouts, cfg, pad_id=2, n_groups=2, terms=[], step=3)
    with torch.no_grad():
        nll = {t: [-lp for lp in train.row_logprobs(model, [[5, 6], [8]], [[9, 10, 11, 2], [12, 2]], 2, t)]
               for t in (1.0, 0.6)}
    # mini-batch 1 holds gold row 0 (4 tokens), mini-batch 2 gold row 1 (2 tokens); the loss is their mean
    want = 0.125 * (nll[1.0][0].sum().item() / 4 + nll[1.0][1].sum().item() / 2) / 2
    assert out.sums["loss_sft"] == pytest.approx(want, rel=1e-5)
    assert out.sums["sft_sum"] == pytest.approx(sum(x.sum().item() for x in nll[1.0]), rel=1e-5)
    assert abs(sum(x.sum().item() for x in nll[0.6]) - out.sums["sft_sum"]) > 0.1  # not the sampling temperature
    assert out.sums["loss_policy"] == pytest.approx(base.sums["loss_policy"], abs=1e-7)
    with pytest.raises(ValueError, match="sampling temperature 0.6"):
        train.row_temperature(train.ROLLOUT, [train.AuxTerm("x", train.ROLLOUT, 1.0, None, temperature=1.0)], cfg)
    with pytest.raises(ValueError, match="different temperatures"):  # None is the sampling temperature, not 1.0
        train.row_temperature("gold", [sft, train.AuxTerm("y", "gold", 1.0, None)], cfg)
    for names in (["sft", "sft"], ["policy"]):
        with pytest.raises(ValueError, match="each once, and not 'policy'"):
            train.policy_update(model, None, opt, rollouts + gold, cfg, pad_id=2, n_groups=2,
                                terms=[train.AuxTerm(n, "gold", 1.0, nll) for n in names])


def test_a_decaying_supervised_method_in_a_run(tiny_model, tmp_path, monkeypatch, capsys):
    """Fork 2 of issue 51, as a method: each step's first rollout of every group imitated at T = 1
    with a weight 0.5^step, rows of no group. The hooks see the step metrics.jsonl gives, the term's
    weight and raw sum are logged, a method's own number too, and the console has a line a step."""
    seen = []

    def gold_rows(run, groups, step):
        seen.append(step)
        run.scalars["gold_rows"] = len(groups)
        return [Row(g.samples[0].prompt_ids, g.samples[0].response_ids, 0.0, kind="gold") for g in groups]

    monkeypatch.setattr(train, "auxiliary_rows", gold_rows)
    monkeypatch.setattr(train, "aux_terms", lambda cfg: [
        train.AuxTerm("sft", "gold", lambda step: 0.5 ** step, lambda logp, b: -logp, temperature=1.0)])
    train.train(tiny_config(tiny_model, tmp_path, max_steps=3, save_every=0, temperature=0.7, mini_batches=2),
                reward_fn=parity_reward)
    metrics = read_metrics(tmp_path / "t")
    assert seen == [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["coef_sft"] == 0.5 ** m["step"] and m["sft_sum"] > 0 and m["gold_rows"] == 3
        assert m["loss"] == pytest.approx(m["loss_policy"] + m["loss_sft"], abs=1e-5)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert all("reward " in line and "(policy " in line and ", sft " in line and "tok/s" in line for line in lines)


def test_a_token_bonus_method_with_its_own_pass_in_a_run(tiny_model, tmp_path, monkeypatch):
    """Fork 1 of issue 51, as a method: every rollout is correct, so every A is 0 and GRPO learns
    nothing; a bonus of 0.1 on each token the pre-update policy gave log-prob < -8 (its own Pass)
    trains those rows. The pass's tokens are in nograd_tokens and the loss is -sum(bonus) / D."""
    bonuses, read = [], []

    def logprobs(run, rows):
        read.extend(rows)
        with torch.no_grad():
            return [lp.tolist() for lp in train.row_logprobs(run.policy, [r.prompt_ids for r in rows],
                                                              [r.response_ids for r in rows], run.pad_id, 1.0)]

    def bonus(run, groups, rows, step):
        out = {i: [0.1 if lp < -8 else 0.0 for lp in r.data["logp"]] for i, r in enumerate(rows) if "logp" in r.data}
        assert {r.problem_id for r in rows} == {g.problem.id for g in groups}
        bonuses.append((sum(map(sum, out.values())), sum(len(r.response_ids) for r in rows)))
        return out

    plain_passes = train.passes
    monkeypatch.setattr(train, "passes", lambda cfg, terms: plain_passes(cfg, terms) + [
        train.Pass("logp", lambda r: r.kind == train.ROLLOUT and r.reward > 0,
                   lambda r: len(r.prompt_ids) + len(r.response_ids), logprobs)])
    monkeypatch.setattr(train, "token_advantages", bonus)
    out = train.train(tiny_config(tiny_model, tmp_path, max_steps=2, save_every=0), reward_fn=lambda t, p: 1.0)
    metrics = read_metrics(tmp_path / "t")
    assert all(m["trained_rows"] > 0 for m in metrics) and all(total > 0 for total, _ in bonuses)
    for m, (total, tokens) in zip(metrics, bonuses):
        assert m["loss_policy"] == pytest.approx(-total / tokens, abs=1e-6)
    assert out["counts"]["nograd_tokens"] == sum(len(r.prompt_ids) + len(r.response_ids) for r in read)
    assert any(not torch.equal(a, b) for a, b in zip(out["policy"].parameters(), load_tiny(tiny_model).parameters()))
