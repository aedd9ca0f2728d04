"""S↓, S↑ and the shift against a literal transcription of spiralformer.txt Eq. (12-22)."""

from __future__ import annotations

import pytest
import torch

from looplm.mixers import MixerContext
from looplm.modules.rotary import Rotary
from looplm.resolution import (
    AllocationRouter,
    IterationResolution,
    MeanPool,
    SelfAggregation,
    UniformBroadcast,
    causal_right_shift,
)
from looplm.resolution.config import ResolutionConfig
from looplm.resolution.recursion import MultiResolution

D = 8


def _reference(h, it: IterationResolution, down, up, core):
    """Algorithm 1 lines 5-8 written position by position from Eq. (12-22)."""
    B, L, d = h.shape
    g, w = it.chunk, it.offset
    n = it.complete_chunks(L)
    chunks = [[i for i in range(L) if (i + w) // g == j] for j in range(n)]  # I_{t,j}, Eq. (14-15)
    z = []
    for members in chunks:
        x = h[:, members]  # [B, |I_j|, d]
        if isinstance(down, SelfAggregation):
            alpha = torch.softmax(down.scorer(x).squeeze(-1), dim=-1)  # Eq. (17), softmax over I_j
            z.append(torch.einsum("bk,bkd->bd", alpha, x))  # Eq. (18)
        else:
            z.append(x.sum(1) / g)  # Eq. (16)
    z_hat = core(torch.stack(z, 1)) if n else h[:, :0]
    u = torch.zeros_like(h)
    for i in range(L):
        j = (i + w) // g
        if j >= n:
            continue  # the incomplete last chunk is dropped
        rho = (i + w) - g * j
        if isinstance(up, AllocationRouter):
            beta = torch.softmax(up.router(z_hat[:, j]), dim=-1)[:, rho, None]  # Eq. (21)
        else:
            beta = 1.0 / g  # Eq. (20)
        u[:, i] = g**0.5 * beta * z_hat[:, j]  # Eq. (19), λ = √g
    return causal_right_shift(u, it.shift)  # Eq. (22)


def _fused(h, it, down, up, core):
    """The model's path: MultiResolution.down -> core -> up on one iteration."""
    res = MultiResolution(ResolutionConfig(), (1,), 32)
    res.schedule = (it,)
    res.down_ops = torch.nn.ModuleDict({"0": down})
    res.up_ops = torch.nn.ModuleDict({"0": up})
    B, L, _ = h.shape
    ctx = MixerContext(rope=(h.new_zeros(B, L, 0),) * 2, valid=torch.ones(B, L, dtype=torch.bool), past=0, padded=False)
    step = res.down(0, h, ctx, Rotary(0, 1e4), None)
    return res.up(0, step, core(step.z) if step.z.shape[1] else step.z, None)


def test_fused_path_compiles_to_the_same_values():
    """S↓ -> core -> S↑ with the shift under torch.compile (inductor): its chunk indices once
    formed an expression inductor could not range-check. Forward and input gradient."""
    torch.manual_seed(0)
    it = IterationResolution(4, 2, 3)
    res = MultiResolution(ResolutionConfig(), (1,), D)
    res.schedule = (it,)
    res.down_ops = torch.nn.ModuleDict({"0": SelfAggregation(D)})
    res.up_ops = torch.nn.ModuleDict({"0": AllocationRouter(D, 4)})
    ctx = MixerContext(rope=(torch.zeros(2, 13, 0),) * 2, valid=torch.ones(2, 13, dtype=torch.bool), past=0,
                       padded=False)

    def run(h):
        step = res.down(0, h, ctx, Rotary(0, 1e4), None)
        return res.up(0, step, _causal_core(step.z), None)

    h = torch.randn(2, 13, D, requires_grad=True)
    eager = run(h)
    compiled = torch.compile(run)(h)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(torch.autograd.grad(compiled.sum(), h)[0], torch.autograd.grad(eager.sum(), h)[0])


def _causal_core(z):
    """A causal stand-in for f_core: cumulative mean over chunks, then tanh."""
    return torch.tanh(z.cumsum(1) / torch.arange(1, z.shape[1] + 1)[None, :, None])


GRID = [(g, w, s) for g in (2, 3, 4, 8) for w in sorted({0, g // 2, g - 1}) for s in (g - 1, g, g + 3)]


@pytest.mark.parametrize("g,w,s", GRID)
@pytest.mark.parametrize("kinds", [("aggregate", "router"), ("mean", "uniform")])
def test_fused_path_equals_equations(g, w, s, kinds):
    torch.manual_seed(g * 100 + w * 10 + s)
    it = IterationResolution(g, w, s)
    down = SelfAggregation(D) if kinds[0] == "aggregate" else MeanPool()
    up = AllocationRouter(D, g) if kinds[1] == "router" else UniformBroadcast(g)
    for L in (1, g - 1, 3 * g + 1):
        h = torch.randn(2, max(L, 1), D)
        torch.testing.assert_close(_fused(h, it, down, up, _causal_core), _reference(h, it, down, up, _causal_core))


def _dependencies(it: IterationResolution, L: int, path=_fused) -> torch.Tensor:
    """dep[i, k]: whether ũ_i changes when h_k does (row k of one batch perturbs position k)."""
    torch.manual_seed(0)
    down, up = SelfAggregation(D), AllocationRouter(D, it.chunk)
    h = torch.randn(1, L, D)
    perturbed = h.repeat(L, 1, 1)
    perturbed[torch.arange(L), torch.arange(L)] += 1.0
    with torch.no_grad():
        base, out = path(h, it, down, up, _causal_core), path(perturbed, it, down, up, _causal_core)
    return ((out - base).abs().amax(-1) > 1e-6).T  # [L (i), L (k)]


@pytest.mark.parametrize("g,w,s", [(g, w, s) for g, w, s in GRID if g > 1])
def test_shift_of_at_least_g_minus_1_is_strictly_causal(g, w, s):
    dep = _dependencies(IterationResolution(g, w, s), 4 * g + 2)
    L = dep.shape[0]
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    assert not (dep & future).any(), "ũ_i must not depend on h_k for k > i (Prop. 1(2)-(3))"
    own_chunk = torch.tensor([[(i + w) // g == (k + w) // g for k in range(L)] for i in range(L)])
    overlap = (dep & own_chunk).any(dim=1)
    if s >= g:  # Prop. 1(3): no position reads its own chunk
        assert not overlap.any()
    else:  # Prop. 1(2): exactly the last position of each complete chunk reads its own chunk
        expected = torch.tensor([(i + w) % g == g - 1 and i >= s for i in range(L)])
        assert torch.equal(overlap, expected)


@pytest.mark.parametrize("g", [3, 4, 8])
@pytest.mark.parametrize("w", [0, 1])
def test_shift_of_g_minus_2_is_not_causal(g, w):
    """Prop. 1(1): the threshold is tight, which is why config load refuses s <= g - 2."""
    dep = _dependencies(IterationResolution(g, w, g - 2), 4 * g + 2, path=_reference)
    assert (dep & torch.ones_like(dep).triu(1)).any()


def test_parallel_regime_reads_only_earlier_chunks_finished_before():
    """Appendix E: with s >= g the latent a position reads completed at an earlier position,
    so its coarse work never waits for the current token."""
    for g in (2, 4, 8):
        for w in (0, g // 2):
            for s in (g, g + 1, 2 * g):
                it = IterationResolution(g, w, s)
                assert it.parallel
                for i in range(s, 6 * g):
                    src = it.source_chunk(i)
                    assert src < it.chunk_index(i) and it.trigger(src) < i
            it = IterationResolution(g, w, g - 1)
            readers = [i for i in range(g - 1, 6 * g) if it.trigger(it.source_chunk(i)) == i]
            assert readers == [i for i in range(g - 1, 6 * g) if it.in_chunk(i) == g - 1]


def test_identity_at_full_resolution():
    h = torch.randn(2, 7, D)
    out = _fused(h, IterationResolution(1, 0, 0), MeanPool(), UniformBroadcast(1), lambda z: z * 3)
    torch.testing.assert_close(out, h * 3)
