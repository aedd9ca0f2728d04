"""One config class per kind (topology, halting, streams, mixers): a kind checks only its
own fields, refuses another kind's, and answers capability questions itself."""

from __future__ import annotations

import pytest

from looplm.config_base import ConfigError
from looplm.halting.config import HALTING_CONFIGS, ACTHaltingConfig, HaltingConfig
from looplm.mixers import MixerConfig
from looplm.mixers.gla import GLAConfig
from looplm.model_config import ModelConfig
from looplm.streams.config import STREAMS_CONFIGS, StreamsConfig
from looplm.topology.config import TOPOLOGY_CONFIGS, TopologyConfig
from looplm.train.checkpoint import config_differences, with_defaults


@pytest.mark.parametrize(
    "axis, data, field, fragment",
    [
        ("halting", {"kind": "qhalt", "epsilon": 0.5, "ponder_cost": 0.3}, "model.halting.epsilon",
         "refused unless kind=act"),
        ("halting", {"kind": "act", "loss_weight": 2.0}, "model.halting.loss_weight", "refused unless kind=qhalt"),
        ("halting", {"kind": "none", "init_bias": -3.0}, "model.halting.init_bias", "allowed keys: kind"),
        ("topology", {"kind": "mesh", "supplements": ["anchor"]}, "model.topology.supplements",
         "unless kind=additive"),
        ("topology", {"kind": "anchor", "buffer_slots": 4}, "model.topology.buffer_slots", "unless kind=mesh"),
        ("streams", {"kind": "single", "init": "zeros"}, "model.streams.init", "unless kind=two"),
        ("streams", {"kind": "two", "passes": 3}, "model.streams.passes", "allowed keys: kind, outer"),
        ("mixer", {"kind": "gla", "window": 8}, "model.mixer.window", "unless kind=sliding_window or nsa"),
    ],
)
def test_a_field_of_another_kind_is_refused(axis, data, field, fragment):
    with pytest.raises(ConfigError) as err:
        ModelConfig(layout="1R2", **{axis: data})
    assert err.value.field == field and fragment in str(err.value)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: ACTHaltingConfig(kind="qhalt"), "built by QHaltingConfig"),
        (lambda: GLAConfig(kind="retnet"), "built by RetNetConfig"),
        (lambda: TopologyConfig(), "built by BaseTopologyConfig"),
        (lambda: TopologyConfig.from_dict({"kind": "meshy"}), "one of base"),
    ],
)
def test_a_class_builds_only_its_own_kind(make, fragment):
    with pytest.raises(ConfigError, match=fragment):
        make()


def test_from_dict_dispatches_on_kind_and_round_trips():
    for base, registry in ((TopologyConfig, TOPOLOGY_CONFIGS), (HaltingConfig, HALTING_CONFIGS),
                           (StreamsConfig, STREAMS_CONFIGS)):
        for kind, cls in registry.items():
            data = {"kind": kind, "supplements": ["anchor"]} if kind == "additive" else {"kind": kind}
            cfg = base.from_dict(data)
            assert type(cfg) is cls and base.from_dict(cfg.to_dict()) == cfg
    assert type(HaltingConfig.from_dict({})) is HALTING_CONFIGS["none"]  # a mapping without kind: the default
    assert type(ModelConfig(topology={"kind": "mesh", "buffer_slots": 6}).topology) is TOPOLOGY_CONFIGS["mesh"]


def test_config_json_written_by_the_flat_configs_still_loads():
    """Before each kind had its class, every kind wrote every field; those at their
    defaults are read back and dropped, so old checkpoints resume without differences."""
    flat = {
        "layout": "1R3",
        "topology": {"kind": "anchor", "supplements": [], "buffer_slots": None},
        "streams": {"kind": "two", "outer": 2, "inner": 1, "init": "learned", "no_grad_cycles": False},
        "halting": {"kind": "act", "epsilon": 0.05, "ponder_cost": 0.01, "loss_weight": 1.0, "full_compute": True,
                    "init_bias": None},
    }
    flat["topology"]["kind"] = "base"  # two streams define the update themselves
    cfg = ModelConfig.from_dict(flat, prefix="model")
    assert cfg.halting == ACTHaltingConfig(epsilon=0.05, full_compute=True) and cfg.streams.passes == 4
    assert config_differences(with_defaults(flat, ModelConfig, "model"), cfg.to_dict(), "model") == []
    with pytest.raises(ConfigError, match="model.halting.loss_weight"):  # not the default: a real setting
        ModelConfig.from_dict({**flat, "halting": {**flat["halting"], "loss_weight": 2.0}}, prefix="model")


def test_capabilities_are_answered_by_each_kind():
    def having(registry, capability):
        return sorted(kind for kind, cls in registry.items() if getattr(cls, capability))

    assert [k for k in TOPOLOGY_CONFIGS if k not in having(TOPOLOGY_CONFIGS, "defines_update")] == ["base"]
    assert [k for k in TOPOLOGY_CONFIGS if k not in having(TOPOLOGY_CONFIGS, "can_freeze_positions")] == ["mesh"]
    assert having(HALTING_CONFIGS, "adaptive") == ["act", "convergence", "exit_gate", "mor", "qhalt"]
    # the exit gate needs no coda only under its expected objective: asked of a config, not its class
    assert sorted(k for k, cls in HALTING_CONFIGS.items() if cls().needs_no_coda) == ["qhalt"]
    assert HaltingConfig.from_dict({"kind": "exit_gate", "objective": "expected"}).needs_no_coda
    assert having(STREAMS_CONFIGS, "defines_update") == ["two"]
    none = HaltingConfig.from_dict({"kind": "none"})
    assert none.full_compute is False and none.init_bias is None  # no head: nothing to force, no bias


@pytest.mark.parametrize(
    "mixer, ok",
    [({"kind": "gla", "chunk_size": 7}, True), ({"kind": "deltanet", "chunk_size": 32}, True),
     ({"kind": "deltanet", "chunk_size": 48}, False), ({"kind": "kda", "chunk_size": 8}, False),
     ({"kind": "retnet", "chunk_size": 0}, False)],
)
def test_chunk_size_follows_the_ops_rule(mixer, ok):
    """A mixer accepts exactly the chunk sizes its op accepts (decay: any >= 1; delta rule:
    powers of two >= 16), checked at config load."""
    if ok:
        assert MixerConfig.from_dict(mixer).chunk_size == mixer["chunk_size"]
    else:
        with pytest.raises(ConfigError) as err:
            MixerConfig.from_dict(mixer)
        assert err.value.field == "model.mixer.chunk_size"
