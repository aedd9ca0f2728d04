"""The ladder's rungs: each spends exactly C block passes, adds one mechanism to the rung
before it (autoregressive-trm.txt Table 1), and its preset agrees with the helper."""

from __future__ import annotations

import pytest

from looplm import LoopLM
from looplm.config import load_config
from looplm.config_base import ConfigError
from looplm.ladder import MECHANISMS, RUNGS, passes_per_step, rung_model
from looplm.model_config import ModelConfig


@pytest.mark.parametrize("budget", [6, 12, 24])
@pytest.mark.parametrize("rung", RUNGS)
def test_every_rung_spends_the_budget(rung, budget):
    cfg = ModelConfig(vocab_size=14, d_model=16, n_heads=2, **rung_model(rung, budget))
    assert cfg.block_passes == budget
    assert cfg.iterations * cfg.passes_per_step == (budget if rung != "dense" else 0)


def test_nested_budget_follows_appendix_b():
    """C = n·H·(L+1): at C = 12 with (H, L) = (1, 2), n = 4 (the paper's example)."""
    assert rung_model("dual_nested_ut", 12, outer=1, inner=2)["layout"] == "1R4"
    assert rung_model("ar_trm", 24, outer=2, inner=2)["layout"] == "1R4"
    assert rung_model("dual_ut", 12)["layout"] == "1R6"
    assert passes_per_step("dual_nested_ut", outer=2, inner=3) == 8


def test_each_rung_changes_one_mechanism():
    rows = [MECHANISMS[r] for r in RUNGS]
    for before, after in zip(rows, rows[1:]):
        changed = sum(a != b for a, b in zip(before, after))
        assert changed == 1 or (after[5] and not after[2] and before[2]), (before, after)  # Q-halt replaces ACT


def test_tied_rungs_share_one_block():
    for rung in RUNGS[1:]:
        model = LoopLM(ModelConfig(vocab_size=14, d_model=16, n_heads=2, **rung_model(rung, 12)))
        assert len(model.blocks()) == 1


@pytest.mark.parametrize("rung", RUNGS)
def test_presets_are_the_helper_at_c12(rung):
    preset = load_config(f"ladder-{rung.replace('_', '-')}").model
    expected = ModelConfig.from_dict({**preset.to_dict(), **rung_model(rung, 12)}, prefix="model")
    assert preset == expected
    assert preset.block_passes == 12


@pytest.mark.parametrize(
    "rung, budget, field",
    [("dual_ut", 7, "budget"), ("dual_nested_ut", 10, "budget"), ("tied", 0, "budget"), ("deep", 12, "rung")],
)
def test_bad_rung_or_budget_names_the_field(rung, budget, field):
    with pytest.raises(ConfigError) as err:
        rung_model(rung, budget)
    assert err.value.field == field
