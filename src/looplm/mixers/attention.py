"""Softmax attention through ``F.scaled_dot_product_attention``: full or sliding-window,
optionally with LT2's SDPA output gate (lt2.txt §4.4; Qiu et al. 2025's head-specific
elementwise sigmoid gate, Y ← Y ⊙ σ(X W_θ))."""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost, causal_pairs, children_cost, module_cost
from looplm.mixers.base import MixerContext
from looplm.mixers.reserve import Reserve, extend
from looplm.modules.rotary import apply_rotary, apply_rotary_heads_last, split_rotated_qkv
from looplm.ops.grouped_attention import attend_grouped, reads_grouped_heads


#: positions a sliding window's cache keeps beyond the w − 1 its next query reads, in the
#: growing cache and in the static ring alike: how many positions either may be cropped by
#: (speculative decoding rejecting draft tokens) before a key the next query needs is gone
RING_SPARE = 32


@dataclasses.dataclass
class KVState:
    """Keys and values [B, H_kv, S_kept, D] of the last S_kept positions; ``start`` is the
    absolute index of the first kept position (> 0 once a sliding window drops keys: it
    keeps w − 1 + ``RING_SPARE``, so a crop by up to ``RING_SPARE`` positions stays exact).
    ``spare``: the buffers the keys and values are views of (:mod:`looplm.mixers.reserve`),
    so that decoding appends in place."""

    keys: torch.Tensor
    values: torch.Tensor
    start: int = 0
    spare: tuple[Optional[Reserve], Optional[Reserve]] = dataclasses.field(
        default=(None, None), repr=False, compare=False
    )
    window: Optional[int] = None  # the layer's window (its static form is then a ring)

    @property
    def end(self) -> int:
        return self.start + self.keys.shape[2]

    def crop(self, length: int) -> "KVState":
        # the next query (position ``length``) reads the w - 1 positions before it: a crop
        # is exact only while the cache still holds them (it keeps w - 1 + RING_SPARE)
        needed = length if self.window is None else max(length - (self.window - 1), 0)
        if self.start > needed:
            raise ValueError(
                f"cannot crop a sliding-window cache to {length} positions: positions before {self.start} "
                f"were already dropped, and the next query's window needs positions from {needed} on"
            )
        keep = length - self.start
        return KVState(self.keys[:, :, :keep], self.values[:, :, :keep], self.start, self.spare, self.window)

    def select(self, index: torch.Tensor) -> "KVState":
        return KVState(self.keys[index], self.values[index], self.start, window=self.window)

    def static(self, capacity: int) -> "StaticKVState":
        """The same keys and values in buffers preallocated for ``capacity`` positions: at
        their absolute rows, or, for a window w shorter than the capacity, in a ring of
        w + ``RING_SPARE`` rows (position c in row c mod rows), so a windowed layer reads
        O(w) keys per step at any context length."""
        B, Hkv, _, D = self.keys.shape
        ring = self.window is not None and self.window + RING_SPARE < capacity
        rows = self.window + RING_SPARE if ring else capacity
        keys, values = (self.keys.new_zeros(B, Hkv, rows, D), self.values.new_zeros(B, Hkv, rows, D))
        columns = torch.arange(self.start, self.end, device=keys.device)
        state = StaticKVState(keys, values, self.window if ring else None)
        state.write(columns % rows if ring else columns, self.keys, self.values)
        return state


