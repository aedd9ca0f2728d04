"""Grouped linear map: rows sorted by group, each group through its own weight matrix.

The dropless mixture-of-experts FFN (:mod:`looplm.modules.moe`) sends every (token, expert)
assignment through its expert, with no capacity limit: after sorting the assignments by
expert, expert e owns the rows ``offsets[e-1]:offsets[e]``. Two forms compute the same
products (tested against each other and a per-expert loop, forward and backward):

- ``grouped_mm``: one ``torch._grouped_mm`` call (CUTLASS on Hopper with bf16; PyTorch's
  own fallback on CPU with float32 / bf16). The group boundaries stay on the device: no
  host sync, one launch per projection.
- ``loop``: the group sizes read on the host once (one sync per call), then one
  ``F.linear`` per non-empty group on a narrow view, written into one output. Runs
  everywhere, in every dtype; PyTorch's FLOP counter sees its matmuls (it counts nothing
  for ``_grouped_mm``).
- ``gather``: each row's matrix gathered ([R, out, in]) and one batched product: no host
  sync and no data-dependent shapes, so a captured decoding step stays one graph where
  ``_grouped_mm`` cannot run (float32 under ``torch.compile``). It materialises R·out·in
  weights: meant for the few rows of a decoding step.

``auto`` picks ``grouped_mm`` where it runs, else ``gather`` while torch.compile traces
without gradients (a captured decoding step), else ``loop`` (a compiled training step breaks
its graph at the group sizes rather than materialise a weight matrix per routed token; train
in bf16 on Hopper for one graph).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F

from looplm.ops.backend import log_backend

Kernel = Literal["auto", "grouped_mm", "loop", "gather"]


@dataclasses.dataclass(frozen=True)
class Groups:
    """Rows sorted by group: ``offsets`` [G] int32, the cumulative group sizes
    (offsets[-1] == R); ``ids`` [R], the group of each row (non-decreasing)."""

    offsets: torch.Tensor
    ids: torch.Tensor


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs this product: the op exists, strides are 16-byte
    aligned (its requirement), and the device and dtype are ones it serves: CUDA with bf16
    on compute capability >= 9.0; CPU with float32 or bf16, eagerly (its compile-time
    shape function accepts bf16 only)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if any((size * x.element_size()) % 16 for size in (x.shape[-1], weight.shape[-2])):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    if x.device.type != "cpu":
        return False
    return x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and not torch.compiler.is_compiling())


def resolve_kernel(kernel: Kernel, x: torch.Tensor, weight: torch.Tensor) -> Kernel:
    """The form ``auto`` stands for here (module docstring); a named form as it is."""
    if kernel != "auto":
        return kernel
    if grouped_mm_supported(x, weight):
        return "grouped_mm"
    return "gather" if torch.compiler.is_compiling() and not torch.is_grad_enabled() else "loop"


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: Groups, kernel: Kernel = "auto") -> torch.Tensor:
    """y[r] = x[r] @ weight[g(r)]ᵀ for rows r of group g(r).

    x: [R, in], rows sorted by group. weight: [G, out, in] (one ``nn.Linear``-shaped matrix
    per group). Under autocast both are cast to its dtype first, as ``F.linear``'s would be
    (so bf16 autocast on Hopper runs ``grouped_mm``). groups: the rows' groups
    (:class:`Groups`). kernel: ``grouped_mm``, ``loop``, ``gather`` or ``auto``
    (:func:`resolve_kernel`, logged once per form). Returns [R, out]."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    kernel = resolve_kernel(kernel, x, weight)
    log_backend("moe experts", kernel)
    if kernel == "grouped_mm":
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=groups.offsets)
    if kernel == "gather":
        return torch.bmm(weight.index_select(0, groups.ids), x.unsqueeze(-1)).squeeze(-1)
    return _loop(x, weight, groups.offsets)


def _loop(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One ``F.linear`` per non-empty group, its rows a narrow view of x (the sizes read on
    the host once)."""
    ends = offsets.tolist()
    parts, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            parts.append(F.linear(x[start:end], weight[g]))
        start = end
    if not parts:
        return x.new_zeros(x.shape[0], weight.shape[1])
    return torch.cat(parts) if len(parts) > 1 else parts[0]
