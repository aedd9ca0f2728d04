"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2) as a token mixer: a lightning indexer picks
the top-k earlier keys of every query and softmax attention (multi-head, rotary, GQA) reads
only those (LT2 Table 1, "Looped DSA"; LT2's GDN+DSA hybrid).

The main attention has SoftmaxAttention's parameters (``qkv``, ``gate``, ``o_proj``), so a
dense checkpoint loads into a DSA layer with only the ``indexer`` new (as DeepSeek-V3.2
continued from V3.1), and with top-k >= the sequence length the layer *is* that dense
attention. The math lives in :mod:`looplm.ops.sparse.dsa`.

Training the indexer: top-k passes no gradient, and the indexer reads a detached copy of
the input (DeepSeek-V3.2 §2.1.1: it is optimised by its own loss only, the rest of the
model by the language-modelling loss). In training mode each call computes the indexer
loss — KL(main attention, summed over heads and renormalised, detached ‖ softmax of the
index scores) over the selected keys, mean over real queries, times
``index_loss_weight`` — and adds it to the forward's auxiliary losses
(``ctx.add_loss("dsa_index", ...)``); the model sums those of every DSA call (all blocks
and loop iterations) into ``ModelOutput.aux_losses`` and its training loss. Dense warm-up (Eq. (2)) is the same loss with top_k >= max_seq_len.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost, causal_pairs, children_cost, module_cost
from looplm.config_base import ConfigError, check
from looplm.mixers.base import MixerContext
from looplm.mixers.config import MixerConfig
from looplm.mixers.reserve import MIN_SPARE, SPARE, Reserve, extend
from looplm.modules.rotary import apply_rotary
from looplm.modules.shape import BlockShape
from looplm.ops.backend import KERNELS, log_backend, use_triton
from looplm.ops.grouped_attention import attend_grouped
from looplm.ops.sparse.dsa import decode_step, dsa_attention


@dataclasses.dataclass(frozen=True)
class DSAConfig(MixerConfig):
    """DeepSeek Sparse Attention. Paper values (DeepSeek-V3.2 §2): top_k = 2048, H^I = 64
    indexer heads of d^I = 128; the defaults are small.

    top_k: keys each query attends to (itself among the candidates, not forced).
    index_heads, index_head_dim: H^I and d^I of the lightning indexer (rotary on its
    first rotary-dim channels, so index_head_dim >= the model's rotary dim).
    index_loss_weight: factor on the indexer's KL loss returned in training.
    output_gate: LT2's SDPA output gate (§4.4).
    kernel: where the attention over the selected keys runs in prefill and training: "auto"
    (a Triton kernel on CUDA that reads the selected rows in place, the PyTorch reference
    elsewhere), "torch" (the reference everywhere, e.g. to rule the kernel out), "triton"
    (the kernel everywhere; on CPU only under TRITON_INTERPRET=1, for tests). Same results
    to float rounding; decoding steps always run the PyTorch path.
    """

    kind: str = "dsa"
    output_gate: bool = False
    top_k: int = 64
    index_heads: int = 4
    index_head_dim: int = 32
    index_loss_weight: float = 1.0
    kernel: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.top_k >= 1, "model.mixer.top_k", self.top_k, "an integer >= 1")
        check(self.index_heads >= 1, "model.mixer.index_heads", self.index_heads, "an integer >= 1")
        check(self.index_head_dim >= 1, "model.mixer.index_head_dim", self.index_head_dim, "an integer >= 1")
        check(self.index_loss_weight >= 0, "model.mixer.index_loss_weight", self.index_loss_weight, "a number >= 0")
        check(self.kernel in KERNELS, "model.mixer.kernel", self.kernel, "one of " + ", ".join(KERNELS))

    def build(self, shape: BlockShape) -> nn.Module:
        if self.index_head_dim < shape.rotary_dim:
            raise ConfigError(
                "model.mixer.index_head_dim", self.index_head_dim,
                f"an integer >= the rotary dim {shape.rotary_dim} (head_dim × rotary_pct): the indexer is rotary too",
            )
        return DeepSeekSparseAttention(
            shape.d_model, shape.n_heads, shape.kv_heads, shape.bias,
            top_k=self.top_k, index_heads=self.index_heads, index_head_dim=self.index_head_dim,
            index_loss_weight=self.index_loss_weight, output_gate=self.output_gate, kernel=self.kernel,
        )

    @property
    def is_softmax(self) -> bool:
        return True


