"""The short convolution: causal, equal to nn.Conv1d with left zero padding, cacheable."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from looplm.modules.short_conv import ShortConvolution


def test_matches_padded_depthwise_conv_and_incremental_steps():
    torch.manual_seed(0)
    conv = ShortConvolution(6, kernel_size=4, bias=True)
    x = torch.randn(2, 9, 6)
    full, state = conv(x)
    ref = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight, conv.bias, groups=6)).transpose(1, 2)
    torch.testing.assert_close(full, ref)
    pieces, s = [], None
    for a, b in [(0, 2), (2, 3), (3, 9)]:
        y, s = conv(x[:, a:b], s)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, 1), full)
    torch.testing.assert_close(s, state)


def test_left_padding_is_treated_as_absent():
    torch.manual_seed(0)
    conv = ShortConvolution(4, kernel_size=3, activation=None)
    x = torch.randn(1, 5, 4)
    padded = torch.cat([torch.randn(1, 3, 4), x], dim=1)
    valid = torch.tensor([[False] * 3 + [True] * 5])
    torch.testing.assert_close(conv(padded, valid=valid)[0][:, 3:], conv(x)[0])
