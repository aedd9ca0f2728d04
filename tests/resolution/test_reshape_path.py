"""S↓ by reshape, S↑ by broadcast, the router on the chunk latents (issue 25): the same
logits, gradients and decoding as the gather / index_select implementation they replaced,
kept here as the reference (``reference_down`` / ``reference_up``, main's code before the
change), and what a training step launches."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest
import torch

from looplm import LoopCache, LoopLM
from looplm.accounting.dispatch import count_dispatch
from looplm.config import load_config
from looplm.model_config import ModelConfig
from looplm.resolution import AllocationRouter, ChunkState, Compressed, SelfAggregation
from tests.conftest import random_ids, tiny_config

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------- the replaced implementation


def reference_down(self, t, h, ctx, rotary, cache):
    """MultiResolution.down before issue 25: two concatenations, a mask, rotary per call."""
    it = self.schedule[t]
    B, T, d = h.shape
    P = ctx.past
    previous = cache.chunk(t) if cache is not None else None
    g, done = it.chunk, it.complete_chunks(P)
    total = it.complete_chunks(P + T)
    pending = previous.pending if previous is not None else h[:, :0]
    tokens = torch.cat([pending, h], dim=1)
    tokens_start = it.chunk_start(done)
    lead = tokens_start - (done * g - it.offset)
    n = total - done
    grid = torch.cat([tokens.new_zeros(B, lead, d), tokens], dim=1)[:, : n * g]
    x = grid.reshape(B, n, g, d)
    mask = torch.ones(n, g, dtype=torch.bool, device=h.device)
    if n and lead:
        mask[0, :lead] = False
    down = self.down_ops[str(t)]
    if isinstance(down, SelfAggregation):
        scores = down.scorer(x).squeeze(-1).float().masked_fill(~mask[None], float("-inf"))
        alpha = torch.softmax(scores, dim=-1).to(x.dtype)
        z = torch.einsum("bng,bngd->bnd", alpha, x)
    else:
        z = (x * mask[None, :, :, None]).sum(dim=2) / g
    positions = torch.arange(done, total, device=h.device).expand(B, n)
    zctx = dataclasses.replace(ctx, rope=rotary(positions, h.dtype),
                               valid=torch.ones(B, total, dtype=torch.bool, device=h.device),
                               past=done, padded=False, _masks={})
    return Compressed(z, zctx, done, tokens, tokens_start, P, previous)


def reference_up(self, t, step, z_hat, cache):
    """MultiResolution.up before issue 25: index_select of every position's latent, the
    router at all T positions and a gather of β, the shift as a mask multiply."""
    it = self.schedule[t]
    B, _, d = step.tokens.shape
    T = step.tokens.shape[1] - (step.start - step.tokens_start)
    old = step.previous.latents if step.previous is not None else z_hat[:, :0]
    latents = torch.cat([old, z_hat], dim=1)
    source = torch.arange(step.start, step.start + T, device=z_hat.device) - it.shift
    if latents.shape[1] == 0:
        u = z_hat.new_zeros(B, T, d)
    else:
        z_src = latents.index_select(1, it.chunk_index(source).clamp(min=0))
        rho = it.in_chunk(source)
        up = self.up_ops[str(t)]
        if isinstance(up, AllocationRouter):
            beta = torch.softmax(up.router(z_src).float(), dim=-1).to(z_src.dtype)
            weight = beta.gather(-1, rho[None, :, None].expand(B, -1, 1))
            u = up.gain * weight * z_src
        else:
            u = z_src * (up.gain / up.chunk)
        u = u * (source >= 0)[None, :, None].to(u.dtype)
    if cache is not None:
        N, end = latents.shape[1], step.start + T
        keep = it.chunk_start(N) - step.tokens_start
        triggers = list(step.previous.triggers) if step.previous is not None else []
        triggers += [it.trigger(j) for j in range(step.first, N)]
        cache.set_chunk(t, ChunkState(it, step.tokens[:, keep:], latents, end, triggers))
    return u


def with_reference(model: LoopLM) -> LoopLM:
    """The same model (shared parameters) running the replaced S↓ / S↑."""
    twin = LoopLM(model.cfg)
    twin.load_state_dict(model.state_dict())
    twin.train(model.training)
    twin.resolution.down = types.MethodType(reference_down, twin.resolution)
    twin.resolution.up = types.MethodType(reference_up, twin.resolution)
    return twin


# ----------------------------------------------------------------- configurations

C2F, F2C = "1+1x{1/8,1/4,1/2,1}+1", "1+1x{1,1/2,1/4,1/8}+1"
CASES = {
    "spiralformer-b-tiny": load_config("spiralformer-b-tiny").model,
    "spiralformer-l-tiny": load_config("spiralformer-l-tiny").model,
    "b-benchmark-layout": tiny_config("mesh", layout="2+1x{1/8,1/4,1/2,1}+2"),
    "mean-uniform": tiny_config("mesh", layout=C2F, resolution={"down": "mean", "up": "uniform"}),
    "aggregate-uniform": tiny_config("anchor", layout=C2F, resolution={"down": "aggregate", "up": "uniform"}),
    "mean-router-f2c": tiny_config("residual", layout=F2C, resolution={"down": "mean", "up": "router"}),
    "offsets-0": tiny_config("mesh", layout=C2F, resolution={"offsets": [0, 0, 0, 0]}),
    "offsets-max": tiny_config("mesh", layout=C2F, resolution={"offsets": [7, 3, 1, 0]}),
    "parallel": tiny_config("mesh", layout=C2F, resolution={"shifts": [8, 4, 2, 1]}),
    "parallel-wide-mean": tiny_config("anchor", layout=C2F, resolution={"down": "mean", "shifts": [11, 6, 3, 2]}),
    "odd-chunks": tiny_config("static_combination", layout="1x{1/3,1/5}+1",
                              resolution={"offsets": [2, 4], "shifts": [5, 4]}),
    "unshared-l-shape": tiny_config("dynamic_combination", layout="2+1x{1/16,1/8,1/4,1/2}+1", share_core=False),
}
IDS = list(CASES)


def _model(name: str) -> LoopLM:
    torch.manual_seed(0)
    model = LoopLM(CASES[name])
    with torch.no_grad():  # routers and scorers away from their zero-ish init, so β and α vary
        for p in model.resolution.parameters():
            p.normal_(0, 0.5)
    return model


def _loss_and_grads(model: LoopLM, x, y):
    out = model(x, y)
    out.loss.backward()
    return out.logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", IDS)
@pytest.mark.parametrize("length", [3, 13, 40])
def test_training_logits_and_gradients_equal_the_replaced_implementation(name, length):
    model = _model(name)
    reference = with_reference(model)
    vocab = model.cfg.vocab_size
    x, y = random_ids(2, length, vocab=vocab, seed=length), random_ids(2, length, vocab=vocab, seed=length + 1)
    logits, grads = _loss_and_grads(model, x, y)
    ref_logits, ref_grads = _loss_and_grads(reference, x, y)
    torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=1e-6)
    params = dict(model.named_parameters())
    for key in grads.keys() | ref_grads.keys():  # no chunk complete (L < g − ω): S↓ is skipped, not run on nothing
        zero = torch.zeros_like(params[key])
        torch.testing.assert_close(grads.get(key, zero), ref_grads.get(key, zero), atol=1e-6, rtol=1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")


def _decode(model, x, ends):
    cache, start, pieces = LoopCache(), 0, []
    for end in ends:
        pieces.append(model(x[:, start:end], cache=cache).logits)
        start = end
    return torch.cat(pieces, dim=1), cache


@pytest.mark.parametrize("name", ["spiralformer-b-tiny", "mean-uniform", "offsets-max", "parallel-wide-mean",
                                  "odd-chunks"])
def test_decoding_equals_the_replaced_implementation(name):
    """Prefill + token-by-token and chunked prefill: the same logits and chunk states as the
    replaced code, and as one full forward; the coarse core runs at the same triggers."""
    model = _model(name).eval()
    reference = with_reference(model).eval()
    vocab = model.cfg.vocab_size
    x = random_ids(2, 26, vocab=vocab, seed=7)
    with torch.no_grad():
        full = model(x).logits
        for ends in ([5, *range(6, 27)], [3, 4, 13, 17, 26]):
            out, cache = _decode(model, x, ends)
            ref, ref_cache = _decode(reference, x, ends)
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(out, full, atol=2e-5, rtol=1e-5)
            assert cache.coarse_triggers() == ref_cache.coarse_triggers()
            for t, chunk in cache.chunks.items():
                torch.testing.assert_close(chunk.latents, ref_cache.chunks[t].latents, atol=1e-6, rtol=1e-6)
                assert torch.equal(chunk.pending, ref_cache.chunks[t].pending)


# ----------------------------------------------------------------- what a training step launches


def _benchmark_variants():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_throughput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return train_throughput.VARIANTS


def _step_count(fields, device: str = "cpu", length: int = 128):
    """Operators and host syncs of one forward + backward at d = 64, T = ``length`` (as issue
    25 counts them: gradients not yet allocated, as after zero_grad(set_to_none=True))."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict({"d_model": 64, "n_heads": 4, "max_seq_len": 128, "vocab_size": 257, **fields},
                                prefix="model")
    model = LoopLM(cfg).to(device)
    x, y = (random_ids(2, length, vocab=257, seed=seed).to(device) for seed in (0, 1))
    counts, _ = count_dispatch(lambda: model(x, y).loss.backward())
    return counts


#: ops(SpiralFormer-B) − ops(its full-resolution loop) for the benchmark pair, measured once
#: this path landed (before: 192, from 854 − 662). Per compressed iteration: S↓ (pad, scorer,
#: −∞ pad, softmax, weighted sum) and S↑ (router, softmax, λβ, β ẑ, shift pad) and their backward.
RESOLUTION_OVERHEAD = 96


def test_a_compressed_iteration_launches_only_its_down_and_up_scaling():
    variants = _benchmark_variants()
    spiral, full = _step_count(variants["spiral"]), _step_count(variants["spiral-full"])
    extra = spiral.by_op.copy()
    extra.subtract(full.by_op)
    extra = {op: n for op, n in extra.items() if n}
    detail = f"spiral {spiral}; full {full}; extra {extra}"
    assert spiral.syncs == 0 and full.syncs == 0, detail
    assert spiral.ops - full.ops <= RESOLUTION_OVERHEAD, detail
    bookkeeping = {"aten.cat", "aten.index_select", "aten.gather", "aten.scatter_add", "aten.index_add",
                   "aten.arange", "aten.masked_fill", "aten.cos", "aten.sin", "aten._to_copy", "aten.new_zeros"}
    assert not bookkeeping & set(extra), detail
