"""Dispatched operators of the linear mixers' decoding steps, the mixer alone (issue 30):
bounds measured on CPU, kept from growing back (DESIGN.md invariant 6); through
``generate``, per block pass: tests/test_compiled_decode.py. Each failure prints the
operators by name."""

from __future__ import annotations

import pytest
import torch

from looplm.accounting.dispatch import count_dispatch
from looplm.mixers import MixerConfig
from tests.mixers.test_delta_decode import CFG, _ctx

#: dispatched operators of one decoding step, mixer alone, default configs on CFG (before
#: issue 30: DeltaNet 43, GDN 54, KDA 56, LA 22, RetNet 42, GLA 25, HGRN2 22, Mamba2 33)
STEP_OPS = {"deltanet": 17, "gated_deltanet": 21, "kda": 24, "linear_attention": 19, "retnet": 37, "gla": 20,
            "hgrn2": 19, "mamba2": 26}


@pytest.mark.parametrize("kind", STEP_OPS)
def test_decode_step_operator_count(kind):
    torch.manual_seed(0)
    layer = MixerConfig.from_dict({"kind": kind}).build(CFG.block_shape).eval()
    x = torch.randn(2, 8, CFG.d_model)
    with torch.no_grad():
        _, state = layer(x[:, :7], _ctx(2, 7, 0))
        ctx = _ctx(2, 1, 7)
        layer(x[:, 7:], ctx, state)  # builds the cached fused weights
        count, _ = count_dispatch(lambda: layer(x[:, 7:], ctx, state))
    assert count.syncs == 0, count.by_op
    assert count.ops <= STEP_OPS[kind], count.by_op
