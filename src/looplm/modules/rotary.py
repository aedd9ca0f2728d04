"""Rotary position embeddings (RoFormer), full or partial (GPT-NeoX's ``rotary_pct``).

Tables are computed once per forward from explicit position ids and passed to every
attention layer, so left-padded batches and cached decoding use the same code path.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable


class Rotary(nn.Module):
    """Produces ``(cos, sin)`` of shape [B, T, rotary_dim] for position ids [B, T].

    ``sin`` carries the rotation's sign, [-sin θ | sin θ], so that a rotation is
    x·cos + swap_halves(x)·sin: three operators (:func:`apply_rotary`), not five.
    With ``max_positions`` (the model's ``max_seq_len``) both tables are computed once, at
    construction, for every position, and a forward looks its positions up: one
    operator (an embedding gather) instead of seven per forward, which a decoded token
    pays in full. The table is a buffer: ``model.to(torch.bfloat16)`` rounds it as the
    per-call tables would be rounded."""

    def __init__(self, rotary_dim: int, theta: float, max_positions: Optional[int] = None):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / max(rotary_dim, 1)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # [P, 2R]: cos | sin side by side, one gather for both (None: computed per call)
        table = None if max_positions is None else torch.cat(self._tables(torch.arange(max_positions)), dim=-1)
        self.register_buffer("table", table, persistent=False)

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [...] -> angles: [..., rotary_dim / 2] -> float32 (cos, sin) [..., rotary_dim]
        angles = positions.to(torch.float32)[..., None] * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is None:
            cos, sin = self._tables(positions)
            return cos.to(dtype), sin.to(dtype)
        both = F.embedding(positions, self.table).to(dtype)  # [B, T, 2R]
        return both[..., : self.rotary_dim], both[..., self.rotary_dim :]


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x₁ | x₂] -> [x₂ | x₁] along the last dimension (one concatenation)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x2, x1], dim=-1)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    x_rot = x if rot == x.shape[-1] else x[..., :rot]
    out = torch.addcmul(x_rot * cos, swap_halves(x_rot), sin)
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


def turn_back_(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation's transpose, the rotation by -θ, in place on g's first R channels:
    g·cos - swap_halves(g)·sin (the others pass through); cos, sin broadcast against g."""
    rot = g[..., : cos.shape[-1]]
    swapped = swap_halves(rot)
    rot.mul_(cos).addcmul_(swapped, sin, value=-1)
    return g


class _Rotation(torch.autograd.Function):
    """The rotation with its backward written as the rotation by -θ: three operators for
    full rotary (g·cos - swap_halves(g)·sin), :func:`turn_back_` on a copy for partial,
    where autograd's chain through the forward's three operators takes five. The tables
    take no gradient."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return _rotated(x, cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if cos.shape[-1] == grad.shape[-1]:
            turned = torch.addcmul(grad * cos, swap_halves(grad), sin, value=-1)
        else:
            turned = turn_back_(grad.to(torch.result_type(grad, cos), copy=True), cos, sin)
        return turned.to(ctx.dtype), None, None


class _RotatedQKV(torch.autograd.Function):
    """q [B, T, n_q, D], k and v [B, T, n_kv, D] of one projection qkv [B, T, n_q + 2·n_kv, D]
    (a fused projection's output: the query heads, then the key heads, then the value
    heads), q and k rotated by cos, sin [B, T, 1, R] and v a view. The backward
    concatenates the three gradients into qkv's at once and turns q's and k's back in place
    (:func:`turn_back_`): four operators, where autograd's chain through the slices, the
    rotation and the sums of the slices' zero-padded gradients takes nine. The tables take
    no gradient; without rotary channels (R = 0) nothing is rotated and the backward is the
    concatenation alone."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, n_q, n_kv):
        ctx.save_for_backward(cos, sin)
        ctx.dtype, ctx.n_qk = qkv.dtype, n_q + n_kv
        qk = qkv[:, :, : n_q + n_kv]
        if cos.shape[-1]:
            qk = _rotated(qk, cos, sin)
        return qk[:, :, :n_q], qk[:, :, n_q:], qkv[:, :, n_q + n_kv:]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k, grad_v):
        cos, sin = ctx.saved_tensors
        grad = torch.cat([grad_q, grad_k, grad_v], dim=2)  # [B, T, n_q + 2·n_kv, D]
        if cos.shape[-1]:
            turn_back_(grad[:, :, : ctx.n_qk], cos, sin)
        return grad.to(ctx.dtype), None, None, None, None


def split_rotated_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int,
                      n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries, keys and values of a fused projection qkv [B, T, n_q + 2·n_kv, D],
    queries and keys rotated in one pass (cos/sin: [B, T, R]) -> q [B, T, n_q, D], k and v
    [B, T, n_kv, D]. In training (qkv takes a gradient, the tables do not) the split and the
    rotation have one hand-written backward (:class:`_RotatedQKV`); else they are views and
    :func:`apply_rotary_heads_last`."""
    if torch.is_grad_enabled() and qkv.requires_grad and not (cos.requires_grad or sin.requires_grad):
        return _RotatedQKV.apply(qkv, cos[:, :, None], sin[:, :, None], n_q, n_kv)
    qk = apply_rotary_heads_last(qkv[:, :, : n_q + n_kv], cos, sin)
    return qk[:, :, :n_q], qk[:, :, n_q:], qkv[:, :, n_q + n_kv:]


def hand_written_backward(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether a rotation by these tables takes the backward written as the rotation by -θ
    (:class:`_Rotation`): it has rotary channels and the tables want no gradient (never
    those of :class:`Rotary`). :func:`split_rotated_qkv` asks the same of the tables, and
    takes its own backward without rotary channels too."""
    return cos.shape[-1] > 0 and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoFormer's rotation x·cos + rotate_half(x)·sin on the first R = cos.shape[-1]
    channels of x, written x·cos + [x₂ | x₁]·sin with the sign in :class:`Rotary`'s sin
    table; the tables already broadcast against x. Full rotary (R = D) skips the
    pass-through concatenation: three operators for any number of heads, and three in the
    backward (:class:`_Rotation`) when x takes a gradient and the tables do not."""
    if cos.shape[-1] == 0:
        return x
    if torch.is_grad_enabled() and x.requires_grad and hand_written_backward(cos, sin):
        return _Rotation.apply(x, cos, sin)
    return _rotated(x, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of x [B, H, T, D]; cos/sin are [B, T, R]."""
    return _rotate(x, cos[:, None], sin[:, None])


def apply_rotary_heads_last(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation for x [B, T, N, D] (heads after time, as a projection lays them
    out), so queries and keys projected together rotate in one pass; cos/sin: [B, T, R]."""
    return _rotate(x, cos[:, :, None], sin[:, :, None])
