"""The compute-placement ladder (autoregressive-trm.txt Table 1, App. B): seven ways to
spend a budget of C block passes per forward with one decoder-block template.

Each rung adds one mechanism to the one before it:

| rung | layout at budget C | adds |
| --- | --- | --- |
| dense | C untied blocks | |
| tied | 1 block × C steps | weight tying |
| tied_step | 1 × C | step embeddings e_t |
| ut_act | 1 × C | Graves ACT (weighted readout) |
| dual_ut | 1 × C/2, two streams (H = L = 1) | solution / reasoning streams |
| dual_nested_ut | 1 × C/(H(L+1)), two streams (H, L) | nested reasoning updates |
| ar_trm | as dual_nested_ut | Q-halt with terminal readout instead of ACT |

Compute-matched comparisons force full computation (no early halting, no ponder cost)
as App. B.1 states; ``full_compute=False`` gives the adaptive variants.
"""

from __future__ import annotations

from typing import Any

from looplm.config_base import ConfigError

RUNGS = ("dense", "tied", "tied_step", "ut_act", "dual_ut", "dual_nested_ut", "ar_trm")

#: the rung's row of Table 1: (tie, step, act, two streams, nest, q-halt)
MECHANISMS = {
    "dense": (False, False, False, False, False, False),
    "tied": (True, False, False, False, False, False),
    "tied_step": (True, True, False, False, False, False),
    "ut_act": (True, True, True, False, False, False),
    "dual_ut": (True, True, True, True, False, False),
    "dual_nested_ut": (True, True, True, True, True, False),
    "ar_trm": (True, True, False, True, True, True),
}


def passes_per_step(rung: str, outer: int = 1, inner: int = 2) -> int:
    """Block passes per macro step: 1 (single stream), 2 (two-phase) or H·(L + 1) (nested)."""
    tie, step, act, two, nest, qhalt = MECHANISMS[_check_rung(rung)]
    if nest:
        return outer * (inner + 1)
    return 2 if two else 1


def rung_model(rung: str, budget: int, *, outer: int = 1, inner: int = 2, full_compute: bool = True) -> dict[str, Any]:
    """The ``model`` fields that make ``rung`` spend exactly ``budget`` = C block passes per
    forward (App. B "Compute normalization": C = n, 2n, or n·H·(L+1)); merge them over a
    base model config (width, heads, block template, vocabulary)."""
    tie, step, act, two, nest, qhalt = MECHANISMS[_check_rung(rung)]
    if not isinstance(budget, int) or budget < 1:
        raise ConfigError("budget", budget, "an integer >= 1 (block passes per forward)")
    passes = passes_per_step(rung, outer, inner)
    if budget % passes:
        raise ConfigError("budget", budget, f"a multiple of {passes}, the block passes of one {rung} macro step")
    steps = budget // passes
    if not tie:
        return {"layout": str(budget), "step_embeddings": False, "streams": {"kind": "single"},
                "halting": {"kind": "none"}, "topology": {"kind": "base"}}
    fields: dict[str, Any] = {"layout": f"1R{steps}", "topology": {"kind": "base"}, "step_embeddings": step,
                              "streams": {"kind": "single"}, "halting": {"kind": "none"}}
    if two:
        fields["streams"] = {"kind": "two", "outer": outer if nest else 1, "inner": inner if nest else 1}
    if act:
        fields["halting"] = {"kind": "act", "full_compute": full_compute}
    if qhalt:
        fields["halting"] = {"kind": "qhalt", "full_compute": full_compute}
    return fields


def _check_rung(rung: str) -> str:
    if rung not in MECHANISMS:
        raise ConfigError("rung", rung, f"one of {', '.join(RUNGS)}")
    return rung
