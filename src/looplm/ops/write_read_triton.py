"""MeSH's write-read (mesh.txt Alg. 2 lines 9-13 / 17-22, on the unrolled read of Eq. (7)) as
one Triton kernel forward and one backward.

The PyTorch reference (:class:`looplm.topology.mesh._WriteRead`) launches eight kernels per
write-read forward and ten backward: the router matmul, its softmax, two appends (``cat``),
the Eq. (7) coefficients and the read (two ``bmm``), and their gradients. Each is a pass
over [positions, rows written, d] or smaller, so on a GPU the write-read costs launches, not
FLOPs. Here one program takes a block of positions through all of it with its state row in
registers: both routers (Linear d -> S each, Eq. (3)) and their softmaxes, the coefficients
α_j = ⟨w_write(j), w_read(t)⟩ of the values written so far, the read h = Σ_j α_j v_j, and the
appended values and write weights, reading the earlier ones once. The backward recomputes
nothing: one program per block of positions writes the gradients of the state, the update,
the earlier values and weights and the router logits; the routers' weight and bias
gradients, sums over positions, are one ``mm`` and one ``sum`` of those logits' gradients.

Both are ``torch.library`` custom operators (``looplm::mesh_write_read``,
``looplm::mesh_write_read_backward``): one dispatched operator per launch, so
:mod:`looplm.accounting.dispatch` counts what a GPU launches, and ``torch.compile`` keeps
them whole. Arithmetic in float32 whatever the storage dtypes (the reference runs in the
state's dtype): equal to the reference at float32 rounding. Tested against it on CPU under
``TRITON_INTERPRET=1`` (tests/topology/test_mesh_triton.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

#: elements of a [positions, d] tile per program: the state row block stays in registers
TILE = 4096


@triton.jit
def _rows(n, T, sb, st):
    """Offsets of positions n = b·T + t in a tensor with batch stride sb and time stride st."""
    return (n // T) * sb + (n % T) * st


@triton.jit
def _row_mask(k, d, S, dd):
    """Row k < S of an [S, d] weight, channels dd < d (k·d + dd < S·d once dd < d)."""
    return (dd < d) & (k * d + dd < S * d)


@triton.jit
def _router(x, WEIGHT, BIAS, d, S, dd, ks, BN: tl.constexpr, BS: tl.constexpr):
    """Softmax over slots of x Wᵀ + b (Eq. (3)): [BN, BS], zero beyond S."""
    logits = tl.zeros([BN, BS], tl.float32)
    for k in tl.static_range(BS):
        w = tl.load(WEIGHT + k * d + dd, mask=_row_mask(k, d, S, dd), other=0.0).to(tl.float32)
        logits += tl.where(ks[None, :] == k, tl.sum(x * w[None, :], 1)[:, None], 0.0)
    logits += tl.load(BIAS + ks, mask=ks < S, other=0.0).to(tl.float32)[None, :]
    logits = tl.where(ks[None, :] < S, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    return p / tl.sum(p, 1)[:, None]


@triton.jit
def _forward_kernel(
    X, U, V, W, WW, BW, WR, BR, H, VO, WO, P, C,
    N, T, J, d, S,
    x_b, x_t, u_b, u_t, v_b, v_t, v_j, w_b, w_t, w_j, w_s,
    HAS_UPDATE: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    dd, ks = tl.arange(0, BD), tl.arange(0, BS)
    nm = n < N
    md = nm[:, None] & (dd[None, :] < d)
    ms = nm[:, None] & (ks[None, :] < S)
    x = tl.load(X + _rows(n, T, x_b, x_t)[:, None] + dd[None, :], mask=md, other=0.0).to(tl.float32)
    write = _router(x, WW, BW, d, S, dd, ks, BN, BS)
    read = _router(x, WR, BR, d, S, dd, ks, BN, BS)
    p = P + n[:, None] * (2 * S) + ks[None, :]
    tl.store(p, write.to(P.dtype.element_ty), mask=ms)
    tl.store(p + S, read.to(P.dtype.element_ty), mask=ms)
    J1 = J + 1
    h = tl.zeros([BN, BD], tl.float32)
    for j in range(0, J):  # the values written so far: α_j = ⟨w_write(j), w_read⟩, h += α_j v_j
        wj = tl.load(W + _rows(n, T, w_b, w_t)[:, None] + j * w_j + ks[None, :] * w_s, mask=ms, other=0.0)
        tl.store(WO + (n * J1 + j)[:, None] * S + ks[None, :], wj.to(WO.dtype.element_ty), mask=ms)
        alpha = tl.sum(wj.to(tl.float32) * read, 1)
        tl.store(C + n * J1 + j, alpha.to(C.dtype.element_ty), mask=nm)
        vj = tl.load(V + _rows(n, T, v_b, v_t)[:, None] + j * v_j + dd[None, :], mask=md, other=0.0)
        tl.store(VO + (n * J1 + j)[:, None] * d + dd[None, :], vj, mask=md)
        h += alpha[:, None] * vj.to(tl.float32)
    # this write: the update (or the state itself) with the write weights just computed
    if HAS_UPDATE:
        u = tl.load(U + _rows(n, T, u_b, u_t)[:, None] + dd[None, :], mask=md, other=0.0).to(tl.float32)
    else:
        u = x
    tl.store(WO + (n * J1 + J)[:, None] * S + ks[None, :], write.to(WO.dtype.element_ty), mask=ms)
    alpha = tl.sum(write * read, 1)
    tl.store(C + n * J1 + J, alpha.to(C.dtype.element_ty), mask=nm)
    tl.store(VO + (n * J1 + J)[:, None] * d + dd[None, :], u.to(VO.dtype.element_ty), mask=md)
    h += alpha[:, None] * u
    tl.store(H + n[:, None] * d + dd[None, :], h.to(H.dtype.element_ty), mask=md)


@triton.jit
def _backward_kernel(
    GH, GV, GW, WW, WR, P, WO, VO, C, GX, GU, GPV, GPW, GL,
    N, J, d, S,
    HAS_GH: tl.constexpr, HAS_GV: tl.constexpr, HAS_GW: tl.constexpr, WRITES_STATE: tl.constexpr,
    BN: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    dd, ks = tl.arange(0, BD), tl.arange(0, BS)
    nm = n < N
    md = nm[:, None] & (dd[None, :] < d)
    ms = nm[:, None] & (ks[None, :] < S)
    J1 = J + 1
    if HAS_GH:
        gh = tl.load(GH + n[:, None] * d + dd[None, :], mask=md, other=0.0).to(tl.float32)
    else:
        gh = tl.zeros([BN, BD], tl.float32)
    p = P + n[:, None] * (2 * S) + ks[None, :]
    write = tl.load(p, mask=ms, other=0.0).to(tl.float32)
    read = tl.load(p + S, mask=ms, other=0.0).to(tl.float32)
    g_read = tl.zeros([BN, BS], tl.float32)
    g_write = tl.zeros([BN, BS], tl.float32)
    g_update = tl.zeros([BN, BD], tl.float32)
    for j in range(0, J1):
        row_d = (n * J1 + j)[:, None] * d + dd[None, :]
        row_s = (n * J1 + j)[:, None] * S + ks[None, :]
        g_alpha = tl.sum(tl.load(VO + row_d, mask=md, other=0.0).to(tl.float32) * gh, 1)  # ∂h/∂α_j = v_j
        g_v = tl.load(C + n * J1 + j, mask=nm, other=0.0).to(tl.float32)[:, None] * gh
        if HAS_GV:
            g_v += tl.load(GV + row_d, mask=md, other=0.0).to(tl.float32)
        g_read += g_alpha[:, None] * tl.load(WO + row_s, mask=ms, other=0.0).to(tl.float32)
        g_w = g_alpha[:, None] * read
        if HAS_GW:
            g_w += tl.load(GW + row_s, mask=ms, other=0.0).to(tl.float32)
        if j < J:
            tl.store(GPV + (n * J + j)[:, None] * d + dd[None, :], g_v.to(GPV.dtype.element_ty), mask=md)
            tl.store(GPW + (n * J + j)[:, None] * S + ks[None, :], g_w.to(GPW.dtype.element_ty), mask=ms)
        else:  # this write-read's own row: the update and the write weights
            g_update = g_v
            g_write = g_w
    # softmax backward, both routers: g_logits = p ⊙ (g - ⟨g, p⟩)
    g_lw = write * (g_write - tl.sum(g_write * write, 1)[:, None])
    g_lr = read * (g_read - tl.sum(g_read * read, 1)[:, None])
    gl = GL + n[:, None] * (2 * S) + ks[None, :]
    tl.store(gl, g_lw.to(GL.dtype.element_ty), mask=ms)
    tl.store(gl + S, g_lr.to(GL.dtype.element_ty), mask=ms)
    g_x = tl.zeros([BN, BD], tl.float32)
    for k in tl.static_range(BS):  # the state's gradient through both routers: g_logits W
        ww = tl.load(WW + k * d + dd, mask=_row_mask(k, d, S, dd), other=0.0).to(tl.float32)
        wr = tl.load(WR + k * d + dd, mask=_row_mask(k, d, S, dd), other=0.0).to(tl.float32)
        g_x += tl.sum(tl.where(ks[None, :] == k, g_lw, 0.0), 1)[:, None] * ww[None, :]
        g_x += tl.sum(tl.where(ks[None, :] == k, g_lr, 0.0), 1)[:, None] * wr[None, :]
    if WRITES_STATE:  # the state was also the update: one gradient for both
        g_x += g_update
    else:
        tl.store(GU + n[:, None] * d + dd[None, :], g_update.to(GU.dtype.element_ty), mask=md)
    tl.store(GX + n[:, None] * d + dd[None, :], g_x.to(GX.dtype.element_ty), mask=md)


def _blocks(d: int, S: int) -> dict[str, int]:
    """The launch of both kernels: BN positions per program (a [BN, d] tile of TILE elements or
    fewer), channels and slots padded to powers of two, ``num_warps`` (``benchmarks/kernels.py``
    times other choices)."""
    BD, BS = triton.next_power_of_2(d), triton.next_power_of_2(S)
    return dict(BN=max(1, min(64, TILE // BD)), BD=BD, BS=BS, num_warps=4)


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("looplm::mesh_write_read", mutates_args=())
def write_read(state: torch.Tensor, update: Optional[torch.Tensor], values: torch.Tensor, weights: torch.Tensor,
               write_weight: torch.Tensor, write_bias: torch.Tensor, read_weight: torch.Tensor,
               read_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """state [B, T, d], update [B, T, d] or None (the state is written), values [B, T, J, d],
    weights [B, T, J, S], router weights [S, d] and biases [S]. Returns h^(t+1) [B, T, d] (in
    values' dtype), the values and weights with this write appended, the router
    probabilities [B, T, 2, S] and the coefficients α [B, T, J+1] (the state's dtype)."""
    B, T, d = state.shape
    J, S = values.shape[-2], write_weight.shape[0]
    state, values, weights = _last_dim_dense(state), _last_dim_dense(values), _last_dim_dense(weights)
    update = None if update is None else _last_dim_dense(update)
    h = values.new_empty(B, T, d)
    values_out = values.new_empty(B, T, J + 1, d)
    weights_out = state.new_empty(B, T, J + 1, S)
    probs = state.new_empty(B, T, 2, S)
    coef = state.new_empty(B, T, J + 1)
    launch = _blocks(d, S)
    u = state if update is None else update
    params = [p.contiguous() for p in (write_weight, write_bias, read_weight, read_bias)]
    _forward_kernel[(triton.cdiv(B * T, launch["BN"]),)](
        state, u, values, weights, *params, h, values_out, weights_out, probs, coef,
        B * T, T, J, d, S,
        state.stride(0), state.stride(1), u.stride(0), u.stride(1), values.stride(0), values.stride(1),
        values.stride(2), weights.stride(0), weights.stride(1), weights.stride(2), weights.stride(3),
        HAS_UPDATE=update is not None, **launch,
    )
    return h, values_out, weights_out, probs, coef


@write_read.register_fake
def _(state, update, values, weights, write_weight, write_bias, read_weight, read_bias):
    B, T, d = state.shape
    J, S = values.shape[-2], write_weight.shape[0]
    return (values.new_empty(B, T, d), values.new_empty(B, T, J + 1, d), state.new_empty(B, T, J + 1, S),
            state.new_empty(B, T, 2, S), state.new_empty(B, T, J + 1))


@torch.library.custom_op("looplm::mesh_write_read_backward", mutates_args=())
def write_read_backward(grad_h: Optional[torch.Tensor], grad_values: Optional[torch.Tensor],
                        grad_weights: Optional[torch.Tensor], state: torch.Tensor, write_weight: torch.Tensor,
                        read_weight: torch.Tensor, probs: torch.Tensor, weights: torch.Tensor, values: torch.Tensor,
                        coef: torch.Tensor, update_dtype: torch.dtype, writes_state: bool,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The write-read's backward from what its forward returned and saved: the gradients of
    the state [B, T, d], the update (empty when the state was written), the earlier values
    [B, T, J, d] and weights [B, T, J, S], and the router logits [B·T, 2S] (write, read)."""
    B, T, J1, d = values.shape
    S = probs.shape[-1]
    grads = [None if g is None else g.contiguous() for g in (grad_h, grad_values, grad_weights)]
    g_state = state.new_empty(B, T, d)
    # no update when the state was written (its gradient is the state's): an empty tensor here,
    # and the kernel, which never stores it then, gets a valid pointer rather than a null one
    g_update = state.new_empty(0) if writes_state else state.new_empty(B, T, d, dtype=update_dtype)
    g_values = values.new_empty(B, T, J1 - 1, d)
    g_weights = weights.new_empty(B, T, J1 - 1, S)
    g_logits = state.new_empty(B * T, 2 * S)
    launch = _blocks(d, S)
    _backward_kernel[(triton.cdiv(B * T, launch["BN"]),)](
        *(g_state if g is None else g for g in grads), write_weight.contiguous(), read_weight.contiguous(),
        probs, weights, values, coef, g_state, g_state if writes_state else g_update, g_values, g_weights, g_logits,
        B * T, J1 - 1, d, S,
        HAS_GH=grads[0] is not None, HAS_GV=grads[1] is not None, HAS_GW=grads[2] is not None,
        WRITES_STATE=writes_state, **launch,
    )
    return g_state, g_update, g_values, g_weights, g_logits


@write_read_backward.register_fake
def _(grad_h, grad_values, grad_weights, state, write_weight, read_weight, probs, weights, values, coef,
      update_dtype, writes_state):
    B, T, J1, d = values.shape
    S = probs.shape[-1]
    g_update = state.new_empty(0) if writes_state else state.new_empty(B, T, d, dtype=update_dtype)
    return (state.new_empty(B, T, d), g_update, values.new_empty(B, T, J1 - 1, d),
            weights.new_empty(B, T, J1 - 1, S), state.new_empty(B * T, 2 * S))
