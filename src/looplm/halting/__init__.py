"""Halting rules: when a position stops iterating and what the loop reads out.

| kind | rule | readout | source |
| --- | --- | --- | --- |
| none | every macro step | last state | |
| act | Σ σ(wᵀh) ≥ 1 − ε | Σ_τ w_τ h^(τ), ponder cost N + R | Graves 2016; LT2 App. ACT |
| qhalt | σ(wᵀY) > 0.5 | terminal solution, BCE on correctness | TRM; autoregressive-trm App. B.1 |
| convergence | KL(p_{t-1} ‖ p_t) or H(p_t) below a threshold (no parameters: zero-shot, at load time) | the exit step's state (frozen) | Huginn (Geiping et al. 2025 §6) |
| mor | a router per position: expert choice (each step's router, σ(s) > 0.5; top-k in training under ``selection: top_k``) or token choice (depth = argmax of one router up front); update gated h + g·(h' − h) | the state it left at; auxiliary BCE toward top-k / balancing loss | Mixture-of-Recursions (Bae et al. 2025, §2.2.1) |
| exit_gate | step ``exit_at_step``, else CDF of λ_t ∏(1 − λ_s) ≥ threshold (every step still runs) | the exit step's state; trained on it, or on Σ_t p_t L^(t) − β H(p) (``objective: expected``) | Ouro (modeling_ouro.py; paper §3.2-3.3) |
"""

from __future__ import annotations

from looplm.halting.act import ACTHalting
from looplm.halting.base import Halting, HaltState, Readout
from looplm.halting.convergence import ConvergenceExit
from looplm.halting.exit_gate import ExitGateHalting
from looplm.halting.config import HALTING_CONFIGS, HaltingConfig
from looplm.halting.mor import MoRHalting
from looplm.halting.qhalt import QHalting


def build_halting(cfg: HaltingConfig, d_model: int) -> Halting:
    """The halting rule ``cfg`` describes, for states of width ``d_model``."""
    return cfg.build(d_model)


__all__ = ["ACTHalting", "ConvergenceExit", "ExitGateHalting", "HALTING_CONFIGS", "Halting", "HaltState", "HaltingConfig",
           "MoRHalting", "QHalting",
           "Readout", "build_halting"]
