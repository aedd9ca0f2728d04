"""How the counter finds a module's FLOP rule: its class's ``flop_cost``, torch's built-ins
from the registry in accounting/cost.py, the children's sum, or a clear error."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import looplm
from looplm.accounting.cost import Call, Cost, module_cost

CALL = Call(batch=2, tokens=8, keys=8, width=4)


class _Scaled(nn.Module):
    """A leaf with a parameter of its own and no rule: its arithmetic would go uncounted."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


class _WithRule(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def flop_cost(self, call: Call) -> Cost:
        return Cost(state=call.rows)


class _Container(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3, bias=False), nn.Identity()


def test_a_leaf_with_parameters_and_no_rule_is_an_error():
    with pytest.raises(TypeError, match=r"no FLOP rule for _Scaled: .*flop_cost\(self, call\)"):
        module_cost(_Scaled(), CALL)


def test_a_method_rule_wins_over_the_children_and_torch_modules_use_the_registry():
    assert module_cost(_WithRule(), CALL) == Cost(state=16)
    assert module_cost(nn.Linear(4, 3), CALL) == Cost(mac=16 * 12, bias=16 * 3)
    assert module_cost(_Container(), CALL) == Cost(mac=16 * 12)  # no rule: the children's sum
    assert module_cost(nn.GELU(), CALL) == Cost()  # no parameters: an activation, left out


def test_the_counter_core_imports_nothing_of_the_model():
    """accounting/cost.py sits below every module whose rule it runs (they import it)."""
    path = Path(looplm.__file__).parent / "accounting" / "cost.py"
    imported = {node.module for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("looplm")}
    assert imported <= {"looplm.accounting.conventions"}, imported
