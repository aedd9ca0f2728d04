"""What every probe gets (:class:`ProbeInput`) and returns (:class:`ProbeReport`), and the
registry that names them."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from looplm.config import RunConfig
from looplm.errors import LoopLMError
from looplm.model import LoopLM
from looplm.probes.capture import Capture, capture_forward


class ProbeError(LoopLMError, ValueError):
    """A probe that cannot run on this model or data (e.g. a loop probe on a dense model)."""


@dataclasses.dataclass
class ProbeInput:
    """model: in eval mode. config: the run's config. run_path: the directory given by the
    user (a run directory holds ``checkpoints/`` and ``metrics.jsonl``). batches: the
    held-out (inputs, targets) batches, [B, T] each, ``samples`` sequences in all.
    tokenizer: the run's tokenizer, for labelling tokens in figures (None: token ids).
    verify: whether further checkpoints a probe reads are verified against their manifest."""

    model: LoopLM
    config: RunConfig
    run_path: Path
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    tokenizer: Optional[Any] = None
    verify: bool = True

    @property
    def samples(self) -> int:
        return sum(inputs.shape[0] for inputs, _ in self.batches)

    def forward(self, **wanted: bool) -> Iterator[Capture]:
        """One :func:`capture_forward` per batch (``states``, ``attentions``, ``blocks``,
        ``values`` select what is collected)."""
        for inputs, targets in self.batches:
            yield capture_forward(self.model, inputs, targets, **wanted)

    def require_loop(self, probe: str) -> None:
        if self.model.topology is None:
            raise ProbeError(f"probe {probe!r} needs a looped model; layout {self.model.cfg.layout!r} has no loop")


Figure = Callable[[Any], Any]  # pyplot module -> matplotlib Figure


@dataclasses.dataclass
class ProbeReport:
    """numbers: JSON-ready results. figures: name -> function drawing it with pyplot."""

    numbers: dict[str, Any]
    figures: dict[str, Figure] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Probe:
    name: str
    source: str  # paper, section and figure it reproduces
    run: Callable[[ProbeInput], ProbeReport]


PROBES: dict[str, Probe] = {}


def register(name: str, source: str) -> Callable[[Callable[[ProbeInput], ProbeReport]], Callable]:
    def wrap(fn: Callable[[ProbeInput], ProbeReport]) -> Callable[[ProbeInput], ProbeReport]:
        if name in PROBES:
            raise ValueError(f"probe {name!r} registered twice")
        PROBES[name] = Probe(name, source, fn)
        return fn

    return wrap


def get_probe(name: str) -> Probe:
    if name not in PROBES:
        raise ProbeError(f"unknown probe {name!r}; available: {', '.join(sorted(PROBES))}, all")
    return PROBES[name]


def tolist(x: Any, digits: Optional[int] = 6) -> Any:
    """Tensors and nested containers as JSON-ready lists of floats rounded to ``digits``
    significant digits (non-finite -> None)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().double().cpu().tolist()
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        return float(f"{x:.{digits}g}") if digits is not None else x
    if isinstance(x, dict):
        return {str(k): tolist(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [tolist(v, digits) for v in x]
    return x
