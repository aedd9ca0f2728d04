"""The grown structure of one block (loop depth K_l, per-head loop weights, the storage
order of its heads) and the decoding state of its extra passes.

The structure is not a parameter: growing it leaves the parameter set unchanged. It travels
with the weights as the module's extra state (``<block>.head_loop._extra_state`` in
``model.safetensors``: a float tensor [1 + 2·H] holding K_l, the H head weights in the
original head numbering, then the head order; checkpoints written before the order was
saved hold [1 + H] and load with the original order), so a saved or exported model reloads
with its grown, static graph.

The head order is SGT's re-parameterisation (:meth:`~looplm.head_loop.block.GrownBlock.arrange_heads`):
at a growth event the block's attention heads are permuted in storage so that the looping
ones come first, and an extra pass reads their projections as narrow views of the weights.
``order[p]`` is the original index of the head stored in slot p; heads are reported (which
loop, their weights and entropies) in the original numbering.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import nn


class GrownLoop(nn.Module):
    """K_l (``depth``), the loop weight w_i ∈ [0, 1] of every head of one block (original
    numbering) and the storage order of its heads.

    Heads with w_i = 0 are not computed at all; 0 < w_i < 1 while a head fades out. For the
    extra passes the structure keeps, on the device, what they index with: buffers of fixed
    sizes (structure-independent, so every loading path fits them) whose first entries are
    rewritten in place when the structure changes, never per pass. ``pass_scale`` [n·D of
    H·D] the looping heads' weights (read when one fades: ``scaled``), ``pass_kv`` [n of H]
    the key/value head each looping query head reads among the m read (when not head j for
    query head j: ``kv_mapped``), ``pass_q_rows`` [n·D of H·D] / ``pass_kv_rows`` [m·D of
    H_kv·D] the rows of the looping query / key-value heads (when their slots are not
    consecutive: not ``narrow``)."""

    def __init__(self, n_heads: int, n_kv_heads: Optional[int] = None, head_dim: int = 1):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads or n_heads, head_dim
        self.depth = 0
        self.weights: tuple[float, ...] = (1.0,) * n_heads
        self.order: tuple[int, ...] = tuple(range(n_heads))
        H, D = n_heads, head_dim
        for name, size, dtype in (("pass_scale", H * D, torch.float32),
                                  ("pass_kv", H, torch.long), ("pass_q_rows", H * D, torch.long),
                                  ("pass_kv_rows", self.n_kv_heads * D, torch.long)):
            self.register_buffer(name, torch.zeros(size, dtype=dtype), persistent=False)
        self._refresh()

    def set(self, depth: int, weights: Optional[Sequence[float]] = None) -> None:
        """K_l and the head weights (original numbering; None: every head at 1)."""
        weights = (1.0,) * self.n_heads if weights is None else tuple(float(w) for w in weights)
        if len(weights) != self.n_heads or depth < 0:
            raise ValueError(f"depth {depth} and {len(weights)} head weights for a block of {self.n_heads} heads")
        if depth > 0 and not any(w > 0 for w in weights):
            raise ValueError(f"depth {depth} with head weights {list(weights)}: some head must loop (w > 0)")
        self.depth, self.weights = int(depth), weights
        self._refresh()

    def set_order(self, order: Sequence[int]) -> None:
        """Record that slot p now stores original head ``order[p]`` (the parameters were
        permuted alike, :meth:`GrownBlock.arrange_heads`). Grouped-query attention keeps
        each kv head's group of query heads together: slots p·g .. p·g + g − 1 (g = H / H_kv)
        hold one original group."""
        order = tuple(int(h) for h in order)
        g = self.n_heads // self.n_kv_heads
        if sorted(order) != list(range(self.n_heads)) or any(
                order[p] // g != order[p - p % g] // g for p in range(self.n_heads)):
            raise ValueError(f"head order {list(order)}: a permutation of 0..{self.n_heads - 1} keeping each of the "
                             f"{self.n_kv_heads} key/value groups of {g} query heads in consecutive slots")
        self.order = order
        self._refresh()

    @property
    def slot_of(self) -> tuple[int, ...]:
        """The slot of each original head: ``order`` inverted."""
        return tuple(sorted(range(self.n_heads), key=self.order.__getitem__))

    @property
    def heads(self) -> tuple[int, ...]:
        """S: the heads the extra passes compute (w_i > 0), ascending, original numbering."""
        return tuple(i for i, w in enumerate(self.weights) if w > 0)

    @property
    def slots(self) -> tuple[int, ...]:
        """The storage slots of S, ascending: the order the extra passes compute them in."""
        return tuple(p for p, h in enumerate(self.order) if self.weights[h] > 0)

    @property
    def kv_slots(self) -> tuple[int, ...]:
        """The storage slots of the key/value heads S reads, ascending."""
        g = self.n_heads // self.n_kv_heads
        return tuple(sorted({p // g for p in self.slots}))

    @property
    def narrow(self) -> bool:
        """Whether S and the kv heads it reads lie in consecutive slots (views, no gathers)."""
        slots, kv = self.slots, self.kv_slots
        return bool(slots) and slots[-1] - slots[0] == len(slots) - 1 and kv[-1] - kv[0] == len(kv) - 1

    @property
    def head_weights(self) -> Optional[tuple[float, ...]]:
        """Weights of ``slots`` in order, or None when all are 1 (no scaling needed)."""
        kept = tuple(self.weights[self.order[p]] for p in self.slots)
        return None if all(w == 1.0 for w in kept) else kept

    @property
    def scaled(self) -> bool:
        """Whether a looping head fades (its output is scaled by ``pass_scale``)."""
        return self.head_weights is not None

    @property
    def kv_mapped(self) -> bool:
        """Whether looping query head j reads another kv head than the j-th one read (GQA)."""
        return self._kv_index() != list(range(len(self.slots)))

    def _kv_index(self) -> list[int]:
        g, kv_slots = self.n_heads // self.n_kv_heads, self.kv_slots
        return [kv_slots.index(p // g) for p in self.slots]

    @torch.no_grad()
    def _refresh(self) -> None:
        """Write the extra passes' device indices that changed, in place (the trainer sets
        the structure after every step: unchanged, nothing is copied; while heads fade only
        ``pass_scale`` is, without waiting for the device)."""
        D = self.head_dim
        written = self.__dict__.setdefault("_written", {})  # buffer name -> values last written

        def put(name: str, values: list) -> None:
            buffer = getattr(self, name)
            key = (tuple(values), buffer.device, buffer.data_ptr())
            if written.get(name) == key:
                return
            host = torch.tensor(values, dtype=buffer.dtype, device="cpu")  # also under a meta device context
            buffer[: len(values)].copy_(host.pin_memory() if buffer.is_cuda else host, non_blocking=True)
            written[name] = key

        def rows(heads: Sequence[int]) -> list[int]:
            return [p * D + i for p in heads for i in range(D)]

        put("pass_scale", [w for w in self.head_weights or [1.0] * len(self.slots) for _ in range(D)])
        put("pass_kv", self._kv_index())
        put("pass_q_rows", rows(self.slots))
        put("pass_kv_rows", rows(self.kv_slots))

    def describe(self) -> dict:
        return {"depth": self.depth, "heads": list(self.heads), "weights": list(self.weights)}

    def extra_repr(self) -> str:
        return f"depth={self.depth}, heads={list(self.heads)}"

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([float(self.depth), *self.weights, *map(float, self.order)], dtype=torch.float32)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.__dict__.pop("_written", None)  # loaded buffers: write all of them again
        values = state.detach().float().cpu().tolist()
        H = self.n_heads
        self.set(int(round(values[0])), values[1: 1 + H])
        self.set_order([int(round(v)) for v in values[1 + H:]] if len(values) == 1 + 2 * H else range(H))


@dataclasses.dataclass
class LoopedState:
    """Decoding state of a block with extra passes: the attention's own state and one per
    extra pass k = 1..K (their keys are those of the pass's own input H^(k-1), so each
    pass needs its own cache slot; for a re-applied block, the block's mixer state)."""

    main: object
    passes: tuple

    def crop(self, length: int) -> "LoopedState":
        return LoopedState(self.main.crop(length), tuple(s.crop(length) for s in self.passes))

    def select(self, index: torch.Tensor) -> "LoopedState":
        return LoopedState(self.main.select(index), tuple(s.select(index) for s in self.passes))

    def static(self, capacity: int) -> "LoopedState":
        """The same states, each in its static form (:meth:`looplm.cache.LoopCache.static`)."""
        for part in (self.main, *self.passes):
            if not hasattr(part, "static"):
                raise TypeError(f"a {type(part).__name__} inside a head-looped block has no static form")
        return LoopedState(self.main.static(capacity), tuple(s.static(capacity) for s in self.passes))

    @property
    def rewind(self) -> Optional[int]:
        """How many positions a static cache holding it may be cropped by (the least of its
        parts'; None: any)."""
        limits = [getattr(part, "rewind", 0) for part in (self.main, *self.passes)]
        return 0 if 0 in limits else min((r for r in limits if r is not None), default=None)
