"""The backend choice: fla's kernels only on CUDA, and never for a gated backward that fla
itself refuses (Hopper with Triton >= 3.4.0 and < 3.7.1, no tilelang)."""

from __future__ import annotations

import pytest
import torch

from looplm.ops.backend import gated_backward_supported, use_fla
from looplm.ops.fla_hopper import GatedOp


@pytest.mark.parametrize(
    "sm, triton, tilelang, supported",
    [
        (9, "3.6.0", False, False),
        (9, "3.4.0", False, False),
        (9, "3.7.0+git1234", False, False),
        (9, "3.7.1", False, True),
        (9, "3.3.1", False, True),
        (9, "3.6.0", True, True),
        (8, "3.6.0", False, True),
        (10, "3.6.0", False, True),
        (9, "3.10.0rc1", False, True),
    ],
)
def test_gated_backward_support_follows_fla_guard(sm, triton, tilelang, supported):
    assert gated_backward_supported(sm, triton, tilelang) is supported


def test_cpu_tensors_never_use_fla():
    assert not use_fla(torch.zeros(1))
    assert not use_fla(torch.zeros(1), gated=GatedOp("delta", False, 4, 64, 64))
