"""LT2's KD loss (Eq. kd-loss) against a hand computation, its w_t and length schedules."""

from __future__ import annotations

import math

import pytest
import torch

from looplm.distill.losses import kd_loss, length_at, loop_weights, split_length, topk_kl


def _hand_kl(t_logits, s_logits, k, temp):
    """KL(σ_top-k(t/T) ‖ σ_top-k(s/T)) for one position, with plain Python math."""
    top = sorted(range(len(t_logits)), key=lambda i: -t_logits[i])[:k]
    zt = sum(math.exp(t_logits[i] / temp) for i in top)
    zs = sum(math.exp(s_logits[i] / temp) for i in top)
    p = {i: math.exp(t_logits[i] / temp) / zt for i in top}
    q = {i: math.exp(s_logits[i] / temp) / zs for i in top}
    return sum(p[i] * math.log(p[i] / q[i]) for i in top)


TEACHER = [[[2.0, -1.0, 0.5, 3.0, 0.0], [0.1, 0.2, -0.3, 1.5, -2.0]]]  # [B=1, L=2, V=5]
STUDENT = [[[1.0, 2.0, 0.0, 2.5, -1.0], [0.5, -0.5, 1.0, 0.0, 0.3]]]


def test_topk_kl_equals_hand_computation_with_renormalisation():
    k, temp = 3, 2.0
    got = topk_kl(torch.tensor(TEACHER), torch.tensor(STUDENT), k, temp).item()
    hand = sum(_hand_kl(t, s, k, temp) for t, s in zip(TEACHER[0], STUDENT[0])) / 2
    assert got == pytest.approx(hand, rel=1e-5)
    # renormalisation matters: the full-vocabulary KL is a different number
    full = sum(_hand_kl(t, s, 5, temp) for t, s in zip(TEACHER[0], STUDENT[0])) / 2
    assert abs(full - hand) > 1e-3
    assert topk_kl(torch.tensor(TEACHER), torch.tensor(STUDENT), 5, temp).item() == pytest.approx(full, rel=1e-5)


def test_topk_kl_leaves_out_ignored_positions():
    targets = torch.tensor([[4, -100]])
    got = topk_kl(torch.tensor(TEACHER), torch.tensor(STUDENT), 3, 1.0, targets).item()
    assert got == pytest.approx(_hand_kl(TEACHER[0][0], STUDENT[0][0], 3, 1.0), rel=1e-5)


def test_loop_weights_follow_the_paper_schedule():
    # S = 20 steps, T = 4 loops: warm-up 2 steps, uniform 10 steps, then the final loop only
    w = lambda step: loop_weights(step, 20, 4, "per_loop", 0.1, 0.5)  # noqa: E731
    assert w(0) == [0.0, 0.0, 0.0, 1.0]
    assert w(1) == pytest.approx([0.125, 0.125, 0.125, 0.625])  # half way from e_T to uniform
    for step in (2, 7, 11):
        assert w(step) == [0.25] * 4
    for step in (12, 19):
        assert w(step) == [0.0, 0.0, 0.0, 1.0]
    assert all(sum(w(s)) == pytest.approx(1.0) for s in range(20))  # w_t lies in the simplex
    assert loop_weights(5, 20, 4, "final", 0.1, 0.5) == [0.0, 0.0, 0.0, 1.0]
    assert loop_weights(5, 20, 1, "per_loop", 0.1, 0.5) == [1.0]


def test_kd_loss_is_the_weighted_sum_over_loops_times_t_squared():
    g = torch.Generator().manual_seed(0)
    teacher = [torch.randn(2, 3, 7, generator=g) for _ in range(3)]
    student = [torch.randn(2, 3, 7, generator=g) for _ in range(3)]
    weights, k, temp = [0.2, 0.0, 0.8], 4, 1.5
    per_loop = []
    for t, s in zip(teacher, student):
        rows = [(t[b, i].tolist(), s[b, i].tolist()) for b in range(2) for i in range(3)]
        per_loop.append(sum(_hand_kl(a, c, k, temp) for a, c in rows) / len(rows))
    hand = temp ** 2 * sum(w * kl for w, kl in zip(weights, per_loop))
    assert kd_loss(teacher, student, weights, k, temp, scale_t2=True).item() == pytest.approx(hand, rel=1e-5)
    unscaled = kd_loss(teacher, student, weights, k, temp, scale_t2=False).item()
    assert unscaled == pytest.approx(hand / temp ** 2, rel=1e-5)


def test_progressive_length_phases_and_split():
    lengths = (8, 16, 32)
    assert [length_at(s, 9, lengths) for s in range(9)] == [8, 8, 8, 16, 16, 16, 32, 32, 32]
    x = torch.arange(2 * 32).view(2, 32)
    pieces = split_length(x, 8)
    assert pieces.shape == (8, 8) and torch.equal(pieces.flatten(), x.flatten())
