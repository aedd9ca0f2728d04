"""Zero-shot adaptive exit on a trained loop: the compute it saves and the loss it costs
against the full loop (``looplm eval --exit kl:5e-4``).

The exit is the ``convergence`` halting rule (:mod:`looplm.halting.convergence`, Huginn's
criterion, Geiping et al. 2025 §6): it has no parameters, so it replaces the halting rule
of a model trained without one (``model.halting.kind: none``) at load time."""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch

from looplm.config_base import ConfigError
from looplm.halting.config import ConvergenceExitConfig
from looplm.model import LoopLM, ModelOutput
from looplm.targets import IGNORE_INDEX


@dataclasses.dataclass(frozen=True)
class ExitSpec:
    """A zero-shot exit: ``criterion`` (``kl`` or ``entropy``) below ``threshold``."""

    criterion: str
    threshold: float

    @classmethod
    def parse(cls, text: str) -> "ExitSpec":
        """``CRITERION:THRESHOLD`` (``kl:5e-4``, ``entropy:0.5``), checked by the rule's config."""
        criterion, sep, threshold = text.partition(":")
        try:
            value = float(threshold)
        except ValueError:
            value = None
        if not sep or value is None:
            raise ConfigError("exit", text, "CRITERION:THRESHOLD, e.g. kl:5e-4 or entropy:0.5")
        spec = cls(criterion, value)
        spec.config()  # validated here, with the rule's own messages
        return spec

    @property
    def label(self) -> str:
        return f"{self.criterion}:{self.threshold:g}"

    def config(self) -> ConvergenceExitConfig:
        return ConvergenceExitConfig(criterion=self.criterion, threshold=self.threshold)


def with_zero_shot_exit(model: LoopLM, exit: ExitSpec) -> LoopLM:
    """``model`` with the zero-shot exit as its halting rule, sharing every parameter with it
    (a shallow copy whose module table is its own; ``model`` is left unchanged). Refused for
    a model without a loop, and for one whose halting rule has parameters (the exit would
    drop them); the combination is checked like any config (MeSH's buffer, multi-resolution
    loops and head loops cannot freeze a position)."""
    cfg = model.cfg
    if model.halting is None:
        raise ConfigError("exit", exit.label, f"no exit: layout {cfg.layout!r} has no loop")
    if cfg.halting.parameter_count(cfg.d_model):
        raise ConfigError("exit", exit.label, f"a model trained without a learned halting rule: {cfg.halting.label} "
                          "has parameters the zero-shot exit would drop (it replaces the halting rule)")
    exit_cfg = dataclasses.replace(cfg, halting=exit.config())  # ModelConfig checks the combination
    exiting = copy.copy(model)
    exiting._modules = dict(model._modules)  # its own module table: the original keeps its halting rule
    exiting.cfg = exit_cfg
    exiting.halting = exit_cfg.halting.build(cfg.d_model)
    return exiting


def realised_passes(output: ModelOutput, targets: torch.Tensor) -> tuple[float, int]:
    """(Σ block passes, count) over the positions with a target: the realised compute of a
    forward (``output.block_passes``, per position)."""
    mask = targets != IGNORE_INDEX
    return float((output.block_passes * mask).sum()), int(mask.sum())


@dataclasses.dataclass
class ExitTally:
    """Running sums of one exit (or the full loop) over evaluation batches."""

    loss: float = 0.0
    passes: float = 0.0
    tokens: int = 0

    def add(self, output: ModelOutput, targets: torch.Tensor) -> None:
        passes, n = realised_passes(output, targets)
        self.loss += float(output.lm_loss) * n
        self.passes += passes
        self.tokens += n

    @property
    def mean_loss(self) -> float:
        return self.loss / max(self.tokens, 1)

    @property
    def passes_per_token(self) -> float:
        return self.passes / max(self.tokens, 1)


def exit_report(full: ExitTally, exits: dict[str, ExitTally]) -> list[dict[str, Optional[float]]]:
    """One row per exit: its loss, the loss paid against the full loop, its block passes per
    token and the share of the full loop's passes it saved."""
    rows = []
    for label, tally in exits.items():
        rows.append({"exit": label, "val_loss": tally.mean_loss, "loss_paid": tally.mean_loss - full.mean_loss,
                     "block_passes_per_token": tally.passes_per_token,
                     "compute_saved": 1.0 - tally.passes_per_token / full.passes_per_token})
    return rows