@dataclasses.dataclass
class DSAState:
    """DSA's decoding state: keys, values [B, H_kv, S, D] (rotated) and index keys
    [B, S, d^I] of every position; ``spare``: the buffers they are views of (decoding
    appends in place, :mod:`looplm.mixers.reserve`); ``positions``: an int32 arange of at
    least S entries that the decoding top-k reuses for its tie-break (never written, so
    states share it; grown geometrically with the cache instead of built every step)."""

    keys: torch.Tensor
    values: torch.Tensor
    index_keys: torch.Tensor
    spare: tuple[Optional[Reserve], ...] = dataclasses.field(default=(None, None, None), repr=False, compare=False)
    positions: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)

    def crop(self, length: int) -> "DSAState":
        return DSAState(self.keys[:, :, :length], self.values[:, :, :length], self.index_keys[:, :length], self.spare,
                        self.positions)

    def select(self, index: torch.Tensor) -> "DSAState":
        return DSAState(self.keys[index], self.values[index], self.index_keys[index], positions=self.positions)

    def static(self, capacity: int) -> "StaticDSAState":
        """The keys, values and index keys in buffers preallocated for ``capacity`` positions
        (:mod:`looplm.cache`)."""
        B, Hkv, S, D = self.keys.shape
        keys, values = self.keys.new_zeros(B, Hkv, capacity, D), self.values.new_zeros(B, Hkv, capacity, D)
        index_keys = self.index_keys.new_zeros(B, capacity, self.index_keys.shape[-1])
        keys[:, :, :S], values[:, :, :S], index_keys[:, :S] = self.keys, self.values, self.index_keys
        return StaticDSAState(keys, values, index_keys, torch.arange(capacity, dtype=torch.int32, device=keys.device))


@dataclasses.dataclass
class StaticDSAState:
    """DSA's state in a static cache: keys, values [B, H_kv, C, D] and index keys [B, C, d^I]
    preallocated for C positions, written in place at the step's rows; ``positions`` the
    int32 arange(C) of the decoding top-k's tie-break. A step scores every row and picks
    among the valid ones at or before it (:func:`~looplm.ops.sparse.dsa.decode_step`)."""

    keys: torch.Tensor
    values: torch.Tensor
    index_keys: torch.Tensor
    positions: torch.Tensor

    def write(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index_keys: torch.Tensor) -> None:
        self.keys.index_copy_(2, rows, keys)
        self.values.index_copy_(2, rows, values)
        self.index_keys.index_copy_(1, rows, index_keys)

    rewind = None  # a crop may remove any number of positions: their rows are rewritten

    def crop(self, length: int) -> "StaticDSAState":
        return self

    def select(self, index: torch.Tensor) -> "StaticDSAState":
        """Reorder the rows in place (beam search keeps the batch size)."""
        if index.shape[0] != self.keys.shape[0]:
            return StaticDSAState(self.keys[index], self.values[index], self.index_keys[index], self.positions)
        for buffer in (self.keys, self.values, self.index_keys):
            buffer.copy_(buffer[index])
        return self


