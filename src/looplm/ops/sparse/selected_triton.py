"""Softmax attention over per-query selected keys as Triton kernels (forward and backward):
DSA's main attention (DeepSeek-V3.2 §2.1: each query attends to its top-k keys only) without
materialising the selected keys and values.

The PyTorch reference (:func:`~looplm.ops.sparse.common.gathered_attention`) gathers every
query's k selected key and value rows into [B, H_kv, T, k, D] tensors and keeps them, with the
probabilities [B, H_kv, T, G, k], for the backward: 2·B·H_kv·T·k·D + B·H·T·k numbers (at
B = 8, H_kv = 16, T = 8k, k = 2048, D = 64, float32: 137 GB per layer). These kernels read the
selected rows straight from the caches' [B, H_kv, S, D] tensors by index, keep an online
softmax (running max and sum) per query head, and save for the backward only the output and
its log-sum-exp [B, H_kv, G, T]: nothing of size T·k·D is ever allocated. The backward
recomputes the scores of the selected keys, writes dq per query and scatters dk, dv into
float32 [B, H_kv, S, D] buffers with atomic adds (the order of those adds is not fixed, so the
key and value gradients can differ from run to run at float rounding).

One program per (query, batch row, KV head) serves the G query heads of that KV head (GQA:
the selection is shared by all heads of a query, so the G heads read each selected row once).
With ``with_mass`` the forward also returns the attention mass of each selected key summed
over the G heads [B, H_kv, T, k] (a second pass over the selected keys with the final
log-sum-exp), the target of DSA's indexer loss (Eq. (3)), instead of the dense
[B, H, T, S] probabilities the reference needs.

Tested against the reference on CPU with ``TRITON_INTERPRET=1`` (tests/ops/test_selected_triton.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

#: selected keys processed per step of a program
BLOCK_KEYS = 32


@triton.jit
def _scores(q, K, V, IDX, KEEP, base_k, base_v, base_i, w0, sk_s, sv_s, D, DV, W, scale,
            HAS_KEEP: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BW: tl.constexpr, LOAD_V: tl.constexpr):
    """Scores [BG, BW] of the query heads against selected keys w0 .. w0 + BW (-inf where not
    kept), the keys' indices and flags, and their key and value rows."""
    w = w0 + tl.arange(0, BW)
    ok = w < W
    idx = tl.load(IDX + base_i + w, mask=ok, other=0)
    if HAS_KEEP:
        ok = ok & (tl.load(KEEP + base_i + w, mask=ok, other=0) != 0)
    d = tl.arange(0, BD)
    kt = tl.load(K + base_k + idx[:, None] * sk_s + d[None, :], mask=ok[:, None] & (d[None, :] < D), other=0.0)
    s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale
    s = tl.where(ok[None, :], s, float("-inf"))
    vt = kt
    if LOAD_V:
        dv = tl.arange(0, BDV)
        vt = tl.load(V + base_v + idx[:, None] * sv_s + dv[None, :], mask=ok[:, None] & (dv[None, :] < DV), other=0.0)
    return s, idx, ok, kt, vt


