"""The causal right shift of spiralformer.txt Eq. (22) (§2.3.4, Prop. 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_right_shift(u: torch.Tensor, shift: int) -> torch.Tensor:
    """ũ[i] = 0 for i < s, u[i − s] otherwise (Eq. 22). u: [B, L, d] -> [B, L, d].

    The loop driver fuses this with up-scaling (each position reads the latent of chunk
    π(i − s) directly, see ``looplm.resolution.recursion``); this plain form is the
    reference the tests compare against.
    """
    if shift == 0:
        return u
    L = u.shape[1]
    return F.pad(u, (0, 0, shift, 0))[:, :L]
