"""Honest accounting: parameter counts, FLOPs over the unrolled computation, conventions
of the papers, layout matching and model-FLOPs utilisation. See docs/accounting.md.

Names are loaded on first use (PEP 562): the model's modules import
:mod:`looplm.accounting.cost` for their FLOP rules and step descriptions, and importing it
must not import the counter, which imports the model."""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the submodule that defines it
_EXPORTS = {
    "CONVENTIONS": "conventions",
    "Convention": "conventions",
    "get_convention": "conventions",
    "Call": "cost",
    "Cost": "cost",
    "Counted": "cost",
    "Step": "cost",
    "module_cost": "cost",
    "register_flop_rule": "cost",
    "FlopReport": "flops",
    "count_flops": "flops",
    "realised_block_passes": "flops",
    "PEAK_FLOPS": "hardware",
    "device_peak_flops": "hardware",
    "mfu": "hardware",
    "LayoutMatch": "matching",
    "match_layouts": "matching",
    "active_parameter_count": "params",
    "analytic_parameter_counts": "params",
    "parameter_counts": "params",
    "execution_plan": "plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