def _positions(state: Optional[DSAState], length: int, device: torch.device) -> torch.Tensor:
    """``state``'s positions when they cover ``length``, else a new int32 arange with spare room."""
    if state is not None and state.positions is not None and state.positions.shape[0] >= length:
        return state.positions
    return torch.arange(length + max(math.ceil(length * SPARE), MIN_SPARE), dtype=torch.int32, device=device)


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: H^I query heads and one shared (MQA) key per token,
    LayerNorm on the key, rotary on both, per-head weights w_{t,j} = (x W_w)_j / √H^I."""

    def __init__(self, dim: int, heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, head_dim, bias=bias)
        self.k_norm = nn.LayerNorm(head_dim)
        self.w_proj = nn.Linear(dim, heads, bias=False)

    def project(
        self, x: torch.Tensor, queries: bool = True
    ) -> tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
        """x: [B, T, d] -> (q^I [B, H^I, T, d^I], k^I [B, 1, T, d^I], both not yet rotated, w [B, T, H^I]).
        ``queries`` False: only the index key (q^I and w are None), for positions whose
        top-k is every candidate: the cache needs their index keys, nothing their scores."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x))[:, None]
        if not queries:
            return None, k, None
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        return q, k, self.w_proj(x) * self.heads**-0.5

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, d] -> (q^I [B, T, H^I, d^I], k^I [B, T, d^I], w [B, T, H^I]), rotated."""
        q, k, w = self.project(x)
        q, k = rotate_together([q, k], *rope)
        return q.transpose(1, 2), k[:, 0], w


def rotate_together(tensors: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """:func:`~looplm.modules.rotary.apply_rotary` of each of ``tensors`` ([B, N_i, T, D_i],
    D_i >= R; cos, sin [B, T, R]) as one application to all their first R channels,
    concatenated: elementwise, so the same numbers, in 1 + n operators plus one rotation
    instead of n rotations (a decoding step of DSA rotates its queries, keys, index queries
    and index key); a tensor rotated whole (D_i = R) needs no concatenation back. Each
    result is a contiguous [B, N_i, T, D_i]."""
    R = cos.shape[-1]
    if R == 0:
        return list(tensors)
    rotated = apply_rotary(torch.cat([t[..., :R] for t in tensors], dim=1), cos, sin)  # [B, ΣN_i, T, R]
    parts = rotated.split([t.shape[1] for t in tensors], dim=1)  # contiguous: split along dim 1
    return [r if t.shape[-1] == R else torch.cat([r, t[..., R:]], dim=-1) for r, t in zip(parts, tensors)]


class DeepSeekSparseAttention(nn.Module):
    """Top-k sparse softmax attention; the selection is shared by all heads of a query."""

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, bias: bool, *, top_k: int, index_heads: int,
        index_head_dim: int, index_loss_weight: float = 1.0, output_gate: bool = False, kernel: str = "auto",
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.top_k, self.index_loss_weight, self.kernel = top_k, index_loss_weight, kernel
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)
        self.indexer = LightningIndexer(dim, index_heads, index_head_dim, bias)
        self.gate = nn.Linear(dim, n_heads * self.head_dim, bias=bias) if output_gate else None
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=bias)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}"

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[DSAState] = None
    ) -> tuple[torch.Tensor, DSAState]:
        """x: [B, T, d] -> ([B, T, d], state after these T positions)."""
        B, T, _ = x.shape
        log_backend("dsa", "triton" if T > 1 and use_triton(x, self.kernel) else "torch")
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        static = isinstance(state, StaticDSAState)
        if static:  # the rows a query may read: the whole buffer for a decoding step
            length = state.keys.shape[2] if T == 1 else int(ctx.slots[-1]) + 1  # a chunk runs eagerly
        else:
            length = T + (0 if state is None else state.keys.shape[2])
        # a query at position t < top_k selects every candidate: no index scores, unless a
        # later query selects or the indexer loss (training) needs them
        scored = self.training or length > self.top_k
        qkv = self.qkv(x).view(B, T, H + 2 * Hkv, D).transpose(1, 2)  # [B, H + 2 H_kv, T, D]
        q_index, k_index, w_index = self.indexer.project(x.detach(), queries=scored)  # detached: own loss only
        index = [k_index] if q_index is None else [q_index, k_index]
        q, k, *index = rotate_together([qkv[:, :H], qkv[:, H:H + Hkv], *index], *ctx.rope)
        q_index = index[0].transpose(1, 2) if scored else None  # [B, T, H^I, d^I]
        k_index, v = index[-1][:, 0], qkv[:, H + Hkv:]  # [B, T, d^I]
        q = q.reshape(B, Hkv, H // Hkv, T, D)
        if static:
            o, new_state = self._attend_static(q, k, v, q_index, k_index, w_index, ctx, state, length), state
        else:
            spare, positions = (None, None, None), None
            if state is not None:  # appended into the cache's spare rows, not a copy of the whole cache
                (k, k_spare), (v, v_spare) = (extend(state.keys, k, 2, state.spare[0]),
                                              extend(state.values, v, 2, state.spare[1]))
                k_index, i_spare = extend(state.index_keys, k_index, 1, state.spare[2])
                spare = (k_spare, v_spare, i_spare)
                positions = _positions(state, k.shape[2], x.device) if scored else state.positions
            o, index_loss = dsa_attention(
                q, k, v, q_index, k_index, w_index, ctx.valid if ctx.padded else None,
                top_k=self.top_k, scale=D**-0.5, index_loss=self.training, positions=positions,
                kernel=self.kernel,
            )  # o: [B, H_kv, G, T, D]
            if index_loss is not None:
                ctx.add_loss("dsa_index", self.index_loss_weight * index_loss)
            new_state = DSAState(k, v, k_index, spare, positions)
        y = o.view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)
        if self.gate is not None:
            y = y * torch.sigmoid(self.gate(x))  # LT2 §4.4: head-specific elementwise output gate
        return self.o_proj(y), new_state

    def _attend_static(self, q, k, v, q_index, k_index, w_index, ctx: MixerContext,
                       state: StaticDSAState, length: int) -> torch.Tensor:
        """DSA against a static cache: write the new rows, then one query picks among the
        valid rows at or before it (the captured decoding step); several new positions
        (an eager chunk) attend over the ``length`` rows written so far. A buffer of at most
        top_k rows holds at most top_k candidates for any query: every candidate is
        selected, so a decoding step is plain attention over the buffer."""
        state.write(ctx.slots, k, v, k_index)
        if q.shape[3] == 1:
            bias = ctx.static_bias(("window", None), q.dtype)  # [B, 1, 1, C]: 0 on causal, valid rows and itself
            if length > self.top_k:
                return decode_step(q, state.keys, state.values, q_index, state.index_keys, w_index, None,
                                   top_k=self.top_k, scale=self.head_dim**-0.5, positions=state.positions,
                                   bias=bias[:, 0, 0])
            B, Hkv, G, _, D = q.shape  # grouped heads folded over the buffer as it is (attend_grouped)
            o = attend_grouped(q.view(B, Hkv * G, 1, D), state.keys, state.values, bias, scale=self.head_dim**-0.5)
            return o.view(B, Hkv, G, 1, D)
        o, _ = dsa_attention(q, state.keys[:, :, :length], state.values[:, :, :length], q_index,
                             state.index_keys[:, :length], w_index, ctx.valid[:, :length] if ctx.padded else None,
                             top_k=self.top_k, scale=self.head_dim**-0.5, kernel=self.kernel)
        return o

    #: a training forward scores every query (the indexer loss), inference only the later ones
    flop_cost_reads_training = True

    def flop_cost(self, call: Call) -> Cost:
        """Projections; the indexer's scores (H^I·d^I MACs per pair, plus the head weights)
        over the causal keys of the queries that need them — in inference those at positions
        >= top_k (an earlier one selects every candidate: no scores, and no index query or
        weight projection while no query is past top_k), in training every query (the
        indexer loss, Eq. (2)); attention over each query's min(t + 1, top_k) keys. Not
        counted: the indexer loss's attention target (recomputed without gradient)."""
        cost = children_cost(self, call)
        idx = self.indexer
        if not (call.training or call.keys > self.top_k):
            cost = cost + (module_cost(idx.q_proj, call) + module_cost(idx.w_proj, call)).scale(-1)
        first = call.keys - call.tokens
        scored = max(call.keys - (first if call.training else max(first, self.top_k)), 0)  # the last queries
        causal = call.batch * causal_pairs(scored, call.keys)
        full = call.batch * scored * call.keys
        index_per_pair = idx.heads * (idx.head_dim + 1)
        cost = cost + Cost(attn_full=full * index_per_pair, attn_causal=causal * index_per_pair)
        kept = call.batch * sum(min(i + 1, self.top_k) for i in range(call.keys - call.tokens, call.keys))
        per_pair = self.n_heads * 2 * self.head_dim
        return cost + Cost(attn_full=kept * per_pair, attn_causal=kept * per_pair)
