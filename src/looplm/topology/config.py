"""``model.topology``: one config class per topology kind, chosen by the ``kind`` key.

``TopologyConfig.from_dict({"kind": "mesh", "buffer_slots": 6})`` returns the
``MeshTopologyConfig`` that :data:`TOPOLOGY_CONFIGS` names for that kind, so each kind
checks its own fields and a field of another kind is refused. ``build(d_model,
iterations)`` makes the :class:`~looplm.topology.base.Topology`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Optional

from looplm.config_base import KindConfig, check
from looplm.ops.backend import KERNELS
from looplm.topology.additive import AdditiveTopology
from looplm.topology.base import Topology
from looplm.topology.concat_adapter import ConcatAdapterTopology
from looplm.topology.combination import DynamicCombinationTopology, StaticCombinationTopology
from looplm.topology.gated import GatedResidualTopology
from looplm.topology.mesh import MeshTopology

#: Supplements h_sup of MeSH Eq. (1) that an ``additive`` topology can sum (Appendix E.3).
SUPPLEMENTS = ("residual", "anchor", "anchor_embedding")


@dataclasses.dataclass(frozen=True)
class TopologyConfig(KindConfig):
    """How an iteration's core output enters the loop state (the base of every kind)."""

    kind: str = "base"

    FIELD = "model.topology"
    FLAT_DEFAULTS = {"supplements": (), "buffer_slots": None}

    #: whether U does more than hand on the core's output (every kind but ``base``,
    #: h ← f(h)): a dense stack has no loop to update, and two streams define their own.
    defines_update: ClassVar[bool] = True
    #: whether one position can stop iterating while others go on: not when positions
    #: write per-step state that later steps read (MeSH's buffer).
    can_freeze_positions: ClassVar[bool] = True
    #: whether the topology has no per-iteration parameters, so the loop runs any count
    #: (test-time depth, a count drawn per training step: model.depth)
    iteration_free: ClassVar[bool] = True
    #: whether U adds the update to a carried state (h, h⁽⁰⁾ or h_emb) from initialisation on,
    #: so each token keeps its own information through a sub-token iteration, whose update
    #: S↑'s causal shift moved past the positions that produced it (SpiralFormer Eq. 22)
    adds_update: ClassVar[bool] = True
    #: whether the core reads the loop input besides the state at every iteration (Huginn's
    #: adapter on [s, e]): a sub-token iteration may then replace the state, as long as a
    #: full-resolution iteration follows it
    injects_input: ClassVar[bool] = False
    #: the loop inputs U reads again at every iteration, as the tensors the loop started from:
    #: "h0" (the prelude's output h⁽⁰⁾), "h_emb" (the embeddings). A truncated backward
    #: (model.depth.backprop_window) reaches the prelude and the embeddings only through
    #: them: the state enters the window detached by the iterations run without gradient.
    rereads: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def kinds(cls) -> dict[str, type[KindConfig]]:
        return TOPOLOGY_CONFIGS

    def build(self, d_model: int, iterations: int) -> Topology:
        raise NotImplementedError(f"{type(self).__name__} builds no topology")

    def summary(self, iterations: int) -> str:
        """The kind, with what sets it apart, for ``looplm info``."""
        return self.kind

    def parameter_count(self, d_model: int, iterations: int) -> int:
        """Parameters the topology adds, from the config alone (the analytic counter)."""
        return 0


@dataclasses.dataclass(frozen=True)
class FixedSupplementConfig(TopologyConfig):
    """h ← f(h) + h_sup with one fixed supplement, or none (MeSH Eq. 1)."""

    supplement: ClassVar[tuple[str, ...]] = ()

    def build(self, d_model: int, iterations: int) -> Topology:
        return AdditiveTopology(self.supplement)


@dataclasses.dataclass(frozen=True)
class BaseTopologyConfig(FixedSupplementConfig):
    """h ← f(h) (MeSH Eq. 1, Alg. 1)."""

    kind: str = "base"
    defines_update = False
    adds_update = False


@dataclasses.dataclass(frozen=True)
class ResidualTopologyConfig(FixedSupplementConfig):
    """h ← f(h) + h (MeSH Eq. 1)."""

    kind: str = "residual"
    supplement = ("residual",)


@dataclasses.dataclass(frozen=True)
class AnchorTopologyConfig(FixedSupplementConfig):
    """h ← f(h) + h⁽⁰⁾, the loop's input (MeSH Eq. 1)."""

    kind: str = "anchor"
    supplement = ("anchor",)
    rereads = ("h0",)


@dataclasses.dataclass(frozen=True)
class AnchorEmbeddingTopologyConfig(FixedSupplementConfig):
    """h ← f(h) + h_emb, the embeddings (MeSH Eq. 1, anchor*)."""

    kind: str = "anchor_embedding"
    supplement = ("anchor_embedding",)
    rereads = ("h_emb",)


