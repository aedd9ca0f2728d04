"""Dispatched operators of the linear mixers' decoding steps, alone and through
``generate`` (issue 30): bounds measured on CPU, kept from growing back (DESIGN.md
invariant 6). Each failure prints the operators by name."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopLM, load_config
from looplm.accounting.dispatch import count_dispatch
from looplm.mixers import MixerConfig
from tests.mixers.test_delta_decode import CFG, _ctx

#: dispatched operators of one decoding step, mixer alone, default configs on CFG (before
#: issue 30: DeltaNet 43, GDN 54, KDA 56, LA 22, RetNet 42, GLA 25, HGRN2 22, Mamba2 33)
STEP_OPS = {"deltanet": 17, "gated_deltanet": 21, "kda": 24, "linear_attention": 19, "retnet": 37, "gla": 20,
            "hgrn2": 19, "mamba2": 26}
#: per decoded token per block pass through ``generate`` (78.3 and 71.0 before issue 30)
MODEL_OPS_PER_PASS = {"tiny-lt2-gdn": 45.3, "tiny-lt2-hybrid-full-gdn": 44.6}


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


@pytest.mark.parametrize("preset", MODEL_OPS_PER_PASS)
def test_model_decode_operators_per_token_per_block_pass(preset):
    """Measured as the issue does: generate(9) minus generate(1), per token and block pass.
    The block around the mixer (two RMSNorms, SwiGLU, residuals, loop bookkeeping) is about
    24 of these; fusing RMSNorm (about 10 fewer) should bring both to about 35."""
    torch.manual_seed(0)
    cfg = load_config(preset, []).model
    model = LoopLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    model.generate(ids, max_new_tokens=2, temperature=0)  # builds the cached fused weights
    one, _ = count_dispatch(lambda: model.generate(ids, max_new_tokens=1, temperature=0))
    nine, _ = count_dispatch(lambda: model.generate(ids, max_new_tokens=9, temperature=0))
    per_pass = (nine.ops - one.ops) / 8 / cfg.block_passes
    assert per_pass <= MODEL_OPS_PER_PASS[preset], (per_pass, (nine.by_op - one.by_op).most_common())
