"""Native Sparse Attention (NSA; Yuan et al. 2025) as a token mixer: compressed, selected and
sliding-window branches mixed by per-head sigmoid gates (LT2 Table 1, "Looped NSA").

Parameterised as flash-linear-attention's ``fla.layers.nsa.NativeSparseAttention``:
``q_proj`` / ``k_proj`` / ``v_proj`` (GQA), ``g_proj`` (d -> 3 gates per query head, in the
order compressed, selected, window; no bias), rotary q and k, mean-pooled compressed keys
and values, and ``o_proj``. ``compression="mlp"`` uses the paper's learned φ instead (an MLP
over the l keys of a block plus an intra-block position embedding, NSA Eq. (7)).
The math lives in :mod:`looplm.ops.sparse.nsa`.

Left padding: a row's blocks are cut in its own positions (the rotary positions), so a
padded row computes exactly what the same row computes unpadded; the keys are compacted
(real tokens first) before the branches run. Decoding keeps every rotated key and value
(the selected branch may pick any block; the window and the partly filled current
compression block read the most recent ones) plus the compressed blocks completed so far.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost, causal_pairs, children_cost, module_cost
from looplm.config_base import check
from looplm.ops.backend import log_backend
from looplm.mixers.base import MixerContext
from looplm.mixers.config import MixerConfig
from looplm.mixers.reserve import Reserve, extend
from looplm.modules.rotary import apply_rotary
from looplm.modules.shape import BlockShape
from looplm.ops.sparse.common import gather_rows
from looplm.ops.sparse.nsa import compressed_block_count, nsa_attention, nsa_static_attention


@dataclasses.dataclass(frozen=True)
class NSAConfig(MixerConfig):
    """Native Sparse Attention. Paper values (NSA §4.1, 27B model): l = 32, d = 16, l' = 64,
    n = 16, w = 512, learned-MLP compression. fla's layer: l = d = l' = 64, n = 16, w = 512,
    mean compression. The defaults are small sizes with fla's l = d = l' convention.

    block_size: l, tokens per compressed block. block_stride: d, distance between
    compressed blocks (d <= l, so every token is in one; null: d = l). select_block_size:
    l' (null: l' = l). select_blocks:
    n, selected blocks per query and KV group, the initial block and the two local ones
    included (so n >= 3). window: w, sliding-window length (0: no window branch, fla's
    convention). compression: "mean" (fla) or "mlp" (the paper's φ). output_gate: LT2's
    SDPA output gate (§4.4).
    """

    kind: str = "nsa"
    output_gate: bool = False
    block_size: int = 16
    block_stride: Optional[int] = None
    select_block_size: Optional[int] = None
    select_blocks: int = 4
    window: int = 64
    compression: Literal["mean", "mlp"] = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.block_size >= 1, "model.mixer.block_size", self.block_size, "an integer >= 1")
        check(
            self.block_stride is None or 1 <= self.block_stride <= self.block_size, "model.mixer.block_stride",
            self.block_stride,
            f"null or an integer in [1, block_size={self.block_size}] so that every token lies in a compressed block",
        )
        check(
            self.select_block_size is None or self.select_block_size >= 1, "model.mixer.select_block_size",
            self.select_block_size, "null or an integer >= 1",
        )
        check(
            self.select_blocks >= 3, "model.mixer.select_blocks", self.select_blocks,
            "an integer >= 3: the initial block and the two local blocks are always selected (NSA §3.3.2)",
        )
        check(self.window >= 0, "model.mixer.window", self.window, "an integer >= 0 (0: no sliding-window branch)")

    def build(self, shape: BlockShape) -> nn.Module:
        return NativeSparseAttention(
            shape.d_model, shape.n_heads, shape.kv_heads, shape.bias,
            block_size=self.block_size, block_stride=self.stride,
            select_block_size=self.select_size, select_blocks=self.select_blocks,
            window=self.window, compression=self.compression, output_gate=self.output_gate,
        )

    @property
    def stride(self) -> int:
        """d: block_stride, or l when unset."""
        return self.block_size if self.block_stride is None else self.block_stride

    @property
    def select_size(self) -> int:
        """l': select_block_size, or l when unset."""
        return self.block_size if self.select_block_size is None else self.select_block_size

    @property
    def is_softmax(self) -> bool:
        return True


@dataclasses.dataclass
class NSAState:
    """NSA's decoding state after S positions.

    keys, values: [B, H_kv, S, D], rotated, every position in order (padding included;
    it is never attended to). valid: [B, S], the real positions (to recount a row's complete
    blocks after ``crop``). k_cmp, v_cmp: [B, H_kv, N, D], the compressed blocks in each
    row's own positions; row b has ``compressed_block_count(valid[b].sum())`` of them and N is
    the largest count (later entries of shorter rows are unused). The partly filled block
    is not stored compressed: its raw keys are the last ones of ``keys``. ``spare``: the
    buffers of keys, values, k_cmp and v_cmp (decoding appends in place,
    :mod:`looplm.mixers.reserve`).
    """

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    block_size: int
    block_stride: int
    spare: tuple[Optional[Reserve], ...] = dataclasses.field(
        default=(None, None, None, None), repr=False, compare=False
    )

    def _trimmed(self, keys, values, valid, k_cmp, v_cmp, spare=(None, None, None, None)) -> "NSAState":
        counts = compressed_block_count(valid.sum(dim=1), self.block_size, self.block_stride)
        n = int(counts.max()) if counts.numel() else 0
        return NSAState(keys, values, valid, k_cmp[:, :, :n], v_cmp[:, :, :n], self.block_size, self.block_stride,
                        spare)

    def crop(self, length: int) -> "NSAState":
        return self._trimmed(
            self.keys[:, :, :length], self.values[:, :, :length], self.valid[:, :length], self.k_cmp, self.v_cmp,
            self.spare,
        )

    def select(self, index: torch.Tensor) -> "NSAState":
        return self._trimmed(
            self.keys[index], self.values[index], self.valid[index], self.k_cmp[index], self.v_cmp[index]
        )

    def static(self, capacity: int) -> "StaticNSAState":
        """The keys, values and compressed blocks in buffers preallocated for ``capacity``
        columns (:mod:`looplm.cache`), and each row's map from its own positions to columns."""
        B, Hkv, S, D = self.keys.shape
        keys, values = self.keys.new_zeros(B, Hkv, capacity, D), self.values.new_zeros(B, Hkv, capacity, D)
        keys[:, :, :S], values[:, :, :S] = self.keys, self.values
        n_cmp = compressed_block_count(capacity, self.block_size, self.block_stride)
        k_cmp, v_cmp = (x.new_zeros(B, Hkv, n_cmp + 1, D) for x in (self.k_cmp, self.v_cmp))
        N = self.k_cmp.shape[2]
        k_cmp[:, :, :N], v_cmp[:, :, :N] = self.k_cmp, self.v_cmp
        column_of = torch.zeros(B, capacity + 1, dtype=torch.long, device=keys.device)
        column_of[:, :S] = torch.sort((~self.valid).to(torch.uint8), dim=1, stable=True).indices  # real first
        return StaticNSAState(keys, values, column_of, k_cmp, v_cmp, self.block_size, self.block_stride)


@dataclasses.dataclass
class StaticNSAState:
    """NSA's state in a static cache of C columns, written in place (no host read, so one
    captured decoding step serves every step).

    keys, values: [B, H_kv, C, D] by column, as the growing state (padding columns never
    read). column_of: [B, C + 1] long, row b's column of its position c (its c-th real
    token); entry C takes the writes of padding tokens. k_cmp, v_cmp: [B, H_kv, N + 1, D],
    compressed block j of each row's own positions (N = the blocks C positions complete);
    entry N takes the writes of positions that complete no block. Every index is derived from
    the cache's validity, so a crop needs nothing undone (``rewind = None``): the entries
    past the new length are written again when their positions come back."""

    keys: torch.Tensor
    values: torch.Tensor
    column_of: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    block_size: int
    block_stride: int

    rewind = None

    def crop(self, length: int) -> "StaticNSAState":
        return self

    def select(self, index: torch.Tensor) -> "StaticNSAState":
        """Reorder the rows in place (beam search keeps the batch size)."""
        buffers = (self.keys, self.values, self.column_of, self.k_cmp, self.v_cmp)
        if index.shape[0] != self.keys.shape[0]:
            return StaticNSAState(*(b[index] for b in buffers), self.block_size, self.block_stride)
        for buffer in buffers:
            buffer.copy_(buffer[index])
        return self


class BlockCompressor(nn.Module):
    """NSA's learned φ (Eq. (7)): an MLP over the l keys (or values) of a block, each plus
    its intra-block position embedding; [.., l, D] -> [.., D]. Hidden width D; shared by
    the KV heads."""

    def __init__(self, block_size: int, head_dim: int):
        super().__init__()
        self.position = nn.Parameter(torch.zeros(block_size, head_dim))
        self.mlp = nn.Sequential(nn.Linear(block_size * head_dim, head_dim), nn.GELU(), nn.Linear(head_dim, head_dim))

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        return self.mlp((blocks + self.position).flatten(-2))

    def flop_cost(self, call: Call) -> Cost:
        """φ on ``call.tokens`` blocks of ``call.batch`` KV heads: the MLP once per block (the
        position embedding's addition left out). NSA's rule calls it with that shape."""
        return children_cost(self.mlp, call)


class NativeSparseAttention(nn.Module):
    """NSA with GQA: query head h·G + g reads KV head h, and a KV group shares its selected
    blocks (NSA §3.4). ``gate`` (output gate): W_θ, d -> H·D, as in SoftmaxAttention."""

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, bias: bool, *, block_size: int, block_stride: int,
        select_block_size: int, select_blocks: int, window: int, compression: str = "mean",
        output_gate: bool = False,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.block_size, self.block_stride = block_size, block_stride
        self.select_block_size, self.select_blocks = select_block_size, select_blocks
        self.window, self.compression = window, compression
        H, Hkv, D = n_heads, n_kv_heads, self.head_dim
        self.q_proj = nn.Linear(dim, H * D, bias=bias)
        self.k_proj = nn.Linear(dim, Hkv * D, bias=bias)
        self.v_proj = nn.Linear(dim, Hkv * D, bias=bias)
        self.g_proj = nn.Linear(dim, 3 * H, bias=False)  # fla: (g_cmp, g_slc, g_swa) per head
        self.k_compress = BlockCompressor(block_size, D) if compression == "mlp" else None
        self.v_compress = BlockCompressor(block_size, D) if compression == "mlp" else None
        self.gate = nn.Linear(dim, H * D, bias=bias) if output_gate else None
        self.o_proj = nn.Linear(H * D, dim, bias=bias)

    def extra_repr(self) -> str:
        return (
            f"l={self.block_size}, d={self.block_stride}, l'={self.select_block_size}, "
            f"n={self.select_blocks}, w={self.window}, compression={self.compression}"
        )

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[NSAState] = None
    ) -> tuple[torch.Tensor, NSAState]:
        """x: [B, T, d] -> ([B, T, d], state after these T positions)."""
        log_backend("nsa", "torch")
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        G = H // Hkv
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)  # [B, H_kv, T, D]
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        q, k = apply_rotary(q, *ctx.rope), apply_rotary(k, *ctx.rope)
        gates = torch.sigmoid(self.g_proj(x)).view(B, T, Hkv, G, 3).permute(0, 2, 3, 1, 4)  # [B, H_kv, G, T, 3]
        if isinstance(state, StaticNSAState):
            o = self._attend_static(q.view(B, Hkv, G, T, D), k, v, gates, ctx, state)
            return self._output(o, x), state
        spare = (None, None, None, None) if state is None else state.spare
        if state is not None:  # appended into the cache's spare rows, not a copy of the whole cache
            (k, k_spare), (v, v_spare) = (extend(state.keys, k, 2, spare[0]),
                                          extend(state.values, v, 2, spare[1]))
            spare = (k_spare, v_spare, *spare[2:])
        S, past = k.shape[2], ctx.past

        # each row in its own positions: real keys first, key c at position c
        if ctx.padded:
            rank = ctx.valid.long().cumsum(dim=1) - 1  # [B, S] position of each real token
            positions = torch.where(ctx.new_valid, rank[:, past:], torch.full_like(rank[:, past:], -1))
            order = torch.sort((~ctx.valid).to(torch.uint8), dim=1, stable=True).indices  # [B, S]
            index = order[:, None, :, None].expand(B, Hkv, S, D)
            k_pos, v_pos = k.gather(2, index), v.gather(2, index)
            n_past, n_now = ctx.valid[:, :past].sum(dim=1), ctx.valid.sum(dim=1)
        else:
            positions = torch.arange(past, S, device=x.device).expand(B, T)
            k_pos, v_pos = k, v
            n_past, n_now = torch.full((B,), past, device=x.device), torch.full((B,), S, device=x.device)
        k_cmp, k_cmp_spare = self._compress(k_pos, n_past, n_now, self.k_compress,
                                            None if state is None else state.k_cmp, spare[2])
        v_cmp, v_cmp_spare = self._compress(v_pos, n_past, n_now, self.v_compress,
                                            None if state is None else state.v_cmp, spare[3])
        spare = (*spare[:2], k_cmp_spare, v_cmp_spare)

        o, _ = nsa_attention(
            q.view(B, Hkv, G, T, D), k_pos, v_pos, k_cmp, v_cmp, gates, positions,
            block_size=self.block_size, stride=self.block_stride, select_size=self.select_block_size,
            n_select=self.select_blocks, window=self.window, scale=D**-0.5,
        )
        new_state = NSAState(k, v, ctx.valid, k_cmp, v_cmp, self.block_size, self.block_stride, spare)
        return self._output(o, x), new_state

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [B, H_kv, G, T, D] -> [B, T, d]: heads merged, the output gate, o_proj."""
        B, T, _ = x.shape
        y = o.reshape(B, self.n_heads, T, self.head_dim).transpose(1, 2).reshape(B, T, -1)
        if self.gate is not None:
            y = y * torch.sigmoid(self.gate(x))  # LT2 §4.4: head-specific elementwise output gate
        return self.o_proj(y)

    def _attend_static(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor,
                       ctx: MixerContext, state: StaticNSAState) -> torch.Tensor:
        """NSA against a static cache, with no host read: write the new keys and values at
        their columns, record each new real token's column under its position, compress the
        blocks the new positions complete, then the three branches with fixed widths
        (:func:`~looplm.ops.sparse.nsa.nsa_static_attention`)."""
        B, Hkv, T, D = k.shape
        C = state.keys.shape[2]
        l, d = self.block_size, self.block_stride
        state.keys.index_copy_(2, ctx.slots, k)
        state.values.index_copy_(2, ctx.slots, v)
        new_valid = ctx.new_valid  # [B, T]
        before = ctx.valid.sum(dim=1, keepdim=True) - new_valid.sum(dim=1, keepdim=True)  # [B, 1] real tokens before
        rank = before + new_valid.long().cumsum(dim=1) - 1
        positions = torch.where(new_valid, rank, torch.full_like(rank, -1))  # [B, T] each row in its own positions
        state.column_of.scatter_(1, torch.where(new_valid, rank, torch.full_like(rank, C)), ctx.slots.expand(B, T))
        # block j = (p - l + 1) / d ends at position p: compress it from its l keys (Eq. (7))
        start = positions - (l - 1)
        complete = new_valid & (start >= 0) & (torch.remainder(start, d) == 0)
        n_cmp = state.k_cmp.shape[2] - 1
        block = torch.where(complete, start.div(d, rounding_mode="floor"), torch.full_like(start, n_cmp))
        members = (start.clamp(min=0)[..., None] + torch.arange(l, device=k.device)).view(B, T * l)
        columns = state.column_of.gather(1, members.clamp(max=C)).clamp(max=C - 1)
        target = block[:, None, :, None].expand(B, Hkv, T, D)
        for keys, cmp, phi in ((state.keys, state.k_cmp, self.k_compress), (state.values, state.v_cmp, self.v_compress)):
            blocks = gather_rows(keys, columns).view(B, Hkv, T, l, D)
            cmp.scatter_(2, target, blocks.mean(dim=-2) if phi is None else phi(blocks))
        return nsa_static_attention(
            q, state.keys, state.values, state.column_of, state.k_cmp[:, :, :n_cmp], state.v_cmp[:, :, :n_cmp],
            gates, positions, block_size=l, stride=d, select_size=self.select_block_size,
            n_select=self.select_blocks, window=self.window, scale=D**-0.5,
        )

    def _compress(
        self, x: torch.Tensor, n_past: torch.Tensor, n_now: torch.Tensor,
        phi: Optional[BlockCompressor], cached: Optional[torch.Tensor], reserve: Optional[Reserve],
    ) -> tuple[torch.Tensor, Optional[Reserve]]:
        """Compressed blocks [B, H_kv, N, D] of x [B, H_kv, S, D] (positions in order) for
        rows with n_now [B] real positions, reusing ``cached`` (blocks complete at n_past),
        and their reserve: blocks completed now are appended in place when every row had all
        of ``cached``'s blocks (the unpadded case)."""
        l, d = self.block_size, self.block_stride
        done_before = compressed_block_count(n_past, l, d)  # [B]
        n_new = int(compressed_block_count(n_now, l, d).max())
        lo = int(done_before.min()) if cached is not None else 0  # every row has blocks < lo cached
        if n_new > lo:
            blocks = x[:, :, lo * d : (n_new - 1) * d + l].unfold(2, l, d).transpose(-1, -2)  # [B, H_kv, n, l, D]
            fresh = blocks.mean(dim=-2) if phi is None else phi(blocks)  # Eq. (7)
        else:
            fresh = x.new_zeros(x.shape[0], x.shape[1], 0, x.shape[3])
        if cached is None:
            return fresh, None
        n_old = cached.shape[2]  # <= n_new: a row's count never shrinks
        if n_old == lo:  # every row has all cached blocks: only append the new ones (none on most steps)
            return (cached, reserve) if fresh.shape[2] == 0 else extend(cached, fresh, 2, reserve)
        j = torch.arange(lo, n_old, device=x.device)
        keep = (j[None, :] < done_before[:, None])[:, None, :, None]  # [B, 1, n_old - lo, 1]
        middle = torch.where(keep, cached[:, :, lo:n_old], fresh[:, :, : n_old - lo])
        return torch.cat([cached[:, :, :lo], middle, fresh[:, :, n_old - lo :]], dim=2), None

    def flop_cost(self, call: Call) -> Cost:
        """Projections; φ on each compressed block of keys and values; the three branches'
        score/value products over the keys each query sees (the sparse kernel's count):
        compressed blocks, ``select_blocks`` blocks of ``select_block_size``, the window."""
        cost = Cost()
        for child in self.children():
            if not isinstance(child, BlockCompressor):
                cost = cost + module_cost(child, call)
        l, d = self.block_size, self.block_stride
        blocks = max(0, (call.keys - l) // d + 1)
        if self.k_compress is not None:
            per_block = module_cost(self.k_compress, Call(call.batch * self.n_kv_heads, blocks, blocks))
            cost = cost + per_block.scale(2)  # keys and values
        seen = range(call.keys - call.tokens, call.keys)
        compressed = sum(max(0, (i + 1 - l) // d + 1) for i in seen)
        selected = sum(min(i + 1, self.select_blocks * self.select_block_size) for i in seen)
        window = causal_pairs(call.tokens, call.keys, self.window) if self.window else 0
        per_pair = self.n_heads * 2 * self.head_dim
        pairs = call.batch * (compressed + selected + window)
        return cost + Cost(attn_full=pairs * per_pair, attn_causal=pairs * per_pair)
