"""shaping.py: the agreement bonus and CLIPO on hand-computed values, the released loss against
an independent float64 transcription, the groups that must stay untouched, and the CLIPO
shaper's state (exact resume, the same bonuses on every rank)."""

import io
import math


import pytest
import torch

from shaping import Clipo, agreement, agreement_bonuses, apply_shapers, clipo_bonuses, draw_positives, infonce_losses


class G:  # a group as the shapers read it
    def __init__(self, rewards, responses=None):
        self.rewards, self.bonus = rewards, None
        self.samples = [type("S", (), {"response_ids": r})() for r in (responses or [[1]] * len(rewards))]


def test_agreement_docstring_example():
    responses = [[1, 2, 3, 4], [1, 2, 3, 5], [7, 7], [9, 9, 9, 9]]
    bonus = agreement_bonuses(responses, [1.0, 1.0, 0.0, 1.0], weight=0.2, cap=0.1, n=2)
    assert bonus == pytest.approx([0.05, 0.05, 0.0, 0.0])
    assert agreement_bonuses(responses, [1.0, 1.0, 0.0, 1.0], weight=2.0, cap=0.1, n=2) == pytest.approx(
        [0.1, 0.1, 0.0, 0.0])  # capped


@pytest.mark.parametrize("rewards", [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
def test_groups_with_fewer_than_two_correct_or_no_wrong_are_untouched(rewards):
    assert agreement_bonuses([[1, 2]] * 4, rewards, 0.2, 0.1) is None
    clipo = Clipo(hidden_size=6, dim=4)
    groups = [G(rewards)]
    bonuses, logs = clipo(groups, lambda: pytest.fail("no eligible group: no forward"))
    assert bonuses == [None] and logs["clipo_anchors"] == 0
    assert apply_shapers([clipo], groups, lambda: None) == {"shaping_clipo_anchors": 0} and groups[0].bonus is None


def hand_sim():
    """2 correct (A, B) then 2 wrong (C, D); cosines s_AB 0.9, s_AC = s_AD 0.85, s_BC = s_BD 0.8,
    s_CD 0.3, unit diagonal."""
    s = torch.tensor([[1.0, 0.9, 0.85, 0.85], [0.9, 1.0, 0.8, 0.8], [0.85, 0.8, 1.0, 0.3], [0.85, 0.8, 0.3, 1.0]],
                     dtype=torch.float64)
    return s, torch.tensor([True, True, False, False]), torch.tensor([1, 0, 0, 0])


def test_textbook_infonce_and_bonuses_by_hand():
    """tau 0.05: L_A = -18 + log(e^18 + 2 e^17) = log(1 + 2/e) = 0.5514; L_B = log(1 + 2/e^2) = 0.2395.
    Bonuses max(-0.2 L, -0.5): -0.1103, -0.0479, and 0 for the wrong rollouts."""
    sim, correct, positive = hand_sim()
    losses = infonce_losses(sim, correct, positive, tau=0.05, released=False)
    assert losses.tolist() == pytest.approx([math.log(1 + 2 / math.e), math.log(1 + 2 / math.e ** 2), 0, 0])
    assert losses[:2].tolist() == pytest.approx([0.5514, 0.2395], abs=1e-4)
    assert clipo_bonuses(losses, correct) == pytest.approx([-0.1103, -0.0479, 0.0, 0.0], abs=1e-4)
    assert clipo_bonuses(torch.tensor([4.0, 1.0, 0.0, 0.0]), correct) == pytest.approx([-0.5, -0.2, 0, 0])  # the cap


def released_by_hand(sim, correct, positive, tau):
    """The release's loss for one group, transcribed independently in float64 Python: the row max
    (self included) shifts the logits, the positive's shifted logit against the log of the sum of
    every other member's shifted exponential plus 1e-8."""
    out = []
    for i in range(len(correct)):
        if not correct[i]:
            out.append(0.0)
            continue
        row = [sim[i][j] / tau for j in range(len(correct))]
        m = max(row)
        denominator = sum(math.exp(row[j] - m) for j in range(len(correct)) if j != i)
        out.append(-(row[positive[i]] - m) + math.log(denominator + 1e-8))
    return out


def test_released_loss_matches_a_transcription_and_differs_at_low_similarity():
    rng = torch.Generator().manual_seed(0)
    for trial in range(20):
        z = torch.nn.functional.normalize(torch.randn(6, 5, generator=rng, dtype=torch.float64), dim=1)
        correct = torch.tensor([True, True, True, False, False, trial % 2 == 0])
        positive = draw_positives(correct, rng)
        sim = z @ z.T
        want = released_by_hand(sim.tolist(), correct.tolist(), positive.tolist(), 0.05)
        assert infonce_losses(sim, correct, positive, 0.05, released=True).tolist() == pytest.approx(want, rel=1e-9)
    sim, correct, positive = hand_sim()  # high similarity: the epsilon is negligible
    released, textbook = (infonce_losses(sim, correct, positive, 0.05, released=r) for r in (True, False))
    assert released.tolist() == pytest.approx(textbook.tolist(), abs=1e-6)
    zero = torch.eye(4, dtype=torch.float64)  # every cosine 0: log 3 textbook, log(3 + 1e-8 e^20) released
    assert infonce_losses(zero, correct, positive, 0.05, released=False)[0].item() == pytest.approx(math.log(3))
    assert infonce_losses(zero, correct, positive, 0.05)[0].item() == pytest.approx(math.log(3 + 1e-8 * math.exp(20)))


def test_positives_are_other_correct_rollouts_drawn_uniformly():
    correct = torch.tensor([True, False, True, True])
    g = torch.Generator().manual_seed(1)
    drawn = torch.stack([draw_positives(correct, g) for _ in range(3000)])  # [3000, 4]
    for i in (0, 2, 3):
        others = [j for j in (0, 2, 3) if j != i]
        assert set(drawn[:, i].tolist()) == set(others)
        assert (drawn[:, i] == others[0]).float().mean().item() == pytest.approx(0.5, abs=0.04)


def clipo_groups():
    return [G([1.0, 1.0, 0.0, 0.0]), G([1.0, 0.0, 0.0, 0.0]), G([1.0, 1.0, 1.0, 0.0])]


def features_for(groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    return lambda: [torch.randn(len(x.rewards), 6, generator=g) for x in groups]


def test_clipo_shapes_correct_rollouts_of_eligible_groups_and_trains_only_its_head():
    clipo = Clipo(hidden_size=6, dim=4, seed=3)
    before = clipo.head.weight.detach().clone()
    groups = clipo_groups()
    bonuses, logs = clipo(groups, features_for(groups))
    assert bonuses[1] is None  # one correct rollout: untouched
    for b, g in zip((bonuses[0], bonuses[2]), (groups[0], groups[2])):
        assert all(-0.5 <= x <= 0 for x in b)
        assert all(x == 0 for x, r in zip(b, g.rewards) if r == 0) and any(x < 0 for x in b)
    assert logs["clipo_anchors"] == 5 and logs["clipo_head_loss"] > 0
    assert not torch.equal(before, clipo.head.weight)  # one AdamW step of the head


def test_clipo_state_resumes_exactly_and_two_copies_agree():
    a, b = Clipo(hidden_size=6, dim=4, seed=3), Clipo(hidden_size=6, dim=4, seed=3)
    groups = clipo_groups()
    first_a, first_b = a(groups, features_for(groups, 1)), b(groups, features_for(groups, 1))
    assert first_a == first_b  # same seed, same features: the same bonuses on every rank
    buffer = io.BytesIO()  # through a file, as a checkpoint keeps it
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    c = Clipo(hidden_size=6, dim=4, seed=99)
    c.load_state_dict(saved)
    assert a(groups, features_for(groups, 2)) == c(groups, features_for(groups, 2))  # head, AdamW and draws restored
    assert torch.equal(a.head.weight, c.head.weight)


def test_apply_shapers_sums_bonuses_and_computes_features_once():
    calls = []

    def features():
        calls.append(1)
        return ["h"]

    def one(groups, feats):
        assert feats() == ["h"]
        return [[0.1, 0.0]], {"x": 1}

    def two(groups, feats):
        feats()
        return [[-0.05, 0.2]], {}
    groups = [G([1.0, 0.0])]
    assert apply_shapers([one, two], groups, features) == {"shaping_x": 1}
    assert groups[0].bonus == pytest.approx([0.05, 0.2]) and len(calls) == 1 and groups[0].rewards == [1.0, 0.0]


def test_agreement_shaper_reads_token_ids_and_never_the_features():
    groups = [G([1.0, 1.0, 0.0], [[1, 2, 3], [1, 2, 3], [4, 5, 6]]), G([0.0, 0.0, 0.0])]
    bonuses, _ = agreement(groups, lambda: pytest.fail("no features needed"), weight=0.05, cap=1.0)
    assert bonuses == [pytest.approx([0.05, 0.05, 0.0]), None]
