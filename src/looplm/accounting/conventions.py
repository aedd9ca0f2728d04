"""FLOP-counting conventions: what one FLOP is and which operations count.

The papers count differently (docs/accounting.md): MeSH uses fvcore (1 FLOP per
multiply-accumulate, SDPA not counted, LayerNorm 5 FLOPs per element), SpiralFormer and
LT2 count 2 FLOPs per MAC with full (non-causal) score/value products, SGT counts
training compute as 3 × forward. A :class:`Convention` names those choices; the
counter keeps every term separately and a convention only weighs them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from looplm.config_base import ConfigError

ATTENTION = ("full", "causal", "none")
MESH_READS = ("buffer", "unrolled")


@dataclasses.dataclass(frozen=True)
class Convention:
    """flops_per_mac: 1 (fvcore) or 2. attention: score/value products counted over all
    T × S pairs (``full``, what ``torch.utils.flop_counter`` counts for SDPA), over the
    causal pairs only (``causal``), or not at all (``none``, fvcore: SDPA has no handle).
    head: whether the LM head counts. norms: norm FLOPs (LayerNorm 5, RMSNorm 4 per
    element, fvcore's affine rule). bias: bias additions (and other learned vectors added
    to every position: a learned position row, the step embedding e_t). residual: the
    block's residual additions. state: the elementwise combination of loop states (the
    topology's supplement additions, gates, the MeSH buffer write/read; the two streams'
    input sums; ACT's readout accumulation). training_multiplier: training FLOPs = this ×
    forward (backward ≈ 2 × forward). linear_form: the linear mixers' core counted as the
    chunkwise algorithm that runs in training (``chunk``) or as the token recurrence
    (``recurrent``). read_flops_per_mac: FLOPs per MAC of the MeSH buffer read (a
    contraction over slots; 0: flops_per_mac; MeSH's Eq. 8 counts its multiply and add, 2).
    mesh_read: that read counted as the paper's buffer read (``buffer``, Eq. 8) or as the
    unrolled read of Eq. (7) that looplm runs (``unrolled``: what a FLOP counter measures).
    embedding: the embedding lookup counted as a one-hot matmul (V·d MACs per token) whose
    training cost is its forward plus the weight gradient, 2 × forward, not
    ``training_multiplier`` × (no input gradient; what SGT's Table 1-2 totals imply)."""

    name: str
    flops_per_mac: int = 2
    attention: Literal["full", "causal", "none"] = "causal"
    head: bool = True
    norms: bool = False
    bias: bool = False
    residual: bool = False
    state: bool = True
    training_multiplier: float = 3.0
    linear_form: Literal["chunk", "recurrent"] = "chunk"
    read_flops_per_mac: int = 0
    mesh_read: Literal["buffer", "unrolled"] = "buffer"
    embedding: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if self.flops_per_mac not in (1, 2):
            raise ConfigError("convention.flops_per_mac", self.flops_per_mac, "1 (fvcore) or 2")
        if self.attention not in ATTENTION:
            raise ConfigError("convention.attention", self.attention, ", ".join(ATTENTION))
        if self.mesh_read not in MESH_READS:
            raise ConfigError("convention.mesh_read", self.mesh_read, ", ".join(MESH_READS))

    def replace(self, **changes) -> "Convention":
        return dataclasses.replace(self, **changes)


CONVENTIONS: dict[str, Convention] = {
    c.name: c
    for c in (
        Convention("default", description="2 FLOPs/MAC, causal score/value products, head counted; "
                   "norms, biases and residual adds left out (Chinchilla/Kaplan-style)"),
        Convention("mesh", flops_per_mac=1, attention="none", norms=True, bias=True, state=True,
                   read_flops_per_mac=2,
                   description="MeSH Tables 7 / Eq. 8: fvcore-like, 1 FLOP per MAC, SDPA not counted, "
                   "LayerNorm 5/element, bias and topology elementwise ops counted"),
        Convention("spiralformer", attention="full",
                   description="SpiralFormer Table 1: 2 FLOPs/MAC, full T×T score/value products, head counted"),
        Convention("sgt", attention="full", embedding=True,
                   description="SGT Tables 1-2: training FLOPs = 3 × forward, 2 FLOPs/MAC, full attention, "
                   "embedding as a one-hot matmul (forward + weight gradient)"),
        Convention("lt2", attention="full",
                   description="LT2 Appendix: per-layer FLOPs × layers × T (unrolled), 2 FLOPs/MAC"),
        Convention("torch", attention="full", state=False, mesh_read="unrolled",
                   description="what torch.utils.flop_counter.FlopCounterMode measures: matmuls at 2 FLOPs/MAC, "
                   "SDPA over all T×S pairs, nothing elementwise"),
    )
}


def get_convention(name_or_convention) -> Convention:
    if isinstance(name_or_convention, Convention):
        return name_or_convention
    if name_or_convention not in CONVENTIONS:
        raise ConfigError("convention", name_or_convention, ", ".join(CONVENTIONS))
    return CONVENTIONS[name_or_convention]
