"""What a step launches: dispatched operators and host syncs, counted on any device.

At the sizes looplm runs on one GPU a decode step or a small training step costs per
launched kernel and per host synchronisation, not per FLOP (DESIGN.md invariant 6). Both
are visible on CPU: every ATen operator reaches the dispatcher, where a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` sees it. Views (``view``,
``transpose``, ``narrow``, ... : ``OpOverload.is_view``) launch nothing and are left out;
so are the metadata-only ``detach`` and ``alias``. A host sync is a call that needs a
value on the host: ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``) and the
ops whose output shape depends on the data (``nonzero``, ``masked_select``, ``unique``...),
and the whole-tensor reads ``Tensor.tolist`` / ``Tensor.numpy`` (on CPU they never reach
the dispatcher, so a :class:`~torch.overrides.TorchFunctionMode` counts them, as
``Tensor.tolist``; on a GPU each is a copy to the host and a sync).

Some calls are several operators on CPU but one kernel on CUDA: ``F.rms_norm`` with its
input and weight in one dtype (torch's fused ``_fused_rms_norm``; six CPU operators).
``kernels`` counts each such call once, the rest as ``ops`` does: what a GPU launches
for the same eager code, as far as torch's own fusions go (flash-linear-attention's fused
kernels, which replace PyTorch reference paths, are not modelled: measure them with
``benchmarks/launches.py --device cuda``).

    >>> counts = count_dispatch(lambda: model(ids))
    >>> counts.ops, counts.kernels, counts.syncs, counts.by_op.most_common(5)

Tests keep these counts from growing back; ``benchmarks/`` reports them beside wall time.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: operators that read a device value back to the host
SYNC_OPS = frozenset({
    "aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique_consecutive",
    "aten._unique2", "aten.unique_dim", "aten.repeat_interleave.Tensor", "aten.item",
})
#: metadata-only operators that are not views by schema but launch nothing (and the
#: profiler's record-function markers, ``profiler.*``)
FREE_OPS = frozenset({"aten.detach", "aten.alias", "aten.lift_fresh", "aten._unsafe_view", "aten.empty_like",
                      "aten.promote_types", "aten.result_type", "aten.is_same_size", "aten.sym_size", "aten.sym_stride",
                      "aten.empty", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided"})


@dataclasses.dataclass
class DispatchCount:
    """ops: operators that launch work (views and allocations left out); syncs: host reads
    (included in ``ops``); by_op: ops per operator name (``aten.mm``, ...); fused: the ops
    beyond the first of calls that are one kernel on CUDA (:data:`FUSED_ON_CUDA`)."""

    ops: int = 0
    syncs: int = 0
    by_op: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fused: int = 0

    @property
    def kernels(self) -> int:
        """``ops`` with each call that is one CUDA kernel counted once."""
        return self.ops - self.fused

    def __str__(self) -> str:
        top = ", ".join(f"{name} {n}" for name, n in self.by_op.most_common(8))
        return f"{self.ops} ops, {self.syncs} host syncs ({top})"


def _name(func: Any) -> str:
    packet = getattr(func, "_overloadpacket", None)
    base = str(packet) if packet is not None else str(func)
    overload = getattr(func, "_overloadname", "default")
    full = f"{base}.{overload}"
    return full if full in SYNC_OPS else base


class _Counter(TorchDispatchMode):
    def __init__(self, count: DispatchCount):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _name(func)
        if not getattr(func, "is_view", False) and name not in FREE_OPS and not name.startswith("profiler."):
            self.count.ops += 1
            self.count.by_op[name] += 1
            if name in SYNC_OPS:
                self.count.syncs += 1
        return func(*args, **(kwargs or {}))


#: tensor methods that read a whole tensor to the host without an ATen operator on CPU
HOST_READS = frozenset({"tolist", "numpy"})


def _one_rms_norm_kernel(args, kwargs) -> bool:
    """Whether ``F.rms_norm(input, shape, weight, eps)`` runs torch's fused kernel on CUDA:
    no weight, or a weight in the input's dtype."""
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    return weight is None or weight.dtype == args[0].dtype


#: torch functions that are several operators on CPU and one kernel on CUDA, with the
#: condition on their arguments
FUSED_ON_CUDA = {"rms_norm": _one_rms_norm_kernel}


class _FunctionCalls(TorchFunctionMode):
    """Host reads that bypass the dispatcher, and calls that are one kernel on CUDA (whose
    operators the dispatch mode counts inside them)."""

    def __init__(self, count: DispatchCount):
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in HOST_READS and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            self.count.ops += 1
            self.count.syncs += 1
            self.count.by_op[f"Tensor.{name}"] += 1
        if name in FUSED_ON_CUDA and FUSED_ON_CUDA[name](args, kwargs):
            before = self.count.ops
            result = func(*args, **kwargs)
            self.count.fused += max(self.count.ops - before - 1, 0)
            return result
        return func(*args, **kwargs)


def count_dispatch(fn: Callable[[], Any]) -> tuple[DispatchCount, Any]:
    """Run ``fn()`` once and count what it dispatched; returns (counts, fn's result)."""
    count = DispatchCount()
    with _FunctionCalls(count), _Counter(count):
        result = fn()
    return count, result
