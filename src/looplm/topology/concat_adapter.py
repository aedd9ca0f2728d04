"""Huginn's recurrent state with input injection by concatenation (Geiping et al. 2025,
"Scaling up Test-Time Compute with Latent Reasoning", arXiv 2502.05171, §3.1, Eq. 1):

    e = P(x),   s_0 ~ N(0, σ²·I),   s_i = R(e, s_{i−1}) for i = 1..r,   p = C(s_r)

The recurrent block R begins with an adapter A: R^{2d} -> R^d on the concatenation
[s_{i−1}, e] (§3.2, the adapter), then the core blocks. So the loop state is the latent
s (what halting rules, ``output_states`` and the coda read), not the prelude output e;
e travels in the carrier and enters every iteration through A. The core reads
A([s, e]) (:meth:`ConcatAdapterTopology.core_input`, the streams' seam for a topology
that prepares the core's input), and the core's output is the next state.

s_0 (§3.1): in training a fresh draw per position and call, a normal of std ``state_std``
truncated at ±3σ. The paper writes s_0 ~ N(0, σ²I) without σ; the released config says
"like-init" (the weights' std √(2/(5d))) and its modeling code multiplies that draw by
the embedding scale √d, so σ = √(2/5) ≈ 0.632, our default (the state then sits at the
scale of the √d-scaled embeddings, ``model.embed_scale``; set ``state_std`` for others). At inference (``eval()``) a
random state would make the logits of two forwards differ, so decoding could not match
the full forward: we resolve this by drawing s_0 once, from a fixed seed, as one vector
of the same distribution shared by every position (a buffer, not saved: it is rebuilt
from the seed), so evaluation is deterministic and strictly causal. Huginn's own
``deterministic`` switch uses zeros instead; ours stays in the training distribution.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost, Step, module_cost
from looplm.topology.base import LoopState, Topology

#: the seed of the inference state s_0 (any fixed number: the state only has to be the same every time)
EVAL_STATE_SEED = 2502_05171


class ConcatAdapterTopology(Topology):
    """State s (the core's output), carrier e (the prelude's output); the core reads
    A([s, e]) with A a bias-free linear 2d -> d."""

    def __init__(self, dim: int, state_std: float):
        super().__init__()
        self.state_std = state_std
        self.adapter = nn.Linear(2 * dim, dim, bias=False)  # A: R^{2d} -> R^d
        self.register_buffer("eval_state", torch.zeros(dim), persistent=False)  # s_0 at inference, [d]
        self._draw_eval_state()

    def extra_repr(self) -> str:
        return f"state_std={self.state_std:g}"

    def start(self, h_emb: torch.Tensor, h_pre: torch.Tensor) -> LoopState:
        if self.training:
            s0 = torch.empty(h_pre.shape, dtype=torch.float32, device=h_pre.device)
            nn.init.trunc_normal_(s0, std=self.state_std, a=-3 * self.state_std, b=3 * self.state_std)  # s_0 ~ N(0, σ²I)
            s0 = s0.to(h_pre.dtype)
        else:
            s0 = self.eval_state.to(h_pre.dtype).expand_as(h_pre)
        return LoopState(h=s0, carrier={"e": h_pre})

    def core_input(self, state: LoopState, t: int) -> torch.Tensor:
        return self.adapter(torch.cat([state.h, state.carrier["e"]], dim=-1))  # A([s_{i−1}, e]), Eq. (1)

    def step(self, state: LoopState, update: torch.Tensor, t: int) -> LoopState:
        return LoopState(h=update, carrier=state.carrier, record=state.record)  # s_i = R(e, s_{i−1})

    def reset_parameters(self, init_std: float) -> None:
        nn.init.normal_(self.adapter.weight, std=init_std)
        self._draw_eval_state()

    def _draw_eval_state(self) -> None:
        if self.eval_state.is_meta:
            return
        generator = torch.Generator().manual_seed(EVAL_STATE_SEED)
        draw = torch.empty(self.eval_state.shape[0], dtype=torch.float32)
        nn.init.trunc_normal_(draw, std=self.state_std, a=-3 * self.state_std, b=3 * self.state_std,
                              generator=generator)
        with torch.no_grad():
            self.eval_state.copy_(draw)

    def input_calls(self, t: int, call: Call) -> list[Step]:
        """:meth:`core_input`'s adapter, before the core pass at iteration t."""
        return [Step("topology", f"topology.input.{t}", self, dataclasses.replace(call, phase="input"))]

    def flop_cost(self, call: Call) -> Cost:
        """The adapter (2d·d MACs per position) at ``phase="input"``; drawing s_0 and handing
        the core's output on cost nothing."""
        return module_cost(self.adapter, call) if call.phase == "input" else Cost()
