"""``model.depth``: how many loop iterations a training step runs, and through how many of
them it backpropagates.

| kind | iterations of training step n | source |
| --- | --- | --- |
| fixed | T, the layout's count | every seed paper |
| lognormal_poisson | r ~ Poisson(e^τ) + 1, τ ~ N(log T − σ²/2, σ) | Huginn (Geiping et al. 2025, arXiv 2502.05171) §3.3, Eq. (2) |

``backprop_window`` (k, either kind) runs the first r − k iterations of a training forward
under ``torch.no_grad`` and backpropagates through the last k only: Huginn's truncated
backpropagation (§3.3), which keeps training memory at k iterations' activations whatever
r is drawn. Inference runs any count (``iterations=`` at forward and generate); the
default is the layout's T, the mean r̄ a sampled model was trained around (Huginn's
``mean_recurrence``).

The count of a step is a pure function of (``train.seed``, step): the trainer asks
:meth:`DepthConfig.count` before each optimiser step and passes it as ``iterations=``
(:mod:`looplm.train.callbacks`), so a resumed run draws the same counts without saving any
generator state, and every data-parallel rank draws the same count (the ranks' forwards
stay in lockstep, as FSDP's collectives need). Huginn's reference seeds its sampler with
the step for the same reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import ClassVar, Optional

import numpy as np

from looplm.config_base import KindConfig, check


@dataclasses.dataclass(frozen=True)
class DepthConfig(KindConfig):
    """The base of every depth rule: ``fixed`` runs the layout's T every step.
    ``backprop_window``: k, the last iterations a training forward backpropagates through
    (null: all of them)."""

    kind: str = "fixed"
    backprop_window: Optional[int] = None

    FIELD = "model.depth"

    #: whether the count varies from step to step (the loop must run any count)
    sampled: ClassVar[bool] = False

    @classmethod
    def kinds(cls) -> dict[str, type[KindConfig]]:
        return DEPTH_CONFIGS

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.backprop_window is None or self.backprop_window >= 1, "model.depth.backprop_window",
              self.backprop_window, "null (backpropagate through every iteration) or an integer >= 1")

    @property
    def changes_training(self) -> bool:
        """Whether training differs from a plain fixed-depth loop (a count drawn per step, or
        a truncated backward)."""
        return self.sampled or self.backprop_window is not None

    def count(self, mean: int, seed: int, step: int) -> int:
        """Iterations of training step ``step`` of a run seeded ``seed``; ``mean``: the layout's T."""
        return mean

    def no_grad_iterations(self, iterations: int) -> int:
        """r − k: how many leading iterations of an ``iterations``-long training forward run
        without gradient (0 without a window, or when r <= k)."""
        if self.backprop_window is None:
            return 0
        return max(iterations - self.backprop_window, 0)

    def summary(self, mean: int) -> str:
        """The rule, for ``looplm info``."""
        window = "" if self.backprop_window is None else f", backprop through the last {self.backprop_window}"
        return f"{self.kind} ({self._count_summary(mean)}{window})"

    def _count_summary(self, mean: int) -> str:
        return f"T = {mean}"


@dataclasses.dataclass(frozen=True)
class FixedDepthConfig(DepthConfig):
    """T iterations every step."""

    kind: str = "fixed"


@dataclasses.dataclass(frozen=True)
class LogNormalPoissonDepthConfig(DepthConfig):
    """Huginn's heavy-tailed recurrence count (arXiv 2502.05171 §3.3, Eq. 2):

        τ ~ N(log r̄ − σ²/2, σ),   r ~ P(e^τ) + 1

    with r̄ the layout's T. E[e^τ] = r̄, so E[r] = r̄ + 1 (the paper's formula, and its
    reference sampler, add the 1 after the Poisson draw; we follow them). ``sigma``: σ,
    1/2 in the paper. The draw is seeded by (seed, step) alone (:func:`step_rng`)."""

    kind: str = "lognormal_poisson"
    sigma: float = 0.5

    sampled = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.sigma > 0, "model.depth.sigma", self.sigma, "a number > 0 (the log-normal's σ; Huginn: 0.5)")

    def count(self, mean: int, seed: int, step: int) -> int:
        rng = step_rng(seed, step)
        tau = rng.normal(math.log(mean) - self.sigma**2 / 2, self.sigma)  # Eq. (2): τ ~ N(log r̄ − σ²/2, σ)
        return int(rng.poisson(math.exp(tau))) + 1  # r ~ P(e^τ) + 1

    def _count_summary(self, mean: int) -> str:
        return f"r̄ = {mean}, σ = {self.sigma:g}"


def step_rng(seed: int, step: int) -> np.random.Generator:
    """A generator of its own for training step ``step`` of a run seeded ``seed`` (blake2b
    of both, as the data loader's epoch order): nothing to save for an exact resume."""
    digest = hashlib.blake2b(f"depth:{seed}:{step}".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "big"))


#: The depth rules: ``kind`` -> config class. One line per kind.
DEPTH_CONFIGS: dict[str, type[KindConfig]] = {
    "fixed": FixedDepthConfig,
    "lognormal_poisson": LogNormalPoissonDepthConfig,
}
