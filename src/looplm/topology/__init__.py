"""State-passing topologies: how a core iteration's output enters the loop state.

One value of the ``model.topology.kind`` field each; :func:`build_topology` is the registry.

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from looplm.topology.additive import AdditiveTopology
from looplm.topology.base import LoopState, Topology
from looplm.topology.combination import DynamicCombinationTopology, StaticCombinationTopology
from looplm.topology.gated import GatedResidualTopology
from looplm.topology.mesh import MeshTopology

if TYPE_CHECKING:
    from looplm.model_config import ModelConfig

_SINGLE = {"base": (), "residual": ("residual",), "anchor": ("anchor",), "anchor_embedding": ("anchor_embedding",)}


def build_topology(cfg: "ModelConfig") -> Topology:
    kind, d, T = cfg.topology.kind, cfg.d_model, cfg.iterations
    if kind in _SINGLE:
        return AdditiveTopology(_SINGLE[kind])
    if kind == "additive":
        return AdditiveTopology(cfg.topology.supplements)
    if kind == "gated_residual":
        return GatedResidualTopology(d, T)
    if kind == "static_combination":
        return StaticCombinationTopology(T)
    if kind == "dynamic_combination":
        return DynamicCombinationTopology(d, T)
    return MeshTopology(d, T, cfg.buffer_slots)


__all__ = [
    "AdditiveTopology",
    "DynamicCombinationTopology",
    "GatedResidualTopology",
    "LoopState",
    "MeshTopology",
    "StaticCombinationTopology",
    "Topology",
    "build_topology",
]
