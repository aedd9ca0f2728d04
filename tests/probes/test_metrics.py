"""The probes' measures on constructed inputs with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from looplm.probes.attention import (
    attention_contribution, dynamic_heads, key_marginal_entropy, last_token_entropy, local_attention_mass,
)
from looplm.probes.mesh import cka, normalized_spectrum, relative_update, shared_subspace_variance
from looplm.probes.residual import first_token_mass, max_activation, rms_norm


def _orthogonal(d: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


@pytest.mark.parametrize("kernel", ["rbf", "linear"])
def test_cka_of_a_matrix_with_itself_is_one(kernel):
    x = torch.randn(20, 8, generator=torch.Generator().manual_seed(0))
    assert float(cka(x, x, kernel)) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("kernel", ["rbf", "linear"])
def test_cka_is_invariant_to_orthogonal_transforms_and_isotropic_scaling(kernel):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 6, generator=g, dtype=torch.float64), torch.randn(24, 10, generator=g, dtype=torch.float64)
    reference = float(cka(x, y, kernel))
    assert 0.0 < reference < 1.0
    assert float(cka(x @ _orthogonal(6, 2), y @ _orthogonal(10, 3), kernel)) == pytest.approx(reference, abs=1e-10)
    assert float(cka(3.5 * x, 0.2 * y, kernel)) == pytest.approx(reference, abs=1e-10)
    assert float(cka(x @ _orthogonal(6, 4), x, kernel)) == pytest.approx(1.0, abs=1e-10)


def test_cka_is_symmetric_and_low_for_unrelated_states():
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(200, 4, generator=g), torch.randn(200, 4, generator=g)
    assert float(cka(x, y)) == pytest.approx(float(cka(y, x)), abs=1e-12)
    assert float(cka(x, y)) < 0.1


def test_relative_update_on_constructed_tensors():
    h = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(relative_update(h, h), torch.zeros(3, dtype=torch.float64))
    assert torch.allclose(relative_update(h, -h), torch.full((3,), 2.0, dtype=torch.float64))  # 2·2‖h‖ / 2‖h‖
    assert torch.allclose(relative_update(h, 2 * h), torch.full((3,), 2 / 3, dtype=torch.float64))  # 2‖h‖ / 3‖h‖
    assert torch.allclose(relative_update(h, torch.zeros_like(h)), torch.full((3,), 2.0, dtype=torch.float64))
    # per sample: one sample changed, the others not
    f = h.clone()
    f[1] = -f[1]
    assert relative_update(h, f).tolist() == pytest.approx([0.0, 2.0, 0.0])


def _identity(L: int) -> torch.Tensor:
    return torch.eye(L)


def _previous_token(L: int) -> torch.Tensor:
    a = torch.zeros(L, L)
    a[0, 0] = 1.0
    a[torch.arange(1, L), torch.arange(L - 1)] = 1.0
    return a


def _sink(L: int) -> torch.Tensor:
    a = torch.zeros(L, L)
    a[:, 0] = 1.0
    return a


def _uniform_causal(L: int) -> torch.Tensor:
    a = torch.ones(L, L).tril()
    return a / a.sum(dim=-1, keepdim=True)


def test_key_marginal_entropy_on_hand_made_attention():
    L = 16
    assert float(key_marginal_entropy(_identity(L))) == pytest.approx(1.0)  # every key used equally
    assert float(key_marginal_entropy(_sink(L))) == pytest.approx(0.0, abs=1e-9)  # one key only
    # uniform causal attention: p(k) ∝ Σ_{q ≥ k} 1/(q + 1), computed by hand
    p = torch.tensor([sum(1 / (q + 1) for q in range(k, L)) for k in range(L)], dtype=torch.float64)
    p = p / p.sum()
    expected = float(-(p * p.log()).sum() / math.log(L))
    assert float(key_marginal_entropy(_uniform_causal(L))) == pytest.approx(expected)
    batched = torch.stack([_identity(L), _sink(L)])[None]  # [1, 2, L, L]
    assert key_marginal_entropy(batched).shape == (1, 2)


def test_local_attention_mass_on_hand_made_attention():
    L = 10
    assert float(local_attention_mass(_identity(L), window=3)) == pytest.approx(0.0)  # W(q) excludes q itself
    assert float(local_attention_mass(_previous_token(L), window=1)) == pytest.approx((L - 1) / L)
    # everything on key 0: local for queries 1..M only
    assert float(local_attention_mass(_sink(L), window=3)) == pytest.approx(3 / L)
    # queries that are the last T of S keys (a cached prefix)
    a = torch.zeros(2, 6)
    a[0, 3], a[1, 0] = 1.0, 1.0  # query 4 -> key 3 (local), query 5 -> key 0 (far)
    assert float(local_attention_mass(a, window=2)) == pytest.approx(0.5)


def test_last_token_entropy_on_hand_made_attention():
    L = 8
    assert float(last_token_entropy(_uniform_causal(L))) == pytest.approx(1.0)  # Eq. (4): uniform -> 1
    assert float(last_token_entropy(_sink(L))) == pytest.approx(0.0, abs=1e-9)
    a = torch.zeros(L, L)
    a[-1, :2] = 0.5
    assert float(last_token_entropy(a)) == pytest.approx(math.log(2) / math.log(L))


def test_attention_contribution_weighs_by_value_norm():
    attn = _uniform_causal(4)[None, None]  # [1, 1, 4, 4]
    values = torch.zeros(1, 1, 4, 2)
    values[..., 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert attention_contribution(attn, values)[0, 0].tolist() == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_dynamic_heads_are_the_top_forty_percent():
    delta = torch.tensor([[0.1, 0.9, 0.3, 0.0, 0.5]])
    assert dynamic_heads(delta).tolist() == [[False, True, False, False, True]]


def test_first_token_mass_max_activation_and_rms():
    attn = torch.stack([_sink(5), _identity(5)])[None]  # [1, 2, 5, 5]
    assert first_token_mass(attn).tolist() == pytest.approx([0.5])  # queries 1..4: head 0 all, head 1 none
    h = torch.tensor([[[3.0, 4.0], [0.0, 0.0]]])
    assert max_activation(h).tolist() == [4.0]
    assert rms_norm(h).tolist() == pytest.approx([(math.sqrt(12.5) + 0.0) / 2])


def test_spectrum_and_shared_subspace():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    s = normalized_spectrum(x)
    assert s.shape == (6,) and float(s[0]) == 1.0 and bool((s[1:] <= s[:-1]).all())
    rank_one = torch.randn(16, 1, generator=g) @ torch.randn(1, 6, generator=g)
    assert float(normalized_spectrum(rank_one)[1]) < 1e-6
    # two states in one shared 2-dimensional subspace: all their variance in 2 shared directions
    basis = torch.randn(2, 6, generator=g, dtype=torch.float64)
    states = [torch.randn(16, 2, generator=g, dtype=torch.float64) @ basis for _ in range(2)]
    cum = shared_subspace_variance(states)
    assert torch.allclose(cum[:, 1], torch.ones(2, dtype=torch.float64))
    assert bool((cum[:, 1:] >= cum[:, :-1] - 1e-12).all())
