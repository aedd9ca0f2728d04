"""State-passing topologies: how a core iteration's output enters the loop state.

One value of the ``model.topology.kind`` field each, with its config class in
``looplm.topology.config`` (the registry :data:`~looplm.topology.config.TOPOLOGY_CONFIGS`).

| kind | update | source |
| --- | --- | --- |
| base | h ← f(h) | MeSH Eq. (1), Alg. 1 |
| residual | h ← f(h) + h | MeSH Eq. (1) |
| anchor | h ← f(h) + h⁽⁰⁾ | MeSH Eq. (1) |
| anchor_embedding | h ← f(h) + h_emb | MeSH Eq. (1) (anchor*) |
| additive | h ← f(h) + Σ supplements | MeSH Appendix E.3 (fixed) |
| gated_residual | h ← f(h) + ρ_τ ⊙ h | LT2 §2.1 |
| static_combination | h ← α·(f(h), h⁽⁰⁾, h_emb, h) | MeSH Appendix E.3 (learnable) |
| dynamic_combination | α = Linear_t(h) per token | MeSH Appendix E.3 (learnable) |
| mesh | buffer + routers | MeSH §3.2, Alg. 2 |
| concat_adapter | s ← f(A([s, e])), s_0 random | Huginn (arXiv 2502.05171) §3.1, Eq. (1) |
"""

from __future__ import annotations

from looplm.topology.additive import AdditiveTopology
from looplm.topology.base import LoopState, Topology
from looplm.topology.concat_adapter import ConcatAdapterTopology
from looplm.topology.combination import DynamicCombinationTopology, StaticCombinationTopology
from looplm.topology.config import TOPOLOGY_CONFIGS, TopologyConfig
from looplm.topology.gated import GatedResidualTopology
from looplm.topology.mesh import MeshTopology


def build_topology(cfg: TopologyConfig, d_model: int, iterations: int) -> Topology:
    """The topology of a loop of ``iterations`` iterations at width ``d_model``."""
    return cfg.build(d_model, iterations)


__all__ = [
    "AdditiveTopology",
    "ConcatAdapterTopology",
    "DynamicCombinationTopology",
    "GatedResidualTopology",
    "LoopState",
    "MeshTopology",
    "StaticCombinationTopology",
    "TOPOLOGY_CONFIGS",
    "Topology",
    "TopologyConfig",
    "build_topology",
]