@dataclasses.dataclass(frozen=True)
class AdditiveTopologyConfig(TopologyConfig):
    """h ← f(h) + Σ supplements, e.g. ``[anchor, anchor_embedding]`` (MeSH Appendix E.3's
    fixed combinations)."""

    kind: str = "additive"
    supplements: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            len(self.supplements) > 0 and all(s in SUPPLEMENTS for s in self.supplements)
            and len(set(self.supplements)) == len(self.supplements),
            "model.topology.supplements",
            list(self.supplements),
            f"a non-empty list of distinct entries from {', '.join(SUPPLEMENTS)} (needed by kind=additive)",
        )

    @property
    def rereads(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple({"anchor": "h0", "anchor_embedding": "h_emb"}[s] for s in self.supplements if s != "residual")

    def build(self, d_model: int, iterations: int) -> Topology:
        return AdditiveTopology(self.supplements)

    def summary(self, iterations: int) -> str:
        return f"{self.kind} ({' + '.join(self.supplements)})"


@dataclasses.dataclass(frozen=True)
class GatedResidualTopologyConfig(TopologyConfig):
    """h ← f(h) + ρ_τ ⊙ h with a learned gate per loop (LT2 §2.1)."""

    kind: str = "gated_residual"
    iteration_free = False
    adds_update = False  # ρ_τ starts at zero: h ← f(h), as base, until training moves it

    def build(self, d_model: int, iterations: int) -> Topology:
        return GatedResidualTopology(d_model, iterations)

    def parameter_count(self, d_model: int, iterations: int) -> int:
        return iterations * d_model  # ρ_τ ∈ ℝᵈ per loop


@dataclasses.dataclass(frozen=True)
class StaticCombinationTopologyConfig(TopologyConfig):
    """h ← α_t·(f(h), h⁽⁰⁾, h_emb, h), learned α_t per iteration (MeSH Appendix E.3)."""

    kind: str = "static_combination"
    iteration_free = False
    rereads = ("h0", "h_emb")

    def build(self, d_model: int, iterations: int) -> Topology:
        return StaticCombinationTopology(iterations)

    def parameter_count(self, d_model: int, iterations: int) -> int:
        return 4 * iterations  # α_t: four scalars per iteration


@dataclasses.dataclass(frozen=True)
class DynamicCombinationTopologyConfig(TopologyConfig):
    """α_t = Linear_t(h) per token (MeSH Appendix E.3)."""

    kind: str = "dynamic_combination"
    iteration_free = False
    rereads = ("h0", "h_emb")

    def build(self, d_model: int, iterations: int) -> Topology:
        return DynamicCombinationTopology(d_model, iterations)

    def parameter_count(self, d_model: int, iterations: int) -> int:
        return iterations * (4 * d_model + 4)  # Linear_t: d -> 4 with bias per iteration


@dataclasses.dataclass(frozen=True)
class MeshTopologyConfig(TopologyConfig):
    """MeSH's memory buffer with per-iteration read/write routers (MeSH §3.2, Alg. 2);
    ``buffer_slots`` is B, null for T + 3 (Appendix E.2). ``kernel``: where a write-read runs
    (:data:`looplm.ops.backend.KERNELS`): "auto" as one Triton kernel on CUDA and PyTorch
    operators elsewhere, "torch" PyTorch everywhere, "triton" the kernel everywhere (CPU only
    under ``TRITON_INTERPRET=1``); the same numbers to float rounding."""

    kind: str = "mesh"
    buffer_slots: Optional[int] = None
    kernel: str = "auto"
    can_freeze_positions = False
    iteration_free = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            self.buffer_slots is None or self.buffer_slots >= 2,
            "model.topology.buffer_slots",
            self.buffer_slots,
            "an integer >= 2 (slot 0 holds the embeddings), or null for T + 3",
        )
        check(self.kernel in KERNELS, "model.topology.kernel", self.kernel, "one of " + ", ".join(KERNELS))

    def slots(self, iterations: int) -> int:
        """B: ``buffer_slots``, or T + 3 (MeSH Appendix E.2)."""
        return self.buffer_slots or iterations + 3

    def build(self, d_model: int, iterations: int) -> Topology:
        return MeshTopology(d_model, iterations, self.slots(iterations), self.kernel)

    def summary(self, iterations: int) -> str:
        return f"{self.kind} (B={self.slots(iterations)})"

    def parameter_count(self, d_model: int, iterations: int) -> int:
        B = self.slots(iterations)
        return (iterations + 1) * 2 * (d_model * B + B)  # write and read routers, t = -1 .. T-1 (App. E.4)


@dataclasses.dataclass(frozen=True)
class ConcatAdapterTopologyConfig(TopologyConfig):
    """Huginn's latent state s with input injection: the core reads A([s, e]), A a linear
    2d -> d, and its output is the next s; s_0 random of std ``state_std`` (arXiv
    2502.05171 §3.1, Eq. 1; :mod:`looplm.topology.concat_adapter`)."""

    kind: str = "concat_adapter"
    state_std: float = math.sqrt(2 / 5)  # the reference's √(2/(5d)) truncated normal, times the embedding scale √d
    adds_update = False  # s_i = R(e, s_{i−1}): the update replaces the state
    injects_input = True
    rereads = ("h0",)  # e, the prelude's output

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.state_std > 0, "model.topology.state_std", self.state_std,
              "a number > 0 (the std of the random initial state s_0; Huginn: √(2/5) ≈ 0.632)")

    def build(self, d_model: int, iterations: int) -> Topology:
        return ConcatAdapterTopology(d_model, self.state_std)

    def summary(self, iterations: int) -> str:
        return f"{self.kind} (s_0 std {self.state_std:.3g})"

    def parameter_count(self, d_model: int, iterations: int) -> int:
        return 2 * d_model * d_model  # A: 2d -> d, no bias


#: The topology kinds: ``kind`` -> config class. One line per kind.
TOPOLOGY_CONFIGS: dict[str, type[KindConfig]] = {
    "base": BaseTopologyConfig,
    "residual": ResidualTopologyConfig,
    "anchor": AnchorTopologyConfig,
    "anchor_embedding": AnchorEmbeddingTopologyConfig,
    "additive": AdditiveTopologyConfig,
    "gated_residual": GatedResidualTopologyConfig,
    "static_combination": StaticCombinationTopologyConfig,
    "dynamic_combination": DynamicCombinationTopologyConfig,
    "mesh": MeshTopologyConfig,
    "concat_adapter": ConcatAdapterTopologyConfig,
}

#: The topology kinds, in the registry's order.
TOPOLOGIES = tuple(TOPOLOGY_CONFIGS)
