"""The step's extension points (train.py): row kinds and auxiliary loss terms (GRPO's loss is
unchanged by a method's rows; a term brings its own mask and denominator), reward shaping
(advantages read the bonus, everything else the verified reward), pluggable rewards, and logs
that say what they measure."""

import math
import os
import shutil

import pytest
import torch

import config
import train
import verify
from conftest import load_tiny, parity_reward, read_metrics, some_rows, tiny_config, update_config
from data import Problem, load_jsonl
from scoring import score_groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = "examples/short_answer.py:exact_match"


def aux_rows():
    """Two rows of a method's own kind (any advantage: GRPO never reads them)."""
    return [train.Row([5, 6], [17, 18, 2], 3.0, kind="repair"), train.Row([9], [19, 2], -7.0, kind="repair", group=1)]


def nll_term(coef):
    return train.AuxTerm("nll", "repair", coef, lambda logp, b: -logp)


def update(model, rows, terms, lr=0.0):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = train.policy_update(model, None, opt, rows, update_config(micro_batch_size=3), pad_id=2, n_groups=2,
                              terms=terms)
    return out


def test_grpo_loss_and_gradient_are_unchanged_by_auxiliary_rows(tiny_model):
    plain, mixed = load_tiny(tiny_model), load_tiny(tiny_model)
    base = update(plain, some_rows(), [], lr=0.1)
    with_aux = update(mixed, some_rows() + aux_rows(), [nll_term(0.0)], lr=0.1)
    assert with_aux.loss == pytest.approx(base.loss, abs=1e-6)
    assert with_aux.sums["loss_policy"] == pytest.approx(base.sums["loss_policy"], abs=1e-6)
    assert with_aux.sums["entropy_tokens"] == base.sums["entropy_tokens"]  # entropy: the rollouts' tokens only
    assert with_aux.trained_rows == base.trained_rows + 2  # the term reads its rows, so they are forwarded
    worst = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), mixed.parameters()))
    assert worst < 1e-6
    unread = update(load_tiny(tiny_model), some_rows() + aux_rows(), [])  # no term reads them: never forwarded
    assert unread.trained_rows == base.trained_rows and unread.loss == pytest.approx(base.loss, abs=1e-6)


def test_an_auxiliary_term_adds_its_own_token_mean_over_its_own_rows(tiny_model):
    """NLL of the 5 'repair' tokens (3 + 2), averaged over those 5 whatever the rollouts' count."""
    model = load_tiny(tiny_model)
    base = update(model, some_rows(), [])
    out = update(model, some_rows() + aux_rows(), [nll_term(0.5)])
    rows = aux_rows()
    with torch.no_grad():
        logp = train.row_logprobs(model, [r.prompt_ids for r in rows], [r.response_ids for r in rows], 2, 1.0)
    nll = -sum(lp.sum().item() for lp in logp) / 5
    assert out.loss - base.loss == pytest.approx(0.5 * nll, rel=1e-4)
    assert out.sums["loss_nll"] == pytest.approx(0.5 * nll, rel=1e-4)
    assert out.sums["nll_sum"] == pytest.approx(5 * nll, rel=1e-4)
    none = update(model, some_rows(), [nll_term(0.5)])  # a step without the term's rows: the term is 0, not 0 / 0
    assert none.finite and none.loss == pytest.approx(base.loss, abs=1e-6) and none.sums["loss_nll"] == 0.0


def test_the_forwarding_rule_is_one_function():
    Row, kl = train.Row, train.aux_terms(train.Config(kl_beta=0.1))
    zero, signal, aux = Row([1], [2], 0.0), Row([1], [2], 0.5), Row([1], [2], 0.0, kind="repair")
    assert [train.forwarded(r, []) for r in (zero, signal, aux)] == [False, True, False]
    assert [train.forwarded(r, kl) for r in (zero, signal, aux)] == [True, True, False]  # KL reads every rollout
    assert [train.forwarded(r, [nll_term(1.0)]) for r in (zero, signal, aux)] == [False, True, True]


