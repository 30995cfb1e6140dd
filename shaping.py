"""Reward shaping: per-rollout bonuses added to the verified reward where GRPO forms its
advantages, and nowhere else (shaping.apply_shapers, docs/METHOD.md §10). A shaper is any callable
shaper(groups, features) -> (bonuses, logs): per group K floats or None (untouched), and scalars
to log. `features()` gives each group's [K, H] mean final hidden states of its rollouts, under
the original prompt, from the pre-update policy (computed once a step, only if a shaper asks).

Two ship here, both on the group's CORRECT rollouts only and only in groups that also hold a
wrong one (an all-correct group would have its tiny bonus differences blown up to +-1 advantages
by the group's standard deviation; shaped groups keep their correct answers above the wrong):

  agreement  ours (RoAR's idea, not its definition, which we could not read): a correct
             rollout's mean token-n-gram Jaccard similarity to the group's other correct
             rollouts, times a weight, capped (`agreement`)
  CLIPO      as released (Qwen-Applications/CLIPO): an InfoNCE loss among the group's rollouts
             on a trained projection of their hidden states; a correct rollout's bonus is
             max(-weight * loss, -cap) (`Clipo`)

    groups: one group, rewards [1, 1, 0, 1]; responses (token ids) a = [1, 2, 3, 4], b = [1, 2, 3, 5],
    d = [9, 9, 9, 9] (correct, n = 2): bigrams a {12, 23, 34}, b {12, 23, 35}, d {99}
    Jaccard(a, b) = 2 / 4, (a, d) = (b, d) = 0 -> mean over the others: a 0.25, b 0.25, d 0
    agreement(weight=0.2, cap=0.1) -> bonuses [0.05, 0.05, 0.0, 0.0]
"""

import torch


def apply_shapers(shapers, groups, features):
    """Reward shaping, the hook (train.train_step): each shaper(groups, features) -> (bonuses,
    logs): per group K floats or None (untouched), and scalars to log as shaping_<key>.
    `features()` is computed once, on the first call. The bonuses are summed into g.bonus; only
    the advantages read them (train.shaped_rewards). Under torchrun every rank calls every shaper
    on the same groups and features, so a deterministic shaper gives the same bonuses everywhere."""
    logs, cache = {}, []

    def cached():
        if not cache:
            cache.append(features())
        return cache[0]
    for shaper in shapers:
        bonuses, shaper_logs = shaper(groups, cached)
        logs.update({f"shaping_{k}": v for k, v in shaper_logs.items()})
        for g, b in zip(groups, bonuses):
            if b is not None:
                g.bonus = [x + y for x, y in zip(g.bonus or [0.0] * len(b), b)]
    return logs


def eligible(rewards):
    """A group is shaped when it holds at least two correct rollouts and at least one wrong one."""
    correct = sum(r > 0 for r in rewards)
    return correct >= 2 and correct < len(rewards)


# ----------------------------------------------------------------------------- the agreement bonus (ours)


def ngrams(tokens, n):
    """The set of the n-grams of a token list (a list shorter than n: itself, as one gram)."""
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)} or {tuple(tokens)}


def agreement_bonuses(responses, rewards, weight, cap, n=3):
    """One group: each correct rollout's bonus min(weight * mean_j J(i, j), cap), the mean of the
    Jaccard similarity |A & B| / |A | B| of its n-gram set with each OTHER correct rollout's;
    0 for a wrong rollout; None when the group is not shaped (`eligible`)."""
    if not eligible(rewards):
        return None
    grams = [ngrams(list(r), n) for r in responses]
    correct = [i for i, r in enumerate(rewards) if r > 0]
    bonus = [0.0] * len(rewards)
    for i in correct:
        sims = [len(grams[i] & grams[j]) / len(grams[i] | grams[j]) for j in correct if j != i]
        bonus[i] = min(weight * sum(sims) / len(sims), cap)
    return bonus


def agreement(groups, features, weight, cap, n=3):
    """The agreement shaper (train.make_shapers binds weight, cap and n): it reads the rollouts'
    token ids, not the hidden states."""
    bonuses = [agreement_bonuses([s.response_ids for s in g.samples], g.rewards, weight, cap, n) for g in groups]
    return bonuses, {}


# ----------------------------------------------------------------------------- CLIPO, as released


