"""Length-normalised attention entropy (sparse-growing-transformer.txt Eqs. 4-5) and the
meter that measures it during training forwards.

Only the last query position is measured (Appendix B): it aggregates the whole context,
and one query costs O(S) per head instead of O(S²).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from looplm.mixers.attention import KVState, SoftmaxAttention
from looplm.modules.rotary import apply_rotary
from looplm.recompute import recomputing


def normalized_entropy(probs: torch.Tensor, counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E = −(1 / log N) Σ_j A_j log A_j (Eq. 4) over the last dim of ``probs`` [..., N];
    ``counts`` [...]: the number of keys each row may attend to (default N). Rows with a
    single key have entropy 0. Returns [...] in [0, 1]."""
    probs = probs.float()
    n = torch.full(probs.shape[:-1], probs.shape[-1], dtype=torch.float32, device=probs.device) if counts is None \
        else counts.float()
    plogp = torch.where(probs > 0, probs * probs.clamp_min(1e-30).log(), torch.zeros_like(probs))
    norm = n.clamp_min(2.0).log()
    return torch.where(n > 1, -plogp.sum(-1) / norm, torch.zeros_like(norm))


def layer_entropy(head_entropies: torch.Tensor) -> torch.Tensor:
    """Ē^(l) = (1 / N_head) Σ_i E^(l,i) (Eq. 5): the mean over the last (head) dim."""
    return head_entropies.mean(-1)


@torch.no_grad()
def last_query_entropy(layer: SoftmaxAttention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       keys: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E^(i) of the last position of a training forward for every head of ``layer``.

    x: [B, T, d], the attention's (normalised) input. rope: (cos, sin) [B, T, R]. keys:
    [B, H_kv, T, D] rotated keys of all T positions when the caller already has them
    (the attention's own state), else recomputed from x. valid: [B, T] real positions
    (default all). Returns [B, H]."""
    B, T, _ = x.shape
    H, Hkv, D = layer.n_heads, layer.n_kv_heads, layer.head_dim
    w = T if layer.window is None else min(T, layer.window)  # the last query sees its last w positions
    weight, bias = layer.qkv.weight, layer.qkv.bias
    q = F.linear(x[:, -1:], weight[: H * D], None if bias is None else bias[: H * D])
    q = apply_rotary(q.view(B, 1, H, D).transpose(1, 2), rope[0][:, -1:], rope[1][:, -1:])  # [B, H, 1, D]
    if keys is None or keys.shape[2] < w:
        k_rows = slice(H * D, (H + Hkv) * D)
        k = F.linear(x[:, T - w:], weight[k_rows], None if bias is None else bias[k_rows])
        keys = apply_rotary(k.view(B, w, Hkv, D).transpose(1, 2), rope[0][:, T - w:], rope[1][:, T - w:])
    keys = keys[:, :, keys.shape[2] - w:]
    # query head h reads kv head h // G: each kv head's G queries are one [G, D] matrix against
    # its keys as they are (no keys repeated to every head)
    queries = q.reshape(B, Hkv, H // Hkv, D)
    scores = torch.matmul(queries.float(), keys.float().transpose(-1, -2)).reshape(B, H, w) * D ** -0.5
    counts = None
    if valid is not None:
        allowed = valid[:, None, T - w:]
        scores = scores.masked_fill(~allowed, float("-inf"))
        counts = allowed.sum(-1).expand(B, H)
    return normalized_entropy(torch.softmax(scores, dim=-1), counts)


class EntropyMeter:
    """Accumulates E^(l,i) of the last query over every training forward of a step.

    Attaches forward hooks to the softmax layers of the measured blocks (probes' way: no
    model code changes); a hook measures only in training mode and without a decoding
    state, under ``no_grad``, reusing the attention's own keys, and not again when activation
    checkpointing recomputes the forward in the backward. A looped core block is
    measured at every iteration. :meth:`read` returns the step's mean per layer, averaged
    over data-parallel ranks (one all-reduce), and starts the next step; per head in the
    original numbering when a grown block stores its heads permuted (``head_loop.order``)."""

    def __init__(self, blocks: Sequence[nn.Module], layers: Sequence[int], n_heads: int, device: torch.device):
        self.layers = list(layers)
        self.loops = [getattr(blocks[layer], "head_loop", None) for layer in self.layers]
        self.sums = torch.zeros(len(self.layers), n_heads, device=device)
        self.counts = torch.zeros(len(self.layers), device=device)
        self._handles = []
        for row, layer in enumerate(self.layers):
            for module in blocks[layer].mixer_layers():
                if isinstance(module, SoftmaxAttention):
                    self._handles.append(module.register_forward_hook(self._hook(row)))

    def _hook(self, row: int):
        def measure(module: SoftmaxAttention, args, output) -> None:
            x, ctx, state = (tuple(args) + (None,))[:3]
            if not module.training or state is not None or recomputing():  # once per forward
                return
            new_state = output[1]
            keys = new_state.keys if isinstance(new_state, KVState) and new_state.start == 0 else None
            valid = ctx.new_valid if ctx.padded else None
            entropy = last_query_entropy(module, x.detach(), ctx.rope, keys, valid)  # [B, H]
            self.sums[row] += entropy.sum(0)
            self.counts[row] += entropy.shape[0]

        return measure

    def read(self, distributed: bool = False) -> dict[int, list[float]]:
        """{layer: mean head entropies} of the forwards since the last read (layers never
        run are absent); resets the accumulators. A host read: :meth:`step_means` is the
        same on the device."""
        means, measured = self.step_means(distributed)
        return {layer: row for layer, row, seen in zip(self.layers, means.tolist(), measured.tolist()) if seen}

    def step_means(self, distributed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean head entropies of the forwards since the last call, on the device, no
        host read: ``means`` [layers, heads] float64 (per head in the original numbering),
        and ``measured`` [layers] bool (the layers that ran; their rows of ``means`` are 0
        otherwise). Resets the accumulators. float64 division of the float32 sums: the same
        numbers a host division of the read-back sums gives."""
        totals = torch.cat([self.sums, self.counts[:, None]], dim=1)
        if distributed:
            dist.all_reduce(totals)
        self.sums.zero_()
        self.counts.zero_()
        totals = totals.double()
        counts = totals[:, -1:]
        means = (totals[:, :-1] / counts.clamp(min=1.0)).gather(1, self._original_order())
        return means, counts[:, 0] > 0

    def _original_order(self) -> torch.Tensor:
        """[layers, heads] storage slot of each original head (``head_loop.slot_of`` of a
        grown block whose heads are arranged; the identity otherwise), on the device, built
        again only when an arrangement changed it."""
        key = tuple(None if loop is None else tuple(loop.slot_of) for loop in self.loops)
        if getattr(self, "_order_key", None) != key:
            n_heads = self.sums.shape[1]
            rows = [list(range(n_heads)) if slots is None else list(slots) for slots in key]
            self._order = torch.tensor(rows, dtype=torch.long).reshape(len(rows), n_heads).to(self.sums.device)
            self._order_key = key
        return self._order

    def detach(self) -> None:
        """Remove the hooks (growth is frozen: nothing more to measure)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