@dataclasses.dataclass
class StaticKVState:
    """Keys and values [B, H_kv, C, D] preallocated for the C positions a generation can
    reach; each step writes its rows in place (``index_copy_`` at the context's slots) and
    attends over the whole buffer under :meth:`MixerContext.attention_mask`, so the tensors
    a captured decoding step reads and writes never move (:mod:`looplm.cache`)."""

    keys: torch.Tensor
    values: torch.Tensor
    window: Optional[int] = None  # a ring of keys.shape[2] rows for this window, or absolute rows

    def write(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys.index_copy_(2, rows, keys)
        self.values.index_copy_(2, rows, values)

    @property
    def rewind(self) -> Optional[int]:
        """How many positions a crop may remove (None: any number)."""
        return None if self.window is None else self.keys.shape[2] - self.window

    def crop(self, length: int) -> "StaticKVState":
        return self  # rows past ``length`` are invalid in the cache's mask and rewritten later

    def select(self, index: torch.Tensor) -> "StaticKVState":
        """Reorder the rows in place (beam search keeps the batch size); a smaller batch
        gets new buffers."""
        if index.shape[0] != self.keys.shape[0]:
            return StaticKVState(self.keys[index], self.values[index], self.window)
        self.keys.copy_(self.keys[index])
        self.values.copy_(self.values[index])
        return self


#: Smallest query block of :func:`blocked_window_attention`: tiny windows still get
#: blocks large enough for SDPA to be efficient (cost 2·T·block instead of T·w).
MIN_WINDOW_BLOCK = 128


def blocked_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal sliding-window attention, each query over its last ``window`` keys (itself
    included), in O(T·w) time and memory instead of a T × T mask.

    The queries are cut into blocks of W = max(window, MIN_WINDOW_BLOCK) positions (the
    last one padded); as W >= window, block n needs only the keys of blocks n - 1 and n,
    so each block is one SDPA call over 2W keys with one [W, 2W] band mask (block 0's
    missing predecessor is masked out too). Equal to the masked full attention.
    q, k, v: [B, H, T, D] (k, v already repeated to H heads) -> [B, H, T, D]."""
    B, H, T, D = q.shape
    W = max(window, MIN_WINDOW_BLOCK)
    N = -(-T // W)  # number of query blocks
    pad = N * W - T  # padded keys lie after every real query: causality masks them

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B, H, N, W, D]
        return F.pad(x, (0, 0, 0, pad)).view(B, H, N, W, D)

    def with_previous(x: torch.Tensor) -> torch.Tensor:  # [B, H, N, W, D] -> [B, H, N, 2W, D]
        return torch.cat([F.pad(x, (0, 0, 0, 0, 1, 0))[:, :, :-1], x], dim=3)

    qb, kb, vb = blocks(q), with_previous(blocks(k)), with_previous(blocks(v))
    i = torch.arange(W, device=q.device)[:, None]  # query offset in its block
    j = torch.arange(2 * W, device=q.device)[None, :] - W  # key offset from the block's start
    band = (j <= i) & (j > i - window)  # [W, 2W]
    first = band & (j >= 0)  # block 0 has no previous block
    mask = torch.stack([first] + [band] * (N - 1))[:, None]  # [N, 1, W, 2W]
    # [B, H, N, W, D] -> [B·N, H, W, D]: SDPA's fast kernels want 4-d inputs
    qb, kb, vb = (x.transpose(1, 2).reshape(B * N, H, x.shape[3], D) for x in (qb, kb, vb))
    y = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask.repeat(B, 1, 1, 1))
    return y.view(B, N, H, W, D).transpose(1, 2).reshape(B, H, N * W, D)[:, :, :T]


class SoftmaxAttention(nn.Module):
    """Multi-head (optionally grouped-query) causal attention with rotary embeddings.

    ``qkv`` projects to [q (H·D) | k (H_kv·D) | v (H_kv·D)]; ``o_proj`` is W_O. ``window``
    w: each query attends to its last w positions, itself included, and decoding keeps
    only the last w - 1 keys and values. ``gate`` (output gate): W_θ, d -> H·D.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, bias: bool,
                 window: Optional[int] = None, output_gate: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.window = window
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)
        self.gate = nn.Linear(dim, n_heads * self.head_dim, bias=bias) if output_gate else None
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=bias)

    def extra_repr(self) -> str:
        return f"window={self.window}" if self.window else ""

    def with_window(self, window: Optional[int]) -> "SoftmaxAttention":
        """The same parameters with another window (a loop-level schedule's iteration view).
        A shallow copy: its submodules are this module's, so nothing is duplicated."""
        if window == self.window:
            return self
        view = copy.copy(self)
        view.window = window
        return view

    @staticmethod
    def _explicit(q, keys, values, mask, ctx: MixerContext) -> torch.Tensor:
        """softmax(q kᵀ / √D + mask) v with the probabilities recorded; equals SDPA."""
        T, S = q.shape[2], keys.shape[2]
        if mask is None:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, H, T, S]
        probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
        ctx.record_attention(probs)
        return torch.matmul(probs, values)

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[KVState] = None
    ) -> tuple[torch.Tensor, KVState]:
        """x: [B, T, d] -> ([B, T, d], state after these T positions)."""
        if ctx.first_step_kv is not None and ctx.first_step_kv.reusing:  # MoR's recursive KV sharing
            return self._forward_reusing_kv(x, ctx), None
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv(x).view(B, T, H + 2 * Hkv, D)
        q, k, v = split_rotated_qkv(qkv, *ctx.rope, H, Hkv)  # queries and keys rotated in one pass
        y, new_state = self.attend_rotated(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx, state)
        if self.gate is not None:  # LT2 §4.4: head-specific elementwise output gate
            y = y * torch.sigmoid(self.gate(x))
        return self.o_proj(y), new_state

    def _forward_reusing_kv(self, x: torch.Tensor, ctx: MixerContext) -> torch.Tensor:
        """A later recursion step under Mixture-of-Recursions' recursive KV sharing (Bae et al.
        2025 §2.2.2; :mod:`looplm.halting.mor`): project the queries alone (W_q, the first
        H·D rows of ``qkv``) and attend over the keys and values this block computed at the
        first step (:class:`~looplm.mixers.base.FirstStepKV`). x: [B, T, d] -> [B, T, d]; the
        step keeps no decoding state."""
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        bias = None if self.qkv.bias is None else self.qkv.bias[: H * D]
        q = apply_rotary_heads_last(F.linear(x, self.qkv.weight[: H * D], bias).view(B, T, H, D), *ctx.rope)
        y = ctx.first_step_kv.attend(ctx.location[0], q.transpose(1, 2), ctx).transpose(1, 2).reshape(B, T, H * D)
        if self.gate is not None:
            y = y * torch.sigmoid(self.gate(x))
        return self.o_proj(y)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: MixerContext,
               state: Optional[KVState] = None, kv_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, KVState]:
        """Causal attention of projected queries over the cached and new keys: the layer's
        core, shared with SGT's head passes (:mod:`looplm.head_loop.attention`), which
        project a subset of the heads.

        q: [B, T, H·D]; k, v: [B, T, H_kv·D] (H, H_kv: the heads projected, at most the
        layer's). kv_index: [H], the key/value head each query head reads; None: query
        head n reads head ⌊n·H_kv / H⌋ (grouped in order). Returns (y [B, T, H·D] before
        W_O, the state holding these key/value heads)."""
        B, T, _ = q.shape
        D = self.head_dim
        H, Hkv = q.shape[-1] // D, k.shape[-1] // D
        q = apply_rotary(q.view(B, T, H, D).transpose(1, 2), *ctx.rope)  # [B, H, T, D]
        k = apply_rotary(k.view(B, T, Hkv, D).transpose(1, 2), *ctx.rope)  # [B, H_kv, T, D]
        return self.attend_rotated(q, k, v.view(B, T, Hkv, D).transpose(1, 2), ctx, state, kv_index)

    def attend_rotated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: MixerContext,
                       state: Optional[KVState] = None,
                       kv_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, KVState]:
        """:meth:`attend` on rotated heads: q [B, H, T, D], k, v [B, H_kv, T, D]. SGT's head
        passes rotate their queries and keys in one call (:mod:`looplm.head_loop.attention`)."""
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        if isinstance(state, StaticKVState):
            return self._attend_static(q, k, v, ctx, state, kv_index), state
        start, spare = 0, (None, None)
        if state is not None:  # appended into the cache's spare rows, not a copy of the whole cache
            (k, k_spare), (v, v_spare) = (extend(state.keys, k, 2, state.spare[0]),
                                          extend(state.values, v, 2, state.spare[1]))
            start, spare = state.start, (k_spare, v_spare)
        mask = ctx.attention_mask(self.window)
        if mask is not None:
            mask = mask[..., start:]  # only the kept keys
        keys, values = k, v
        blocked = (self.window is not None and state is None and ctx.past == 0 and not ctx.padded
                   and T > max(self.window, MIN_WINDOW_BLOCK))  # training / prefill: O(T·w), not T × T
        if kv_index is not None:
            keys, values = k.index_select(1, kv_index), v.index_select(1, kv_index)
        elif Hkv != H and (blocked or ctx.attentions is not None or ctx.first_step_kv is not None
                           or (T > 1 and not reads_grouped_heads(q, mask))):  # these read H key heads
            keys, values = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        attend = functools.partial(self._over_keys, keys=keys, values=values, mask=mask, blocked=blocked,
                                   key_valid=ctx.valid)
        y = attend(q, ctx)
        if ctx.first_step_kv is not None:  # MoR's recursive KV sharing: later steps attend over these
            ctx.first_step_kv.keep(ctx.location[0], attend)
        new_state = KVState(k, v, start, spare, self.window)
        if self.window is not None and k.shape[2] > self.window - 1 + RING_SPARE:
            # the next query needs the last w - 1 keys; the spare ones let a crop rewind
            drop = k.shape[2] - (self.window - 1 + RING_SPARE)
            new_state = KVState(k[:, :, drop:], v[:, :, drop:], start + drop, spare, self.window)
        return y.transpose(1, 2).reshape(B, T, H * D), new_state

    def _over_keys(self, q: torch.Tensor, ctx: MixerContext, keys: torch.Tensor, values: torch.Tensor,
                   mask: Optional[torch.Tensor], blocked: bool, key_valid: torch.Tensor) -> torch.Tensor:
        """Rotated queries q [B, H, T, D] over the (cached and new) keys and values [B, H, S, D]
        under ``mask`` (None: plain causality); ``blocked``: by :func:`blocked_window_attention`.
        A later step of MoR's recursive KV sharing run on gathered rows (``ctx.gathered``)
        masks its K queries by their positions over all S keys, valid per ``key_valid``."""
        if ctx.gathered is not None and ctx.first_step_kv is not None and ctx.first_step_kv.reusing:
            mask, blocked = ctx.gathered_mask(key_valid, self.window), False
        if ctx.attentions is not None:  # probes want the probabilities: compute them explicitly
            return self._explicit(q, keys, values, mask, ctx)
        if blocked:
            return blocked_window_attention(q, keys, values, self.window)
        # mask None: the T queries are the last T of the keys and need only causality; grouped
        # key heads (fewer than H, attend_rotated kept them): attend_grouped
        return attend_grouped(q, keys, values, mask, is_causal=mask is None and q.shape[2] > 1)

    def _attend_static(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: MixerContext,
                       state: StaticKVState, kv_index: Optional[torch.Tensor]) -> torch.Tensor:
        """:meth:`attend_rotated` against a static cache: write the new rows in place, attend
        over the whole buffer (grouped heads read in place: :func:`attend_grouped`).
        A window's ring is written first when one position comes (its row held a position
        the window has left); several new positions attend over the ring and themselves
        first and then write their last rows."""
        B, H, T, D = q.shape
        rows = state.keys.shape[2]
        if state.window is None:
            state.write(ctx.slots, k, v)
            keys, values, mask = state.keys, state.values, ("window", self.window)
        elif T == 1:
            state.write(ctx.slots % rows, k, v)
            keys, values, mask = state.keys, state.values, ("ring", rows, self.window, True)
        else:
            keys, values = torch.cat([state.keys, k], dim=2), torch.cat([state.values, v], dim=2)
            mask = ("ring", rows, self.window, False)
        if kv_index is not None:
            keys, values = keys.index_select(1, kv_index), values.index_select(1, kv_index)
        attend = functools.partial(self._over_static_keys, keys=keys, values=values, mask=mask)
        y = attend(q, ctx)
        if ctx.first_step_kv is not None:  # MoR's recursive KV sharing: later steps attend over these
            ctx.first_step_kv.keep(ctx.location[0], attend)
        if state.window is not None and T > 1:
            last = min(T, rows)  # earlier new rows would be overwritten within this write
            state.write(ctx.slots[-last:] % rows, k[:, :, -last:], v[:, :, -last:])
        return y.transpose(1, 2).reshape(B, T, H * D)

    @staticmethod
    def _over_static_keys(q: torch.Tensor, ctx: MixerContext, keys: torch.Tensor, values: torch.Tensor,
                          mask: tuple) -> torch.Tensor:
        """Rotated queries q [B, H, T, D] over a static cache's key rows [B, H_kv, K, D] under
        :meth:`MixerContext.static_mask` ``(*mask)`` -> [B, H, T, D]."""
        H = q.shape[1]
        if ctx.attentions is not None:
            return SoftmaxAttention._explicit(q, keys.repeat_interleave(H // keys.shape[1], dim=1),
                                              values.repeat_interleave(H // keys.shape[1], dim=1),
                                              ctx.static_mask(*mask), ctx)
        return attend_grouped(q, keys, values, ctx.static_bias(mask, q.dtype))

    def flop_cost(self, call: Call) -> Cost:
        """Projections (and the output gate's multiply) plus q·kᵀ and p·v over the pairs; the
        output gate's sigmoid and multiply are elementwise, left out like activations. A
        later step of MoR's recursive KV sharing (``call.reuses_first_step_kv``) projects
        the queries alone: the K/V rows of ``qkv`` (2·H_kv of its H + 2·H_kv heads) are not run."""
        per_pair = self.n_heads * 2 * self.head_dim  # scores and values, every query head
        full = call.batch * call.tokens * call.keys
        causal = call.batch * causal_pairs(call.tokens, call.keys, self.window)
        cost = children_cost(self, call) + Cost(attn_full=full * per_pair, attn_causal=causal * per_pair)
        if call.reuses_first_step_kv:
            qkv, kv_heads = module_cost(self.qkv, call), 2 * self.n_kv_heads
            qkv_heads = self.n_heads + kv_heads  # qkv's MACs and biases split evenly over its heads
            cost = cost + Cost(mac=-(qkv.mac // qkv_heads) * kv_heads, bias=-(qkv.bias // qkv_heads) * kv_heads)
        return cost
