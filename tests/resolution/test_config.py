"""model.resolution and fractional layouts are validated at config load."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopLM
from looplm.config import load_config
from looplm.config_base import ConfigError
from looplm.model_config import ModelConfig
from looplm.resolution import IterationResolution
from looplm.topology.config import TopologyConfig
from tests.conftest import random_ids, tiny_config
from tests.invariants import assert_strictly_causal

C2F = "4+8x{1/8,1/4,1/2,1}+4"


def test_defaults_follow_section_2_4():
    cfg = ModelConfig(layout=C2F, topology=TopologyConfig.from_dict({"kind": "anchor"}, prefix="model.topology"))
    assert cfg.resolution_schedule == tuple(IterationResolution(g, g // 2, g - 1) for g in (8, 4, 2, 1))
    assert cfg.core_lengths(4096) == [512, 1024, 2048, 4096]


@pytest.mark.parametrize("shifts,bad", [([6, 3, 1, 0], 0), ([7, 2, 1, 0], 1), ([7, 3, 0, 0], 2)])
def test_non_causal_shift_is_refused(shifts, bad):
    with pytest.raises(ConfigError, match="not causal") as err:
        ModelConfig.from_dict({"layout": C2F, "resolution": {"shifts": shifts}}, prefix="model")
    assert err.value.field == f"model.resolution.shifts[{bad}]"


@pytest.mark.parametrize("resolution,field", [
    ({"shifts": [7, 3, 1]}, "model.resolution.shifts"),
    ({"offsets": [0, 0, 0]}, "model.resolution.offsets"),
    ({"offsets": [8, 0, 0, 0]}, "model.resolution.offsets[0]"),
    ({"offsets": [0, 0, 0, 1]}, "model.resolution.offsets[3]"),
    ({"offsets": [-1, 0, 0, 0]}, "model.resolution.offsets"),
    ({"down": "max"}, "model.resolution.down"),
    ({"up": "learned"}, "model.resolution.up"),
    ({"gain": 2}, "model.resolution.gain"),
])
def test_bad_fields_name_the_field(resolution, field):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({"layout": C2F, "resolution": resolution}, prefix="model")
    assert err.value.field == field


def test_dense_layout_takes_no_resolution():
    with pytest.raises(ConfigError, match="model.resolution"):
        ModelConfig(layout="12", resolution={"down": "mean"})


def test_table_2_ablations_and_round_trip():
    for variant in ({"offsets": [0, 0, 0, 0]}, {"shifts": [8, 4, 2, 1]}, {"down": "mean"}, {"up": "uniform"},
                    {"down": "mean", "up": "uniform"}):
        cfg = ModelConfig.from_dict({"layout": C2F, "topology": {"kind": "anchor"}, "resolution": variant}, prefix="model")
        assert ModelConfig.from_dict(cfg.to_dict(), prefix="model") == cfg
    f2c = ModelConfig.from_dict({"layout": "4+8x{1,1/2,1/4,1/8}+4", "topology": {"kind": "mesh"}}, prefix="model")
    assert [it.chunk for it in f2c.resolution_schedule] == [1, 2, 4, 8]


@pytest.mark.parametrize("scale,b,l", [
    ("160m", "2+4x{1/8,1/4,1/2,1}+2", "4+4x{1/16,1/8,1/4,1/2}+4"),
    ("410m", "4+8x{1/8,1/4,1/2,1}+4", "8+8x{1/16,1/8,1/4,1/2}+8"),
    ("1b", "3+5x{1/8,1/4,1/2,1}+3", "5+6x{1/16,1/8,1/4,1/2}+5"),
    ("1.4b", "4+8x{1/8,1/4,1/2,1}+4", "8+8x{1/16,1/8,1/4,1/2}+8"),
])
def test_table_1_presets(scale, b, l):
    for variant, layout in (("b", b), ("l", l)):
        cfg = load_config(f"spiralformer-{variant}-{scale}").model
        assert cfg.layout == layout and cfg.topology.kind == "mesh"
        assert (cfg.resolution.down, cfg.resolution.up) == ("aggregate", "router")
    assert load_config("spiralformer-b-410m-anchor").model.topology.kind == "anchor"


@pytest.mark.parametrize("layout", ["1+1x{1/2,1}", "1x{1/2,1}", "1+1x{1/2,1}+1", C2F])
def test_base_topology_is_refused_below_full_resolution(layout):
    """h ← S↑ update would drop each token's own state through the causal shift (Eq. 22)."""
    with pytest.raises(ConfigError, match="drops each token's own state") as err:
        ModelConfig.from_dict({"layout": layout, "topology": {"kind": "base"}}, prefix="model")
    assert err.value.field == "model.topology.kind"
    for kind in ("anchor", "residual", "mesh"):
        ModelConfig.from_dict({"layout": layout, "topology": {"kind": kind}}, prefix="model")
    ModelConfig.from_dict({"layout": "1R2", "topology": {"kind": "base"}}, prefix="model")


@pytest.mark.parametrize("kind,layout", [("gated_residual", "1x{1/2,1}"), ("gated_residual", "1+1x{1/2,1/2}+1"),
                                         ("concat_adapter", "1x{1,1/2}"), ("concat_adapter", "1+1x{1/2,1/2}+1")])
def test_topologies_that_replace_the_state_are_refused_below_full_resolution(kind, layout):
    """gated_residual starts as base (ρ = 0: h ← f(h)) and concat_adapter's step is s ← update:
    through S↑'s causal shift token 0's logits would not depend on token 0 (found by a fuzzer).
    concat_adapter re-reads the input e at every step, so a full-resolution last step suffices."""
    with pytest.raises(ConfigError, match="drops each token's own state") as err:
        tiny_config(kind, layout=layout)
    assert err.value.field == "model.topology.kind"


@pytest.mark.parametrize("kind,layout", [("concat_adapter", "1x{1/2,1}"), ("static_combination", "1x{1/2,1/2}"),
                                         ("dynamic_combination", "1x{1/2,1/2}"), ("additive", "1x{1/2,1/2}")])
def test_topologies_that_keep_each_token_stay_accepted_and_strictly_causal(kind, layout):
    torch.manual_seed(0)
    model = LoopLM(tiny_config(kind, layout=layout)).eval()
    assert_strictly_causal(model, random_ids(2, 13), (0, 6, 12), shift=7)
