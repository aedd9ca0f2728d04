"""Softmax attention through ``F.scaled_dot_product_attention``: full or sliding-window,
optionally with LT2's SDPA output gate (lt2.txt §4.4; Qiu et al. 2025's head-specific
elementwise sigmoid gate, Y ← Y ⊙ σ(X W_θ))."""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.mixers.base import MixerContext
from looplm.modules.rotary import apply_rotary


@dataclasses.dataclass
class KVState:
    """Keys and values [B, H_kv, S_kept, D] of the last S_kept positions; ``start`` is the
    absolute index of the first kept position (> 0 once a sliding window drops keys)."""

    keys: torch.Tensor
    values: torch.Tensor
    start: int = 0

    @property
    def end(self) -> int:
        return self.start + self.keys.shape[2]

    def crop(self, length: int) -> "KVState":
        if length < self.start:
            raise ValueError(
                f"cannot crop a sliding-window cache to {length} positions: positions before {self.start} "
                "were already dropped"
            )
        keep = length - self.start
        return KVState(self.keys[:, :, :keep], self.values[:, :, :keep], self.start)

    def select(self, index: torch.Tensor) -> "KVState":
        return KVState(self.keys[index], self.values[index], self.start)


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
        return self._attend(x, ctx, state)

    def forward_heads(
        self, x: torch.Tensor, ctx: MixerContext, heads: tuple[int, ...],
        weights: Optional[tuple[float, ...]] = None, state: Optional[KVState] = None,
    ) -> tuple[torch.Tensor, KVState]:
        """Σ_{i∈S} w_i · Attn^(i)(x), the update of SGT's head loop (sparse-growing-transformer.txt
        Eq. 6, heads as in Eq. 2): only the query heads S = ``heads`` (ascending) and the
        key/value heads they read are projected, through their rows of ``qkv`` (and ``gate``)
        and their columns of ``o_proj``, so the cost scales with |S|. No output bias (Eq. 2 has
        none per head). weights: [|S|] output scales (a fading head), None for ones.
        x: [B, T, d] -> ([B, T, d], state holding the used key/value heads only)."""
        return self._attend(x, ctx, state, tuple(heads), weights)

    def _head_rows(self, heads: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]:
        """Rows of ``qkv`` for query heads ``heads`` and the kv heads they read, the rows of
        ``gate`` / columns of ``o_proj`` of those heads, each query head's index among the
        kept kv heads (None when it is its own position) and the number of kept kv heads."""
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        group = H // Hkv
        kv = sorted({i // group for i in heads})
        dims = torch.arange(D)
        cols = torch.cat([i * D + dims for i in heads])
        rows = torch.cat([cols] + [H * D + j * D + dims for j in kv] + [(H + Hkv) * D + j * D + dims for j in kv])
        kv_index = [kv.index(i // group) for i in heads]
        same = kv_index == list(range(len(heads)))  # MHA: query head n reads kept kv head n
        return rows.to(device), cols.to(device), None if same else torch.tensor(kv_index, device=device), len(kv)

    def _attend(self, x, ctx: MixerContext, state: Optional[KVState], heads: Optional[tuple[int, ...]] = None,
                weights: Optional[tuple[float, ...]] = None) -> tuple[torch.Tensor, KVState]:
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if heads is None:
            q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        else:  # a slice of the same weights: gradients reach only these heads' rows
            rows, cols, kv_index, n_kv = self._head_rows(heads, x.device)
            bias = None if self.qkv.bias is None else self.qkv.bias[rows]
            H, Hkv = len(heads), n_kv
            q, k, v = F.linear(x, self.qkv.weight[rows], bias).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, Hkv, D).transpose(1, 2)  # [B, H_kv, T, D]
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        q, k = apply_rotary(q, *ctx.rope), apply_rotary(k, *ctx.rope)
        start = 0
        if state is not None:
            k, v = torch.cat([state.keys, k], dim=2), torch.cat([state.values, v], dim=2)
            start = state.start
        mask = ctx.attention_mask(self.window)
        if mask is not None:
            mask = mask[..., start:]  # only the kept keys
        keys, values = k, v
        if heads is not None:
            if kv_index is not None:
                keys, values = k.index_select(1, kv_index), v.index_select(1, kv_index)
        elif Hkv != H:
            keys, values = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        if ctx.attentions is not None:  # probes want the probabilities: compute them explicitly
            y = self._explicit(q, keys, values, mask, ctx)
        elif (self.window is not None and state is None and ctx.past == 0 and not ctx.padded
              and T > max(self.window, MIN_WINDOW_BLOCK)):  # training / prefill: O(T·w), not T × T
            y = blocked_window_attention(q, keys, values, self.window)
        else:  # mask None: the T queries are the last T of the keys and need only causality
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and T > 1)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # [B, T, H·D]
        if self.gate is not None:  # LT2 §4.4: head-specific elementwise output gate
            if heads is None:
                y = y * torch.sigmoid(self.gate(x))
            else:
                bias = None if self.gate.bias is None else self.gate.bias[cols]
                y = y * torch.sigmoid(F.linear(x, self.gate.weight[cols], bias))
        new_state = KVState(k, v, start)
        if self.window is not None and k.shape[2] > self.window - 1:
            drop = k.shape[2] - (self.window - 1)  # the next query needs the last w - 1 keys only
            new_state = KVState(k[:, :, drop:], v[:, :, drop:], start + drop)
        if heads is None:
            return self.o_proj(y), new_state
        if weights is not None:  # fading heads: scale each head's output before W_O
            scale = torch.tensor(weights, dtype=y.dtype, device=y.device).repeat_interleave(D)
            y = y * scale
        return F.linear(y, self.o_proj.weight[:, cols]), new_state
