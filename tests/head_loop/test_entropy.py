"""Eqs. (4)-(5): length-normalised last-query entropy, by hand and against the model's own
attention probabilities; the meter measures training forwards only."""

from __future__ import annotations

import math

import torch

from looplm import LoopLM
from looplm.head_loop.entropy import EntropyMeter, layer_entropy, normalized_entropy
from looplm.model_config import ModelConfig


def test_eq4_hand_computed_example():
    # A_N = (1/2, 1/4, 1/4): H = ½ ln 2 + ½ ln 4 = 1.5 ln 2; normalised by ln 3
    e = normalized_entropy(torch.tensor([0.5, 0.25, 0.25]))
    assert math.isclose(e.item(), 1.5 * math.log(2) / math.log(3), rel_tol=1e-6)
    assert math.isclose(normalized_entropy(torch.full((7,), 1 / 7)).item(), 1.0, rel_tol=1e-6)
    assert normalized_entropy(torch.tensor([0.0, 1.0, 0.0])).item() == 0.0
    assert normalized_entropy(torch.tensor([1.0])).item() == 0.0  # one key: no uncertainty
    # counts: a padded row of 4 slots with 2 real keys at ½ each has entropy 1
    assert math.isclose(normalized_entropy(torch.tensor([0.5, 0.5, 0.0, 0.0]), torch.tensor(2)).item(), 1.0)
    assert math.isclose(layer_entropy(torch.tensor([0.2, 0.4, 0.9])).item(), 0.5, rel_tol=1e-6)  # Eq. (5)


def _model(**kw):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=32, n_heads=4, layout="2+1R2+1", head_loop={"kind": "heads"}, **kw)
    return LoopLM(cfg)


def _meter_vs_probabilities(**kw):
    model = _model(**kw)
    x = torch.randint(0, 40, (3, 9))
    blocks = model.blocks()
    meter = EntropyMeter(blocks, range(len(blocks)), 4, torch.device("cpu"))
    model.train()
    model(x)
    measured = meter.read()
    model.eval()
    probs = model(x, output_attentions=True).attentions
    # block names in depth order; the shared core block runs at iterations 0 and 1
    keys = {0: [("prelude.0", 0)], 1: [("prelude.1", 0)], 2: [("core.0", 0), ("core.0", 1)], 3: [("coda.0", 0)]}
    for layer, locations in keys.items():
        last = torch.stack([probs[loc][:, :, -1] for loc in locations])  # [iters, B, H, S]
        expected = normalized_entropy(last, (last > 0).sum(-1)).mean(dim=(0, 1))
        torch.testing.assert_close(torch.tensor(measured[layer]), expected, atol=1e-5, rtol=1e-5)
    model.eval()
    model(x)
    assert meter.read() == {}, "eval forwards are not measured"


def test_meter_equals_entropy_of_recorded_probabilities():
    _meter_vs_probabilities()


def test_meter_with_grouped_query_and_window():
    _meter_vs_probabilities(n_kv_heads=2, mixer={"kind": "sliding_window", "window": 4})


def test_grouped_query_entropy_reads_the_kv_heads_in_place():
    """Under GQA each kv head's G queries score its keys as they are: no keys repeated to
    every query head (a [B, H, T, D] tensor), the values of the repeated computation (and
    the MHA case's numbers bit for bit: G = 1 is the same matmul)."""
    from looplm.head_loop.entropy import last_query_entropy
    from looplm.mixers.attention import SoftmaxAttention
    from looplm.modules.rotary import apply_rotary
    from tests.ops.test_dsa import Shapes

    torch.manual_seed(0)
    B, T, d, H, Hkv = 2, 7, 32, 4, 2
    layer = SoftmaxAttention(d, H, Hkv, bias=False)
    x, D = torch.randn(B, T, d), layer.head_dim
    cos, sin = torch.randn(B, T, D), torch.randn(B, T, D)
    with Shapes() as recorder:
        entropy = last_query_entropy(layer, x, (cos, sin))
    assert all(math.prod(shape) < B * H * T * D for _, shape in recorder.shapes), recorder.shapes

    q, k, _ = layer.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = apply_rotary(q[:, -1:].view(B, 1, H, D).transpose(1, 2), cos[:, -1:], sin[:, -1:])
    k = apply_rotary(k.view(B, T, Hkv, D).transpose(1, 2), cos, sin).repeat_interleave(H // Hkv, dim=1)
    probs = torch.softmax((q @ k.transpose(-1, -2))[:, :, 0] * D ** -0.5, dim=-1)
    torch.testing.assert_close(entropy, normalized_entropy(probs))
