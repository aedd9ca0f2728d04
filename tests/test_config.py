"""Invalid configs are refused at load with the field, the value and what is allowed."""

from __future__ import annotations

import pytest

from looplm.config import load_config, preset_names
from looplm.config_base import ConfigError
from looplm.layout import parse_layout
from looplm.model_config import ModelConfig


@pytest.mark.parametrize(
    "text,pre,core,T,coda",
    [("4+8R2+4", 4, 8, 2, 4), ("2+4x{1,1}+2", 2, 4, 2, 2), ("12", 12, 0, 0, 0), ("8R4", 0, 8, 4, 0), ("3+6R3", 3, 6, 3, 0)],
)
def test_layout_notation(text, pre, core, T, coda):
    layout = parse_layout(text)
    assert (layout.prelude, layout.core, layout.iterations, layout.coda) == (pre, core, T, coda)
    assert parse_layout(str(layout)) == layout


def test_unrolled_depth():
    assert parse_layout("4+8R2+4").unrolled_depth == 24
    assert parse_layout("24").unrolled_depth == 24


@pytest.mark.parametrize(
    "overrides,field,fragment",
    [
        (["model.layout=4+8Q2+4"], "model.layout", "P+CRT+Q"),
        (["model.layout=4+8R0+4"], "model.layout", "T must be >= 1"),
        (["model.layout=2+4x{1/2,1}+2", "model.resolution.shifts=[0,0]"], "model.resolution.shifts[0]", "not causal"),
        (["model.layout=2+4x{2,1}+2"], "model.layout", "(0, 1]"),
        (["model.topology.kind=meshy"], "model.topology.kind", "one of base"),
        (["model.topology.kind=mesh", "model.topology.buffer_slots=1"], "model.topology.buffer_slots", ">= 2"),
        (["model.topology.kind=additive"], "model.topology.supplements", "needed by kind=additive"),
        (["model.topology.supplements=[anchor]"], "model.topology.supplements", "unless kind=additive"),
        (["model.layout=12", "model.topology.kind=mesh"], "model.topology.kind", "dense layout"),
        (["model.n_heads=5"], "model.n_heads", "divisor of d_model"),
        (["model.d_model=abc"], "model.d_model", "an integer"),
        (["model.dmodel=64"], "model.dmodel", "unknown key"),
        (["model.share_core=maybe"], "model.share_core", "true or false"),
        (["train.max_steps=0"], "train.max_steps", ">= 1"),
        (["train.grad_accum=3", "train.batch_size=8"], "train.grad_accum", "divisor"),
        (["data.seq_len=0"], "data.seq_len", ">= 1"),
        (["trian.max_steps=3"], "trian", "unknown top-level key"),
        (["model.norm=batchnorm"], "model.norm", "'rmsnorm'"),
    ],
)
def test_invalid_configs_name_field_value_and_allowed(overrides, field, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("default", overrides)
    assert err.value.field == field
    assert fragment in str(err.value)


def test_overrides_apply_and_round_trip():
    cfg = load_config("default", ["model.layout=4+8R2+4", "model.topology.kind=anchor", "train.lr=3e-4"])
    assert cfg.model.parsed_layout.iterations == 2 and cfg.model.topology.kind == "anchor" and cfg.train.lr == 3e-4
    assert type(cfg).from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads(name):
    cfg = load_config(name)
    assert cfg.model.vocab_size >= 2


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="pythia-160m"):
        load_config("no-such-preset")


def test_model_config_from_dict_refuses_wrong_nested_type():
    with pytest.raises(ConfigError, match="model.topology"):
        ModelConfig.from_dict({"topology": "mesh"}, prefix="model")


def test_a_folder_named_like_a_preset_does_not_hide_the_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-mesh").mkdir()  # e.g. a run directory
    assert load_config("tiny-mesh").model.topology.kind == "mesh"
    with pytest.raises(ConfigError, match="existing YAML file"):
        load_config(str(tmp_path / "missing.yaml"))