def test_advantages_read_the_bonus_and_nothing_else_does():
    group = train.Group(Problem("p", "q", "1"), [], [""] * 4, [1.0, 1.0, 0.0, 0.0], bonus=[-0.2, 0.0, 0.0, 0.0])
    assert train.shaped_rewards(group) == [0.8, 1.0, 0.0, 0.0] and group.rewards == [1.0, 1.0, 0.0, 0.0]
    want = train.grpo.group_advantages(torch.tensor([[0.8, 1.0, 0.0, 0.0]]))
    from rollout import Sample

    group.samples = [Sample([1, 2], [3, 2], "x", "stop", logprobs=[-1.0, -1.0]) for _ in range(4)]
    rows = train.training_rows([group], train.Config(group_size=4), tokenizer=None)
    assert [r.advantage for r in rows] == pytest.approx(want[0].tolist())


def test_a_run_with_clipo_and_the_agreement_bonus_logs_them_and_resumes_exactly(tiny_model, tmp_path):
    shaped = dict(clipo_weight=0.2, clipo_dim=8, agreement_bonus=0.5, agreement_ngram=1, frozen_steps=1,
                  group_size=6, max_tokens=8)
    full = train.train(tiny_config(tiny_model, tmp_path / "a", max_steps=4, save_every=0, **shaped),
                       reward_fn=parity_reward)
    train.train(tiny_config(tiny_model, tmp_path / "b", max_steps=2, **shaped), reward_fn=parity_reward)
    resumed = train.train(tiny_config(tiny_model, tmp_path / "b", max_steps=4, resume="auto", **shaped),
                          reward_fn=parity_reward)
    ma, mb = read_metrics(tmp_path / "a" / "t"), read_metrics(tmp_path / "b" / "t")
    assert any(m.get("shaping_groups", 0) > 0 for m in ma)  # some group was shaped
    assert math.isnan(ma[0]["loss"]) and ma[0]["trained_rows"] == 0  # frozen_steps=1: the first step trains nothing
    for x, y in zip(ma, mb):
        for key in ("reward_mean", "shaping_bonus_mean", "shaping_clipo_head_loss", "shaping_order_changed"):
            assert (x.get(key) == y.get(key)) or (x.get(key) == pytest.approx(y.get(key), abs=1e-6)), key
    worst = max((a - b).abs().max().item() for a, b in zip(full["policy"].parameters(), resumed["policy"].parameters()))
    assert worst <= 1e-6


def test_entropy_is_nan_when_no_rollout_was_forwarded_and_the_note_says_what_the_loss_is(tiny_model, tmp_path,
                                                                                           capsys):
    train.train(tiny_config(tiny_model, tmp_path, max_steps=1, save_every=0), reward_fn=lambda text, p: 0.0)
    m = read_metrics(tmp_path / "t")[0]
    assert m["trained_rows"] == 0 and math.isnan(m["entropy"])
    assert "loss = loss_policy." in capsys.readouterr().out
    assert train.loss_note(train.Config(kl_beta=0.1), train.aux_terms(train.Config(kl_beta=0.1))).startswith(
        "note: loss = loss_policy + loss_kl.")
    assert "PPO ratio" not in train.loss_note(train.Config(ppo_epochs=2), [])


# ----------------------------------------------------------------------------- pluggable rewards


def test_the_example_reward_scores_short_answers():
    check_fn = verify.load_reward(EXAMPLE)
    problem = Problem("ar", "What is the capital of Argentina?", "Buenos Aires")
    assert check_fn("It is \\boxed{buenos aires}.", problem) == verify.Verdict(1.0, "buenos aires", "custom")
    assert check_fn("The answer:\nThe Buenos-Aires!", problem).reward == 0.0  # the hyphen is kept: not equal
    assert check_fn("The answer:\nthe Buenos Aires.", problem).reward == 1.0  # last line; article and stop dropped
    assert check_fn("Rosario", problem).reward == 0.0 and check_fn("", problem).reward == 0.0
    assert verify.load_reward("ours")("\\boxed{0.5}", Problem("h", "q", "1/2")).reward == 1.0


