"""Attention of a subset of a layer's heads: the update of SGT's head loop.

sparse-growing-transformer.txt Eq. (6), heads as in Eq. (2): an extra pass computes only
the looping query heads S and the key/value heads they read, through their rows of the
layer's ``qkv`` (and ``gate``) and their columns of ``o_proj``, so its cost scales with
|S|. Those rows and columns are views of the layer's own weights (gradients reach only
them), taken once per block forward (:func:`pass_weights`) and shared by its K_l passes.

Once the block's heads are arranged (:func:`permute_heads`, at growth events) S occupies
the first slots and every view is narrow: no gathers, no host-built indices; q, k and v
come from one GEMM and q, k are rotated in one call (GQA too). Unarranged
heads (a structure written by hand, or S spread over more than two shared GQA groups)
are gathered with the device indices of :class:`~looplm.head_loop.structure.GrownLoop`:
the same numbers, more work.

A training step's operators per pass (DESIGN.md invariant 6): the split of q, k, v, the
rotation of q and k and its backward are one function with a hand-written backward (the
rotation by -θ, :func:`~looplm.modules.rotary.split_rotated_qkv`, as every attention layer's),
and the pass's residual is added by its W_O product (one ``addmm``) where the dtypes
allow, as the dense FFN adds its own (:func:`looplm.modules.mlp.add_product`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from looplm.accounting.cost import Call, Cost, causal_pairs
from looplm.head_loop.structure import GrownLoop
from looplm.mixers.attention import KVState, SoftmaxAttention
from looplm.mixers.base import MixerContext
from looplm.modules.mlp import add_product
from looplm.modules.rotary import split_rotated_qkv


@dataclasses.dataclass
class PassWeights:
    """What the extra passes of one forward read: the weights of S's heads, ``qkv``
    [(n + 2·m)·D, d] (the q rows of the n heads, then the k and the v rows of the m kv
    heads they read: m = n under MHA); ``gate`` [n·D, d] or None; ``out`` [d, n·D], S's
    columns of W_O; ``*_bias`` alike (None without biases). Each projection is one plain
    matrix, so that a pass runs it as one GEMM (``addmm``) whose backward needs no
    reduction over a batch of copies of its input, and splits and rotates its q, k and v
    at once (:func:`~looplm.modules.rotary.split_rotated_qkv`)."""

    qkv: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    gate: Optional[torch.Tensor]
    gate_bias: Optional[torch.Tensor]
    out: torch.Tensor


def pass_weights(attn: SoftmaxAttention, loop: GrownLoop) -> PassWeights:
    """S's rows of ``qkv`` / ``gate`` and columns of ``o_proj``: narrow views when its heads
    (and the kv heads they read) lie in consecutive slots, else gathered by the loop's
    device indices; under autocast cast once here for all K_l passes (not again by every
    pass's products). The q, k, v rows are made one matrix here, once for the K_l passes:
    a copy when S is not every head of an MHA layer (or the cast's copy under autocast)."""
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    n, m = len(loop.slots), len(loop.kv_slots)
    narrow = loop.narrow
    q0, kv0 = loop.slots[0] * D, loop.kv_slots[0] * D  # first rows of S, of its kv heads (when narrow)
    W, b = attn.qkv.weight, attn.qkv.bias
    d = W.shape[1]
    device_type = W.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None

    def ready(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:  # cast once under autocast
        return t if t is None or dtype is None else t.to(dtype)

    def q_part(t: Optional[torch.Tensor], dim: int = 0) -> Optional[torch.Tensor]:
        if t is None:
            return None
        return t.narrow(dim, q0, n * D) if narrow else t.index_select(dim, loop.pass_q_rows[: n * D])

    def kv_part(t: torch.Tensor) -> torch.Tensor:  # t: [2, H_kv·D, ...]
        return t.narrow(1, kv0, m * D) if narrow else t.index_select(1, loop.pass_kv_rows[: m * D])

    def one_matrix(blocks: list[torch.Tensor], width: tuple[int, ...]) -> torch.Tensor:
        """Row blocks [k, r, *width] or [r, *width] as one [Σ k·r, *width] matrix (a view
        where one block is contiguous, else a copy)."""
        rows = [ready(t).reshape(-1, *width) for t in blocks]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    if narrow and H == Hkv:  # one [3, n·D, ...] view of q, k, v (their blocks have the same stride)
        rows = slice(q0, q0 + n * D)
        qkv = [W.view(3, H * D, d)[:, rows]]
        qkv_bias = None if b is None else [b.view(3, H * D)[:, rows]]
    else:  # S's q rows, then the k and v rows of the kv heads S reads
        qkv = [q_part(W[: H * D]), kv_part(W[H * D:].view(2, Hkv * D, d))]
        qkv_bias = None if b is None else [q_part(b[: H * D]), kv_part(b[H * D:].view(2, Hkv * D))]
    gate_w, gate_b = (None, None) if attn.gate is None else (attn.gate.weight, attn.gate.bias)
    return PassWeights(qkv=one_matrix(qkv, (d,)), qkv_bias=None if qkv_bias is None else one_matrix(qkv_bias, ()),
                       gate=ready(q_part(gate_w)), gate_bias=ready(q_part(gate_b)),
                       out=ready(q_part(attn.o_proj.weight, 1)))


def head_subset_attention(
    attn: SoftmaxAttention, x: torch.Tensor, ctx: MixerContext, loop: GrownLoop,
    weights: Optional[PassWeights] = None, state: Optional[KVState] = None,
    residual: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, KVState]:
    """Σ_{i∈S} w_i · Attn^(i)(x) over the looping query heads S of ``attn`` (``loop.slots``)
    (Eq. 6), w_i the loop weights (a fading head), plus ``residual`` when given (Eq. 6's
    H^(k-1): added by the W_O product where the dtypes allow). No output bias (Eq. 2 has
    none per head). weights: :func:`pass_weights` (taken here when None). x, residual:
    [B, T, d] -> ([B, T, d], state holding the used key/value heads only)."""
    weights = pass_weights(attn, loop) if weights is None else weights
    B, T, d = x.shape
    D, n = attn.head_dim, len(loop.slots)

    m = (weights.qkv.shape[0] // D - n) // 2  # the kv heads S reads
    qkv = F.linear(x, weights.qkv, weights.qkv_bias).view(B, T, n + 2 * m, D)  # q and k rotated together
    q, k, v = (t.transpose(1, 2) for t in split_rotated_qkv(qkv, *ctx.rope, n, m))
    kv_index = loop.pass_kv[:n] if loop.kv_mapped else None
    y, new_state = attn.attend_rotated(q, k, v, ctx, state, kv_index)  # [B, T, n·D]
    if weights.gate is not None:  # LT2 §4.4's output gate, these heads' rows
        y = y * torch.sigmoid(F.linear(x, weights.gate, weights.gate_bias))
    if loop.scaled:  # fading heads: scale each head's output before W_O
        y = y * loop.pass_scale[: n * D].to(y.dtype)
    if residual is None:
        return F.linear(y, weights.out), new_state
    return add_product(residual, y, weights.out), new_state


@torch.no_grad()
def permute_heads(attn: SoftmaxAttention, source: Sequence[int], optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Re-parameterise ``attn`` so that head slot p holds what slot ``source[p]`` held: its
    rows of ``qkv`` (q; k and v with the kv head its group reads) and ``gate``, its columns
    of ``o_proj``; the parameters' gradients and the optimiser's per-element state (AdamW's
    exp_avg, exp_avg_sq) move alike, in place, so training continues as before. Softmax
    attention sums over heads: the layer computes the same function (to float rounding of
    that sum). ``source`` keeps each kv head's query group together (GrownLoop.set_order).
    FSDP2-sharded tensors are gathered whole on every rank, permuted and re-sharded (a
    growth event, not a step, pays this)."""
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    g = H // Hkv
    dims = torch.arange(D)
    q = (torch.tensor(list(source))[:, None] * D + dims).flatten()
    kv = (torch.tensor([source[p * g] // g for p in range(Hkv)])[:, None] * D + dims).flatten()
    qkv = torch.cat([q, H * D + kv, (H + Hkv) * D + kv])
    moves = [(attn.qkv.weight, 0, qkv), (attn.qkv.bias, 0, qkv), (attn.o_proj.weight, 1, q)]
    if attn.gate is not None:
        moves += [(attn.gate.weight, 0, q), (attn.gate.bias, 0, q)]
    for param, dim, index in moves:
        if param is None:
            continue
        index = index.to(param.device)
        state = optimizer.state.get(param, {}) if optimizer is not None else {}
        tensors = [param, param.grad] + [t for t in state.values() if torch.is_tensor(t) and t.shape == param.shape]
        for t in tensors:
            if t is None:
                continue
            if hasattr(t, "full_tensor"):  # FSDP2 shard (DTensor): every rank permutes the whole tensor, keeps its shard
                from torch.distributed.tensor import distribute_tensor

                moved = distribute_tensor(t.full_tensor().index_select(dim, index), t.device_mesh, t.placements)
                t.to_local().copy_(moved.to_local())
            else:
                t.copy_(t.index_select(dim, index))


def head_pass_cost(m: SoftmaxAttention, call: Call, heads: int, kv_heads: int) -> Cost:
    """FLOPs of one SGT head pass over ``heads`` = |S| query heads (:func:`head_subset_attention`,
    Eq. 6): the rows of ``qkv`` for S and the ``kv_heads`` kv heads S reads (all |S| of them
    under MHA; with GQA the groups S falls in, ``GrownLoop.kv_slots``), the gate's rows, the
    score/value products of |S| heads and S's columns of ``o_proj`` (no output bias)."""
    d, D = m.o_proj.out_features, m.head_dim
    rows = (heads + 2 * kv_heads) * D + (heads * D if m.gate is not None else 0)
    cost = Cost(mac=call.rows * d * rows + call.rows * heads * D * d,
                bias=call.rows * rows if m.qkv.bias is not None else 0)
    per_pair = heads * 2 * D
    full = call.batch * call.tokens * call.keys
    causal = call.batch * causal_pairs(call.tokens, call.keys, m.window)
    return cost + Cost(attn_full=full * per_pair, attn_causal=causal * per_pair)
