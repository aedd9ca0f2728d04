"""The block's norm placement (``model.norm_placement``) and the loop-input norm
(``model.loop_input_norm``): what they compute, that ``pre`` leaves checkpoints and numbers
as they were, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from looplm.config_base import ConfigError
from looplm.model import LoopLM
from looplm.modules.block import Block
from looplm.mixers.config import AttentionConfig
from tests.conftest import random_ids, tiny_config


def test_pre_adds_no_parameters_or_state_dict_entries():
    model = LoopLM(tiny_config("anchor"))
    assert not any("out_norm" in key for key in model.state_dict())


def test_sandwich_normalises_each_sublayer_output_before_the_residual():
    shape = dataclasses.replace(tiny_config("base", norm="rmsnorm").block_shape, norm_placement="sandwich")
    block = Block(shape, [AttentionConfig()])
    with torch.no_grad():
        for norm in (block.attn_out_norm, block.ffn_out_norm):
            norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, shape.d_model)
    ctx_model = LoopLM(tiny_config("base", layout="1", norm="rmsnorm"))
    ids = random_ids(2, 5)
    ctx, _ = ctx_model._context(ids, None, None, x.dtype)
    with torch.no_grad():
        y, _ = block(x, ctx)
        mixed, _ = block.attn(block.attn_norm(x), ctx, None)
        h = x + block.attn_out_norm(mixed)
        expected = h + block.ffn_out_norm(block.ffn(block.ffn_norm(h)))
        out_rms = block.attn_out_norm(mixed).div(block.attn_out_norm.weight).pow(2).mean(-1)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(out_rms, torch.ones_like(out_rms), atol=1e-3, rtol=0)  # up to eps


def test_loop_input_norm_feeds_the_normalised_state_to_later_steps():
    cfg = tiny_config("base", layout="1R3", loop_input_norm=True)
    model = LoopLM(cfg).eval()
    ids = random_ids(2, 7)
    with torch.no_grad():
        h = model.embed(ids)
        ctx, _ = model._context(ids, None, None, h.dtype)
        for t in range(3):
            h = model._run(model.core[0], "core", t, model.norm(h) if t else h, ctx, None)
        expected = model.head(model.norm(h))
        torch.testing.assert_close(model(ids).logits, expected)


@pytest.mark.parametrize("changes,field", [
    (dict(norm_placement="post"), "model.norm_placement"),
    (dict(layout="3", loop_input_norm=True), "model.loop_input_norm"),
    (dict(norm_placement="sandwich", head_loop={"kind": "heads", "heads": 2}), "model.norm_placement"),
    (dict(layout="1R2", loop_input_norm=True, streams={"kind": "two", "inner": 1}), "model.loop_input_norm"),
])
def test_refusals_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny_config("base", **changes)