def infonce_losses(sim, correct, positive, tau=0.05, released=True):
    """One group's InfoNCE losses from the cosine similarities of its rollouts' embeddings.
    sim [K, K]; correct [K] bool; positive [K] long (anchor i's positive, another correct rollout;
    read at anchors only) -> [K], 0 off the anchors (the correct rollouts of an `eligible` group).

      textbook  L_i = -s_ip / tau + log sum_{j != i} exp(s_ij / tau)
      released  L_i = -(s_ip / tau - m_i) + log(sum_{j != i} exp(s_ij / tau - m_i) + 1e-8), m_i the
                row's max with the self-similarity in it (1 / tau for unit vectors): the 1e-8 is on
                the shifted scale, so it weighs 1e-8 e^{1/tau} ~ 4.85 against the sum and raises
                the loss where every similarity is low (all 0: log 3 -> 2.06 for K = 4)

    Every other member of the group (correct or not) is in the denominator, the positive too."""
    K = len(correct)
    logits = sim / tau  # [K, K]
    others = ~torch.eye(K, dtype=torch.bool, device=sim.device)
    pos = logits.gather(1, positive.view(K, 1)).squeeze(1)  # [K]
    if released:
        m = logits.max(dim=1, keepdim=True).values.detach()  # [K, 1]
        loss = -(pos - m.squeeze(1)) + torch.log(((logits - m).exp() * others).sum(1) + 1e-8)
    else:
        loss = -pos + torch.logsumexp(logits.masked_fill(~others, float("-inf")), dim=1)
    anchors = correct if eligible(correct.tolist()) else torch.zeros_like(correct)
    return torch.where(anchors, loss, torch.zeros_like(loss))


def draw_positives(correct, generator):
    """Each correct rollout's positive: another correct rollout of the group, uniformly (the
    release draws with torch.multinomial from its unseeded global generator; ours is seeded and
    checkpointed). [K] bool -> [K] long (0 for a wrong rollout, not read)."""
    others = (correct[None, :] & correct[:, None] & ~torch.eye(len(correct), dtype=torch.bool)).float()  # [K, K]
    drawn = torch.zeros(len(correct), dtype=torch.long)
    rows = others.sum(1) > 0
    if rows.any():
        drawn[rows] = torch.multinomial(others[rows], 1, generator=generator).squeeze(1)
    return drawn


def clipo_bonuses(losses, anchors, weight=0.2, cap=0.5):
    """max(-weight * L_i, -cap) on the anchors, 0 elsewhere: [K] -> list of K floats."""
    return torch.where(anchors, (-weight * losses).clamp(min=-cap), torch.zeros_like(losses)).tolist()


class Clipo:
    """CLIPO's shaper (docs/METHOD.md §10): a linear head without bias embeds each rollout's
    mean final hidden state (L2-normalised output); its InfoNCE losses within each group give the
    correct rollouts' bonuses (computed before the head's step, detached); then one AdamW step
    of the head on the mean loss over every anchor of the step (sum / (anchors + 1e-8)). Only
    the head trains. Its weights, optimizer and the positive-drawing generator are the state a
    checkpoint keeps (state_dict), so resume is exact; every rank holds the same head and draws
    the same positives from the same features, so the bonuses agree on every rank."""

    def __init__(self, hidden_size, dim=512, tau=0.05, weight=0.2, cap=0.5, lr=1e-3, weight_decay=0.01,
                 released=True, seed=0):
        with torch.random.fork_rng(devices=[]):  # the same initial head on every rank, the run's RNG untouched
            torch.manual_seed(seed)
            self.head = torch.nn.Linear(hidden_size, dim, bias=False)  # fp32, on the CPU (where the release's runs)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=lr, weight_decay=weight_decay)
        self.generator = torch.Generator().manual_seed(seed)
        self.tau, self.weight, self.cap, self.released = tau, weight, cap, released

    def __call__(self, groups, features):
        if not any(eligible(g.rewards) for g in groups):
            return [None] * len(groups), {"clipo_anchors": 0}
        total, anchors, bonuses = 0.0, 0, []
        for g, h in zip(groups, features()):
            if not eligible(g.rewards):
                bonuses.append(None)
                continue
            z = torch.nn.functional.normalize(self.head(h.float()), dim=1)  # [K, dim]
            correct = torch.tensor([r > 0 for r in g.rewards])
            losses = infonce_losses(z @ z.T, correct, draw_positives(correct, self.generator), self.tau, self.released)
            bonuses.append(clipo_bonuses(losses.detach(), correct, self.weight, self.cap))
            total, anchors = total + losses.sum(), anchors + int(correct.sum())
        head_loss = total / (anchors + 1e-8)
        self.optimizer.zero_grad(set_to_none=True)
        head_loss.backward()
        self.optimizer.step()
        return bonuses, {"clipo_head_loss": head_loss.item(), "clipo_anchors": anchors}

    def state_dict(self):
        return {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
