"""Depth-level and loop-level hybrids (LT2 Table 4): which block runs which mixer."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopLM
from looplm.config_base import ConfigError
from looplm.mixers.pattern import HybridConfig, hybrid_positions
from looplm.model_config import ModelConfig
from tests.conftest import random_ids, tiny_config


@pytest.mark.parametrize(
    "ratio,placement,expected",
    [
        ("4:1", "interleave", [4, 9, 14, 19]),  # LT2: every 5th layer is Full
        ("1:1", "interleave", list(range(1, 24, 2))),
        ("4:1", "bookend", [0, 1, 2, 22, 23]),  # round(24/5) = 5 hybrid blocks
        ("4:1", "front", [0, 1, 2, 3, 4]),
        ("4:1", "back", [19, 20, 21, 22, 23]),
        ("3:2", "interleave", [2, 4, 7, 9, 11, 14, 16, 19, 21, 23]),  # 2/5 of 24, evenly spread
    ],
)
def test_hybrid_positions_over_24_blocks(ratio, placement, expected):
    assert hybrid_positions(HybridConfig(ratio=ratio, placement=placement), 24) == expected


def test_explicit_layers_and_their_errors():
    assert hybrid_positions(HybridConfig(layers=(3, 0)), 6) == [0, 3]
    with pytest.raises(ConfigError, match="below 6"):
        hybrid_positions(HybridConfig(layers=(6,)), 6)


@pytest.mark.parametrize(
    "model,field,fragment",
    [
        ({"hybrid": {"ratio": "4-1"}}, "model.hybrid.ratio", "'a:b'"),
        ({"hybrid": {"ratio": "4:0"}}, "model.hybrid.ratio", "b >= 1"),
        ({"layout": "1+1R2+1", "hybrid": {"ratio": "30:1"}}, "model.hybrid.ratio", "at least one hybrid block"),
        ({"hybrid": {"placement": "middle"}}, "model.hybrid.placement", "'interleave'"),
        ({"loop_mixers": [{"kind": "attention"}]}, "model.loop_mixers", "one mixer per iteration"),
        ({"loop_mixers": [{"kind": "attention"}] * 2, "hybrid": {}}, "model.loop_mixers", "depth-level or a loop-level"),
        ({"loop_mixers": [{"kind": "attention"}, {"kind": "nope"}]}, "model.loop_mixers[1].kind", "one of"),
    ],
)
def test_hybrid_config_errors(model, field, fragment):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({"layout": "2+4R2+2", **model}, prefix="model")
    assert err.value.field == field and fragment in str(err.value)


def test_depth_hybrid_places_mixers_in_prelude_core_coda_order():
    cfg = tiny_config("anchor", layout="2+2R3+2", mixer={"kind": "sliding_window", "window": 2},
                      hybrid={"mixer": {"kind": "attention"}, "ratio": "1:1", "placement": "interleave"})
    plan = cfg.block_mixers()
    kinds = [plan[k][0].kind for k in [("prelude", 0), ("prelude", 1), ("core", 0), ("core", 1), ("coda", 0), ("coda", 1)]]
    assert kinds == ["sliding_window", "attention"] * 3
    model = LoopLM(cfg)
    assert model.prelude[1].attn.window is None and model.core[0][0].attn.window == 2


def test_loop_level_window_schedule_shares_parameters():
    schedule = [{"kind": "attention"}, {"kind": "sliding_window", "window": 4}, {"kind": "sliding_window", "window": 2}]
    looped = LoopLM(tiny_config("anchor", layout="1+1R3+1", loop_mixers=schedule)).eval()
    plain = LoopLM(tiny_config("anchor", layout="1+1R3+1"))
    assert sum(p.numel() for p in looped.parameters()) == sum(p.numel() for p in plain.parameters())
    assert [m.window for m in looped.core[0][0].per_iteration] == [None, 4, 2]
    # the first iteration is full attention: the same weights without a schedule agree
    # when windows never bind (sequence shorter than every window)
    plain.load_state_dict(looped.state_dict())
    x = random_ids(1, 2)
    torch.testing.assert_close(looped(x).logits, plain.eval()(x).logits)
    y = random_ids(1, 9)
    assert not torch.allclose(looped(y).logits[:, -1], plain(y).logits[:, -1])


def test_loop_level_mixers_of_different_kinds_get_their_own_parameters():
    from looplm.mixers.registry import MIXER_CONFIGS

    if "gated_deltanet" not in MIXER_CONFIGS:
        pytest.skip("needs a second mixer kind")
    cfg = tiny_config("anchor", layout="1+1R3+1",
                      loop_mixers=[{"kind": "attention"}, {"kind": "gated_deltanet"}, {"kind": "sliding_window", "window": 3}])
    block = LoopLM(cfg).core[0][0]
    assert len(block.mixer_layers()) == 2


def test_more_iterations_than_loop_mixers_is_refused_and_fewer_decode_exactly():
    """Test-time depth r > T on a loop-level hybrid has no mixer for iteration T + 1: a
    ConfigError naming ``iterations`` (it was an IndexError in Block.mixer_at); r < T runs
    and decodes like the full forward at r."""
    from looplm import LoopCache
    from tests.invariants import prefill_then_tokens

    torch.manual_seed(0)
    model = LoopLM(tiny_config("anchor", layout="1R2", loop_mixers=[
        {"kind": "attention"}, {"kind": "sliding_window", "window": 3}])).eval()
    with pytest.raises(ConfigError, match="loop_mixers") as err:
        model(random_ids(2, 6), iterations=3)
    assert err.value.field == "iterations"
    with pytest.raises(ConfigError, match="loop_mixers"):
        model.generate(random_ids(1, 4), max_new_tokens=2, temperature=0, iterations=3)
    x = random_ids(2, 9)
    full = model(x, iterations=1).logits
    cache, start, pieces = LoopCache(), 0, []
    for end in prefill_then_tokens(4, 9):
        pieces.append(model(x[:, start:end], cache=cache, iterations=1).logits)
        start = end
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=2e-5, rtol=1e-5)
