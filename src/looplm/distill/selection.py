"""Choosing the kept-attention set F (lt2.txt §5, Stage 2: "the |F| softmax layers
selected by the KL-guided selector").

``kl``: start from the stage-1 student (every block linear) and, for each candidate block
ℓ, restore the teacher's softmax attention in ℓ alone; its score is how much that lowers
the teacher–student KL on held-out batches,

    score(ℓ) = KL(p_T ‖ p_S) − KL(p_T ‖ p_{S+ℓ}),    KL over the full vocabulary at the
    final loop, averaged over the held-out positions,

and F is the |F| highest-scoring blocks (one-shot scoring, not greedy). ``uniform``: LT2's
interleaving baseline, |F| blocks evenly spread (every 4th for 25 %, as
``model.hybrid.placement=interleave``). Every score is returned for the log."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterator, Optional, Sequence

import torch

from looplm.distill.losses import topk_kl
from looplm.distill.student import block_paths
from looplm.model import LoopLM


@dataclasses.dataclass
class Selection:
    """The chosen blocks F (sorted), how they were chosen, and per candidate block its
    score and the KL with it restored (``kl`` selector); ``base_kl``: the all-linear student's."""

    selector: str
    layers: list[int]
    scores: dict[int, float] = dataclasses.field(default_factory=dict)
    kl: dict[int, float] = dataclasses.field(default_factory=dict)
    base_kl: Optional[float] = None

    def to_dict(self) -> dict:
        return {"selector": self.selector, "layers": self.layers, "base_kl": self.base_kl,
                "scores": {str(k): v for k, v in self.scores.items()}, "kl": {str(k): v for k, v in self.kl.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "Selection":
        return cls(data["selector"], list(data["layers"]), {int(k): v for k, v in data.get("scores", {}).items()},
                   {int(k): v for k, v in data.get("kl", {}).items()}, data.get("base_kl"))


def uniform_layers(n_blocks: int, count: int) -> list[int]:
    """``count`` of ``n_blocks`` evenly spread, the last block included: every
    (n/count)-th (``looplm.mixers.pattern``'s interleave)."""
    if count == 0:
        return []
    return sorted({math.ceil((m + 1) * n_blocks / count) - 1 for m in range(count)})


@torch.no_grad()
def mean_kl(teacher: LoopLM, student: LoopLM, batches: Sequence[torch.Tensor]) -> float:
    """KL(p_teacher ‖ p_student) of the final logits over the whole vocabulary (T = 1),
    averaged over ``batches`` (each [B, L] input ids)."""
    total = 0.0
    for ids in batches:
        vocab = teacher.cfg.vocab_size
        total += topk_kl(teacher(ids).logits, student(ids).logits, vocab, 1.0).item()
    return total / len(batches)


@contextlib.contextmanager
def attention_restored(student: LoopLM, teacher: LoopLM, index: int) -> Iterator[LoopLM]:
    """``student`` with block ``index`` running the teacher's own attention module (shared,
    not copied) for the duration: the hybrid with F = {index} whose other weights are the
    student's, without building a model per candidate."""
    saved = []
    for path in block_paths(student.cfg)[index]:
        block, source = student.get_submodule(path), teacher.get_submodule(path)
        saved.append((block, block.attn, block.per_iteration))
        block.attn, block.per_iteration = source.attn, source.per_iteration
    try:
        yield student
    finally:
        for block, attn, views in saved:
            block.attn, block.per_iteration = attn, views


@torch.no_grad()
def kl_guided(teacher: LoopLM, aligned: LoopLM, count: int, batches: Sequence[torch.Tensor]) -> Selection:
    """Score every block by the KL drop of restoring its attention in the all-linear
    ``aligned`` student (stage 1's), keep the ``count`` best (ties: the lower index)."""
    was_training = aligned.training
    aligned.eval()
    base = mean_kl(teacher, aligned, batches)
    scores, kls = {}, {}
    for index in range(len(block_paths(teacher.cfg))):
        with attention_restored(aligned, teacher, index) as candidate:
            kls[index] = mean_kl(teacher, candidate, batches)
        scores[index] = base - kls[index]
    aligned.train(was_training)
    ranked = sorted(scores, key=lambda i: (-scores[i], i))
    return Selection("kl", sorted(ranked[:count]), scores, kls, base)
