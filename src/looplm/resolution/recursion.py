"""One multi-resolution iteration around the shared core (spiralformer.txt §2.2, Alg. 1-2).

    z = S↓(h^(t))  ->  ẑ = f_core(z) at resolution r_t  ->  ũ = shift(S↑(ẑ), s_t)  ->  U(ũ, ...)

The loop driver (``LoopLM._core``) calls :meth:`MultiResolution.down`, runs the core
blocks on the compressed sequence with the compressed :class:`MixerContext`, and hands
the result to :meth:`MultiResolution.up`; the topology then folds ũ into the state.

Training and decoding are one code path, chunk-triggered as in Algorithm 2: a forward over
new positions P .. P+T−1 down-scales only the chunks that complete among them (with the
buffered start of the current chunk from the cache), runs the core once on those new
chunks against the core's compressed-resolution mixer states, and gives every new
position the latent of chunk π(i − s) — already cached unless it completed in this
forward. A full forward is the case P = 0; a decoding step that completes no chunk runs
no coarse core at all.

Positions. The compressed sequence is just a shorter sequence for the mixer: chunk j sits
at position j (its chunk index) for rotary embeddings, in training and in decoding alike,
so the shared core sees relative distances in chunks at every resolution.

Padding. Chunks are cut by position index; with left padding they would be cut
differently per row and complete at different steps, so left-padded batches are refused
for multi-resolution iterations (ValueError). Prompts of different lengths can be
generated one row at a time.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import nn

from looplm.layout import Layout
from looplm.mixers.base import MixerContext
from looplm.resolution.config import ResolutionConfig
from looplm.resolution.downscale import build_down
from looplm.resolution.schedule import IterationResolution, iteration_resolutions
from looplm.resolution.state import ChunkState
from looplm.resolution.upscale import build_up

if TYPE_CHECKING:
    from looplm.cache import LoopCache
    from looplm.modules.rotary import Rotary


@dataclasses.dataclass
class Compressed:
    """What S↓ hands the core, and what S↑ needs back.

    z: [B, n, d] latents of the n chunks that complete in this forward. ctx: the mixer
    context at the compressed resolution (positions = chunk indices). first: index of the
    first of them. tokens: [B, k + T, d] the buffered positions of the current chunk and
    the new ones, starting at position ``tokens_start``. start: P, the first new position.
    """

    z: torch.Tensor
    ctx: MixerContext
    first: int
    tokens: torch.Tensor
    tokens_start: int
    start: int
    previous: Optional[ChunkState]


class MultiResolution(nn.Module):
    """Per-iteration S↓ (mean / self-aggregation) and S↑ (uniform / router) operators and the
    schedule (g_t, ω_t, s_t). Iterations at full resolution without shift are the identity
    and own no modules. ``down[str(t)]`` holds A^(t), ``up[str(t)]`` holds B^(t)."""

    def __init__(self, cfg: ResolutionConfig, resolutions: Sequence[float], d_model: int):
        """cfg: ``model.resolution``; resolutions: r_t per iteration (the layout's);
        d_model: the state width."""
        super().__init__()
        self.schedule: tuple[IterationResolution, ...] = iteration_resolutions(resolutions, cfg.offsets, cfg.shifts)
        active = [t for t, it in enumerate(self.schedule) if not it.identity]
        self.down_ops = nn.ModuleDict({str(t): build_down(cfg.down, d_model, self.schedule[t].chunk) for t in active})
        self.up_ops = nn.ModuleDict({str(t): build_up(cfg.up, d_model, self.schedule[t].chunk) for t in active})

    def extra_repr(self) -> str:
        return "schedule=[" + ", ".join(f"(g={i.chunk}, ω={i.offset}, s={i.shift})" for i in self.schedule) + "]"

    def identity(self, t: int) -> bool:
        return self.schedule[t].identity

    def down(
        self, t: int, h: torch.Tensor, ctx: MixerContext, rotary: "Rotary", cache: Optional["LoopCache"]
    ) -> Compressed:
        """S↓ of the chunks completed by the new positions. h: [B, T, d], h^(t) at the new
        positions P = ctx.past .. P + T − 1."""
        it = self.schedule[t]
        if ctx.padded:
            raise ValueError(
                f"left-padded batches are not supported by multi-resolution iteration {t} (r = 1/{it.chunk}): "
                "chunks are cut by position and would differ per row; run prompts of different lengths separately"
            )
        B, T, d = h.shape
        P = ctx.past
        previous = cache.chunk(t) if cache is not None else None
        if previous is None and P > 0:
            raise ValueError(f"the cache holds {P} positions but no chunk state for iteration {t}")
        g, done = it.chunk, it.complete_chunks(P)
        total = it.complete_chunks(P + T)
        pending = previous.pending if previous is not None else h[:, :0]
        tokens = torch.cat([pending, h], dim=1)  # positions tokens_start .. P + T − 1
        tokens_start = it.chunk_start(done)
        lead = tokens_start - (done * g - it.offset)  # empty slots before position 0 (chunk 0 with ω > 0)
        n = total - done
        grid = torch.cat([tokens.new_zeros(B, lead, d), tokens], dim=1)[:, : n * g]
        x = grid.reshape(B, n, g, d)  # [B, n, g, d]: chunk done + k in row k
        mask = torch.ones(n, g, dtype=torch.bool, device=h.device)
        if n and lead:
            mask[0, :lead] = False
        z = self.down_ops[str(t)](x, mask)  # Eq. (16) or (17-18): [B, n, d]
        positions = torch.arange(done, total, device=h.device).expand(B, n)  # chunk index as position
        zctx = dataclasses.replace(
            ctx,
            rope=rotary(positions, h.dtype),
            valid=torch.ones(B, total, dtype=torch.bool, device=h.device),
            past=done,
            padded=False,
            _masks={},
        )
        return Compressed(z, zctx, done, tokens, tokens_start, P, previous)

    def up(self, t: int, step: Compressed, z_hat: torch.Tensor, cache: Optional["LoopCache"]) -> torch.Tensor:
        """ũ = shift(S↑(ẑ), s_t) at the new positions: [B, T, d]. z_hat: [B, n, d], the core's
        output for the chunks ``step`` down-scaled. Updates the cache's chunk state."""
        it = self.schedule[t]
        B, _, d = step.tokens.shape
        T = step.tokens.shape[1] - (step.start - step.tokens_start)
        old = step.previous.latents if step.previous is not None else z_hat[:, :0]
        latents = torch.cat([old, z_hat], dim=1)  # [B, N, d]: ẑ of every completed chunk
        source = torch.arange(step.start, step.start + T, device=z_hat.device) - it.shift  # i − s, Eq. (22)
        if latents.shape[1] == 0:  # no chunk complete yet, so every i < s
            u = z_hat.new_zeros(B, T, d)
        else:
            # Positions i < s are zeroed below, so any valid chunk serves them: π and ρ are
            # taken of i − s itself and only π is clamped (to chunk 0). Clamping i − s first
            # gave the same values but an index expression (clamp, then floor division) that
            # torch.compile's inductor cannot range-check (torch 2.13: "vr must not be None").
            z_src = latents.index_select(1, it.chunk_index(source).clamp(min=0))  # ẑ_{π(i−s)}: [B, T, d]
            u = self.up_ops[str(t)](z_src, it.in_chunk(source))  # Eq. (19-21) at i − s; ρ in [0, g)
            u = u * (source >= 0)[None, :, None].to(u.dtype)  # Eq. (22): ũ_i = 0 for i < s
        if cache is not None:
            N, end = latents.shape[1], step.start + T
            keep = it.chunk_start(N) - step.tokens_start  # the current chunk's buffered positions
            triggers = list(step.previous.triggers) if step.previous is not None else []
            triggers += [it.trigger(j) for j in range(step.first, N)]
            cache.set_chunk(t, ChunkState(it, step.tokens[:, keep:], latents, end, triggers))
        return u


def build_resolution(cfg: ResolutionConfig, layout: Layout, d_model: int) -> Optional[MultiResolution]:
    """The resolution axis of ``layout``'s loop, or None without a loop or when every
    iteration is the identity."""
    if not layout.is_looped:
        return None
    schedule = iteration_resolutions(layout.resolutions, cfg.offsets, cfg.shifts)
    return None if all(it.identity for it in schedule) else MultiResolution(cfg, layout.resolutions, d_model)
