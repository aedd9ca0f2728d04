"""The grown structure of one block (loop depth K_l, per-head loop weights) and the
decoding state of its extra passes.

The structure is not a parameter: growing it leaves the parameter set (and so the
optimiser state) unchanged. It travels with the weights as the module's extra state
(``<block>.head_loop._extra_state`` in ``model.safetensors``: a float tensor [1 + H] holding
K_l then the H head weights), so a saved or exported model reloads with its grown,
static graph.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import nn


class GrownLoop(nn.Module):
    """K_l (``depth``) and the loop weight w_i ∈ [0, 1] of every head of one block.

    Heads with w_i = 0 are not computed at all; 0 < w_i < 1 while a head fades out."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.depth = 0
        self.weights: tuple[float, ...] = (1.0,) * n_heads

    def set(self, depth: int, weights: Optional[Sequence[float]] = None) -> None:
        weights = (1.0,) * self.n_heads if weights is None else tuple(float(w) for w in weights)
        if len(weights) != self.n_heads or depth < 0:
            raise ValueError(f"depth {depth} and {len(weights)} head weights for a block of {self.n_heads} heads")
        self.depth, self.weights = int(depth), weights

    @property
    def heads(self) -> tuple[int, ...]:
        """S: the heads the extra passes compute (w_i > 0), ascending."""
        return tuple(i for i, w in enumerate(self.weights) if w > 0)

    @property
    def head_weights(self) -> Optional[tuple[float, ...]]:
        """Weights of ``heads`` in order, or None when all are 1 (no scaling needed)."""
        kept = tuple(self.weights[i] for i in self.heads)
        return None if all(w == 1.0 for w in kept) else kept

    def describe(self) -> dict:
        return {"depth": self.depth, "heads": list(self.heads), "weights": list(self.weights)}

    def extra_repr(self) -> str:
        return f"depth={self.depth}, heads={list(self.heads)}"

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([float(self.depth), *self.weights], dtype=torch.float32)

    def set_extra_state(self, state: torch.Tensor) -> None:
        values = state.detach().float().cpu().tolist()
        self.set(int(round(values[0])), values[1:])


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