@triton.jit
def _forward_kernel(
    Q, K, V, IDX, KEEP, O, LSE, MASS,
    sq_b, sq_h, sq_g, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, si_b, si_t, so_b, so_h, so_g, so_t,
    Hkv, T, G, W, D, DV, scale,
    HAS_KEEP: tl.constexpr, WITH_MASS: tl.constexpr,
    BG: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BW: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # int64 offsets: a cache can exceed 2^31 elements
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // Hkv, bh % Hkv
    g, d, dv = tl.arange(0, BG), tl.arange(0, BD), tl.arange(0, BDV)
    q = tl.load(Q + b * sq_b + h * sq_h + g[:, None] * sq_g + t * sq_t + d[None, :],
                mask=(g[:, None] < G) & (d[None, :] < D), other=0.0)
    base_k, base_v, base_i = b * sk_b + h * sk_h, b * sv_b + h * sv_h, b * si_b + t * si_t
    m = tl.full([BG], float("-inf"), tl.float32)
    total = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    for w0 in range(0, W, BW):
        s, idx, ok, kt, vt = _scores(q, K, V, IDX, KEEP, base_k, base_v, base_i, w0, sk_s, sv_s, D, DV, W, scale,
                                     HAS_KEEP, BD, BDV, BW, True)
        m_new = tl.maximum(m, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing kept yet: exp(-inf) = 0
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        m = m_new
    o = acc / tl.where(total > 0, total, 1.0)[:, None]  # a query with nothing kept: zeros
    tl.store(O + b * so_b + h * so_h + g[:, None] * so_g + t * so_t + dv[None, :], o.to(O.dtype.element_ty),
             mask=(g[:, None] < G) & (dv[None, :] < DV))
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("inf"))  # +inf: every probability of an empty row is 0
    tl.store(LSE + ((b * Hkv + h) * G + g) * T + t, lse, mask=g < G)
    if WITH_MASS:
        for w0 in range(0, W, BW):
            s, idx, ok, kt, vt = _scores(q, K, V, IDX, KEEP, base_k, base_v, base_i, w0, sk_s, sv_s, D, DV, W, scale,
                                         HAS_KEEP, BD, BDV, BW, False)
            p = tl.where(g[:, None] < G, tl.exp(s - lse[:, None]), 0.0)
            w = w0 + tl.arange(0, BW)
            tl.store(MASS + ((b * Hkv + h) * T + t) * W + w, tl.sum(p, 0), mask=w < W)


@triton.jit
def _backward_kernel(
    Q, K, V, IDX, KEEP, DO, LSE, DELTA, DQ, DK, DV_,
    sq_b, sq_h, sq_g, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, si_b, si_t, so_b, so_h, so_g, so_t,
    Hkv, T, G, S, W, D, DV, scale,
    HAS_KEEP: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BW: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # int64 offsets: a cache can exceed 2^31 elements
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // Hkv, bh % Hkv
    g, d, dv = tl.arange(0, BG), tl.arange(0, BD), tl.arange(0, BDV)
    rows = g[:, None] < G
    q = tl.load(Q + b * sq_b + h * sq_h + g[:, None] * sq_g + t * sq_t + d[None, :],
                mask=rows & (d[None, :] < D), other=0.0)
    do = tl.load(DO + b * so_b + h * so_h + g[:, None] * so_g + t * so_t + dv[None, :],
                 mask=rows & (dv[None, :] < DV), other=0.0)
    stat = ((b * Hkv + h) * G + g) * T + t
    lse = tl.load(LSE + stat, mask=g < G, other=float("inf"))
    delta = tl.load(DELTA + stat, mask=g < G, other=0.0)
    base_k, base_v, base_i = b * sk_b + h * sk_h, b * sv_b + h * sv_h, b * si_b + t * si_t
    grad_base = (b * Hkv + h) * S  # dk, dv: float32 [B, H_kv, S, D] contiguous
    dq = tl.zeros([BG, BD], tl.float32)
    for w0 in range(0, W, BW):
        s, idx, ok, kt, vt = _scores(q, K, V, IDX, KEEP, base_k, base_v, base_i, w0, sk_s, sv_s, D, DV, W, scale,
                                     HAS_KEEP, BD, BDV, BW, True)
        p = tl.where(rows, tl.exp(s - lse[:, None]), 0.0)  # [BG, BW]
        dp = tl.dot(do, tl.trans(vt), input_precision="ieee")
        ds = p * (dp - delta[:, None]) * scale
        dq += tl.dot(ds.to(kt.dtype), kt, input_precision="ieee")
        dk = tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")  # [BW, BD]
        dvv = tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")  # [BW, BDV]
        tl.atomic_add(DK + (grad_base + idx[:, None]) * D + d[None, :], dk, mask=ok[:, None] & (d[None, :] < D))
        tl.atomic_add(DV_ + (grad_base + idx[:, None]) * DV + dv[None, :], dvv, mask=ok[:, None] & (dv[None, :] < DV))
    tl.store(DQ + ((b * Hkv + h) * G + g[:, None]) * T * D + t * D + d[None, :], dq, mask=rows & (d[None, :] < D))


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs every dim >= 16


def _launch_args(q, k, v, index, o):
    return (*q.stride()[:4], *k.stride()[:3], *v.stride()[:3], *index.stride()[:2], *o.stride()[:4])


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# The kernels are registered as custom operators (forward, backward, autograd between them), so
# torch.compile keeps each as one opaque call in its graph instead of tracing into Triton.
@torch.library.custom_op("looplm::selected_attention", mutates_args=())
def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, keep: Optional[torch.Tensor],
    scale: float, with_mass: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [B, H_kv, G, T, D_v], lse float32 [B, H_kv, G, T], mass float32 [B, H_kv, T, k], or
    [0] without ``with_mass``)."""
    q, k, v, index = (_last_dim_dense(x) for x in (q, k, v, index))
    B, Hkv, G, T, D = q.shape
    DV, W = v.shape[-1], index.shape[-1]
    o = torch.empty(B, Hkv, G, T, DV, dtype=v.dtype, device=q.device)
    lse = torch.empty(B, Hkv, G, T, dtype=torch.float32, device=q.device)
    mass = torch.empty((B, Hkv, T, W) if with_mass else (0,), dtype=torch.float32, device=q.device)
    if B * T * Hkv == 0 or W == 0:
        return o.zero_(), lse.fill_(float("inf")), mass.zero_()
    _forward_kernel[(T, B * Hkv)](
        q, k, v, index, index if keep is None else keep.contiguous(), o, lse, mass, *_launch_args(q, k, v, index, o),
        Hkv, T, G, W, D, DV, scale, HAS_KEEP=keep is not None, WITH_MASS=with_mass,
        BG=_block(G), BD=_block(D), BDV=_block(DV), BW=BLOCK_KEYS,
    )
    return o, lse, mass


@_forward.register_fake
def _(q, k, v, index, keep, scale, with_mass):
    B, Hkv, G, T, _ = q.shape
    mass_shape = (B, Hkv, T, index.shape[-1]) if with_mass else (0,)
    return (q.new_empty(B, Hkv, G, T, v.shape[-1], dtype=v.dtype), q.new_empty(B, Hkv, G, T, dtype=torch.float32),
            q.new_empty(mass_shape, dtype=torch.float32))


@torch.library.custom_op("looplm::selected_attention_backward", mutates_args=())
def _backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, keep: Optional[torch.Tensor],
    o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's, k's and v's dtypes."""
    q, k, v, index, do = (_last_dim_dense(x) for x in (q, k, v, index, do))
    B, Hkv, G, T, D = q.shape
    S, DV, W = k.shape[2], v.shape[-1], index.shape[-1]
    delta = (o.float() * do.float()).sum(-1).contiguous()  # [B, H_kv, G, T]: Σ_d o·dO
    dq = torch.zeros(B, Hkv, G, T, D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(B, Hkv, S, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros(B, Hkv, S, DV, dtype=torch.float32, device=q.device)
    if B * T * Hkv > 0 and W > 0:
        _backward_kernel[(T, B * Hkv)](
            q, k, v, index, index if keep is None else keep.contiguous(), do, lse.contiguous(), delta, dq, dk, dv,
            *_launch_args(q, k, v, index, do), Hkv, T, G, S, W, D, DV, scale, HAS_KEEP=keep is not None,
            BG=_block(G), BD=_block(D), BDV=_block(DV), BW=BLOCK_KEYS,
        )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_backward.register_fake
def _(q, k, v, index, keep, o, lse, do, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, index, keep, scale, _ = inputs
    o, lse, _ = output
    ctx.save_for_backward(q, k, v, index, keep, o, lse)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse, output[2])


def _autograd_backward(ctx, do, _lse_grad, _mass_grad):
    q, k, v, index, keep, o, lse = ctx.saved_tensors
    dq, dk, dv = _backward(q, k, v, index, keep, o, lse, do, ctx.scale)
    return dq, dk, dv, None, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def selected_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, keep: Optional[torch.Tensor],
    scale: float, with_mass: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`~looplm.ops.sparse.common.gathered_attention` without gathering: query t of
    batch row b attends to the keys ``index[b, t]`` that ``keep`` flags (all when None).

    q: [B, H_kv, G, T, D]; k: [B, H_kv, S, D]; v: [B, H_kv, S, D_v]; index: long [B, T, k],
    distinct positions per row; keep: bool [B, T, k] or None. Returns (o [B, H_kv, G, T, D_v]
    in v's dtype, differentiable in q, k, v; with ``with_mass`` the attention mass of each
    selected key summed over the G heads, float32 [B, H_kv, T, k], not differentiable, else
    None). A row with nothing kept gives zeros (and zero mass). Triton: CUDA tensors, or CPU
    tensors under ``TRITON_INTERPRET=1``.
    """
    o, _, mass = _forward(q, k, v, index, keep, scale, with_mass)
    return o, (mass if with_mass else None)