@pytest.mark.parametrize("spec, message", [
    ("nowhere.py:f", "--reward=nowhere.py:f: cannot import nowhere.py"),
    ("examples/short_answer.py:missing", "has no callable 'missing'"),
    ("no_such_module_xyz:f", "cannot import no_such_module_xyz"),
    ("oops", "--reward is one of 'ours' | 'official' | module:function | path/to/file.py:function, got 'oops'"),
])
def test_a_bad_reward_spec_is_one_line_before_anything_loads(tmp_path, spec, message):
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.check_config(train.Config(reward=spec, train_data=str(tmp_path / "none.jsonl")))


def test_a_reward_that_raises_or_returns_no_number_stops_at_start_up(tmp_path):
    module = tmp_path / "some_rewards.py"
    module.write_text("def boom(response, problem):\n    raise KeyError('answer_key')\n\n"
                      "def text(response, problem):\n    return 'yes'\n")
    problems = [Problem("q1", "What?", "1")]
    with pytest.raises(SystemExit, match=r"some_rewards.py:boom raised KeyError on problem q1: 'answer_key'"):
        verify.reward_scorer(train.Config(reward=f"{module}:boom"), problems)
    with pytest.raises(SystemExit, match=r"returned 'yes' for problem q1; it must return a finite number"):
        verify.reward_scorer(train.Config(reward=f"{module}:text"), problems)
    module.write_text(module.read_text() + "\nimport numpy\n\ndef flag(response, problem):\n    return 'yes' in response\n\n"
                      "def score(response, problem):\n    return numpy.float32(0.5)\n")
    assert verify.reward_scorer(train.Config(reward=f"{module}:flag"), problems)("yes", problems[0]).reward == 1.0
    assert verify.reward_scorer(train.Config(reward=f"{module}:score"), problems)("x", problems[0]).reward == 0.5


def test_a_pluggable_reward_drives_rollouts_and_evaluation(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the spec's path is relative to the repository, as the README runs it
    seen = []
    original = verify.load_callable

    def spying(spec):
        fn = original(spec)
        return lambda response, problem: seen.append(problem.id) or fn(response, problem)
    monkeypatch.setattr(verify, "load_callable", spying)
    data = tmp_path / "capitals.jsonl"
    shutil.copy(os.path.join(ROOT, "examples", "capitals.jsonl"), data)
    cfg = tiny_config(tiny_model, tmp_path, algo="grpo", max_steps=1, save_every=0, reward=EXAMPLE,
                      train_data=str(data), dev_data=str(data), eval_k=0)
    train.train(cfg)
    ids = {p.id for p in load_jsonl(str(data))[0]}
    assert len(seen) >= 1 + 3 * 4 + 2 * len(ids) and set(seen) <= ids  # start-up try, rollouts, two dev evaluations
    problem = Problem("capital-ar", "What is the capital of Argentina?", "Buenos Aires")
    from rollout import Sample

    record = score_groups([problem], [[{"content": "q"}]], [[Sample([1], [2], "\\boxed{Buenos Aires}", "stop")]],
                          reward=EXAMPLE)[0]
    assert record["rewards"] == [1.0] and record["reasons"] == ["custom"]


def test_a_sibling_method_is_a_row_kind_a_term_and_two_hooks(tiny_model, tmp_path, monkeypatch):
    """All a fork writes for 'imitate the correct rollouts of the groups GRPO barely learns from'
    (docs/METHOD.md §10): its rows (auxiliary_rows) and its term (aux_terms). GRPO is untouched."""
    import dist

    def imitation_rows(run, groups, step):
        return [train.Row(s.prompt_ids, s.response_ids, 0.0, group=gi, kind="imitate")
                for gi, g in enumerate(groups) if gi % dist.world() == dist.rank() and sum(g.rewards) < 2
                for s, r in zip(g.samples, g.rewards) if r > 0]
    monkeypatch.setattr(train, "auxiliary_rows", imitation_rows)
    monkeypatch.setattr(train, "aux_terms", lambda cfg: [train.AuxTerm("imitate", "imitate", 0.1, lambda logp, b: -logp)])
    train.train(tiny_config(tiny_model, tmp_path, max_steps=2, save_every=0), reward_fn=parity_reward)
    metrics = read_metrics(tmp_path / "t")
    assert any(m.get("loss_imitate", 0) > 0 for m in metrics)
    assert all(m["loss"] == pytest.approx(m["loss_policy"] + m.get("loss_imitate", 0), abs=1e-5) for m in metrics)
