"""Honest accounting: parameter counts, FLOPs over the unrolled computation, conventions
of the papers, layout matching and model-FLOPs utilisation. See docs/accounting.md."""

from looplm.accounting.conventions import CONVENTIONS, Convention, get_convention
from looplm.accounting.cost import Call, Cost, module_cost, register_flop_rule
from looplm.accounting.flops import FlopReport, count_flops, realised_block_passes
from looplm.accounting.hardware import PEAK_FLOPS, device_peak_flops, mfu
from looplm.accounting.matching import LayoutMatch, match_layouts
from looplm.accounting.params import analytic_parameter_counts, parameter_counts
from looplm.accounting.plan import Step, execution_plan

__all__ = [
    "CONVENTIONS",
    "Call",
    "Convention",
    "Cost",
    "FlopReport",
    "LayoutMatch",
    "PEAK_FLOPS",
    "Step",
    "analytic_parameter_counts",
    "count_flops",
    "device_peak_flops",
    "execution_plan",
    "get_convention",
    "match_layouts",
    "mfu",
    "module_cost",
    "parameter_counts",
    "realised_block_passes",
    "register_flop_rule",
]
