"""Mixture-of-Recursions: a router gives each position its own recursion depth (Bae et al.
2025, "Mixture-of-Recursions: Learning Dynamic Recursive Depths for Adaptive Token-Level
Computation", arXiv 2507.10524, §2.2.1 "Routing strategies"; reference code
raymin0223/mixture_of_recursions, ``model/mor_model/expert_choice_router.py``).

The loop step t is the paper's recursion step r = t + 1 and the loop's shared core its
recursion block f(·; Φ'). The rule decides who takes step t from the state the step read
(:meth:`MoRHalting.fold`), so a position's decision sees only its own state: each
position's depth is a function of its prefix (strict causality), and the decoding cache's
catch-up (``LoopLM._catch_up``, cache.py) gives a position that left early its entries of
the later steps from its frozen state, exactly as the full forward computes them.

How the paper's pieces map onto looplm, and the ambiguities resolved:

* **The gated update** (Eq. 2, expert choice): H^{r+1} = g^r f(H^r) + H^r for the selected
  positions, H^r for the others. looplm's core is a residual block stack whose output the
  topology folds into the state (h' = topology(h, f_core(h))), so the gate scales the
  step's change of state: h ← h + g·(h' − h), which is Eq. 2 with f the recursion block's
  residual branch, and the plain step at g = 1. ``alpha`` scales g (the reference's α for
  a sigmoid router).
* **Expert choice, causally**: at step r the top-k positions by router score continue,
  k = max(1, ⌊β_r·T⌋) of the T positions (β_r ``capacity``; default the hierarchical
  (N − r)/N for 0-based r: every position takes the first step, one fewer N-th each next
  step), among those that took step r − 1. Top-k over the sequence makes a position's
  depth depend on the scores of later positions: not causal, and not what decoding can do.
  The paper's remedy (§2.2.1, "auxiliary loss"; the reference's ``sampling: aux_loss``) is
  a binary cross-entropy on the router's logits with the top-k membership as target, so
  that at inference σ(s) > 0.5 selects as top-k would: ``selection: threshold`` (default)
  selects by that threshold in training too (the BCE, weight ``aux_loss_weight``, still
  teaches the router the capacity), so training and inference run one causal rule.
  ``selection: top_k`` is the paper's training form (top-k in training, the threshold at
  inference); its training forward is not causal, which the config says
  (``MoRHaltingConfig.causal``) and the invariant tests state instead of assuming. The
  auxiliary-router alternative (a second router on detached states, trained by the same
  BCE) is not built: the auxiliary loss is the variant the paper carries forward.
* **Token choice**: one router on the state entering the loop gives softmax probabilities
  over depths 1..N; a position takes the argmax depth i (top-1) and runs steps 0..i−1; its
  chosen probability gates its last update (the paper's token-choice rule gates the
  output of the recursion the position ends at; earlier ones are plain), so the router
  learns from the LM loss. Balancing loss (weight ``balance_weight``): the Switch form
  N·Σ_i f_i P_i with f_i the share of real positions routed to depth i and P_i their mean
  probability of it, which is 1 when balanced.
* Expert-choice routers: one linear d -> 1 per step (the reference builds one router per
  recursion); token choice: one d -> N. The auxiliary losses are added in training
  (``module.training``), as in the reference; an evaluation forward reports the LM loss.
* A position that left the loop keeps its state; later steps' attention still sees its
  keys, computed from that frozen state (looplm's policy for every halting rule, which is
  what keeps decoding exact). The paper's recursion-wise KV caching (a step's attention
  restricted to the positions that take it) and recursive KV sharing (later steps reuse the
  first step's keys and values) are not built here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost, Step, module_cost
from looplm.halting.base import Halting, HaltState, ReadLogits, Readout
from looplm.streams.single import freeze
from looplm.topology.base import LoopState


class MoRHalting(Halting):
    """Per-position recursion depth by a learned router (module docstring: the paper's
    Eq. 2 and §2.2.1, and how each ambiguity is resolved). ``routing``: ``expert_choice``
    (a router per step, top-k or threshold selection) or ``token_choice`` (one router picks
    the depth up front)."""

    freezes = True

    def __init__(self, d_model: int, depths: int, routing: str, selection: str, capacity: tuple[float, ...],
                 alpha: float, aux_loss_weight: float, balance_weight: float, init_bias: float):
        super().__init__()
        self.depths, self.routing, self.selection, self.capacity = depths, routing, selection, capacity
        self.alpha, self.aux_loss_weight, self.balance_weight = alpha, aux_loss_weight, balance_weight
        self.init_bias = init_bias
        if routing == "expert_choice":
            self.routers = nn.ModuleList(nn.Linear(d_model, 1) for _ in range(depths))
        else:
            self.router = nn.Linear(d_model, depths)

    def extra_repr(self) -> str:
        return f"routing={self.routing}, selection={self.selection}, depths={self.depths}, capacity={self.capacity}"

    def begin(self, h: torch.Tensor, valid: torch.Tensor) -> HaltState:
        state = super().begin(h, valid)
        state.extra = {"aux_sum": h.new_zeros((), dtype=torch.float32), "aux_count": h.new_zeros((), dtype=torch.float32)}
        return state

    def fold(self, state: HaltState, old: LoopState, new: LoopState, t: int) -> LoopState:
        """Who takes step t (decided from ``old.h``, the state the step read) and the gated
        update h + g·(h' − h) for them; the others keep ``old``."""
        if self.routing == "expert_choice":
            chosen, gate = self._expert_choice(state, old.h, t)
        else:
            chosen, gate = self._token_choice(state, old.h, t)
        state.steps = state.steps + chosen.long()
        state.running = chosen
        state.halted = state.halted | ~chosen
        state.record.setdefault("mor_selected", []).append(chosen.detach())
        if gate is not None:  # Eq. 2 with the gate on the step's change: h + g·(h' − h), one lerp
            new = LoopState(h=torch.lerp(old.h, new.h, gate.to(old.h.dtype).unsqueeze(-1)), carrier=new.carrier,
                            record=new.record)
        return freeze(old, new, chosen)

    def _expert_choice(self, state: HaltState, h: torch.Tensor, t: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Step t's router s = wᵀh + b; selection by σ(s) > 0.5 (the causal rule the
        auxiliary BCE trains for) or, in training under ``top_k``, the top-k of the positions
        still running; gate g = α·σ(s)."""
        eligible = state.running
        if t >= self.depths:  # depth beyond the trained recursions: nobody continues
            return torch.zeros_like(eligible), None
        score = self.routers[t](h).squeeze(-1).float()  # [B, T]
        top_k = self.training and (self.selection == "top_k" or self.aux_loss_weight > 0)
        if top_k:
            with torch.no_grad():
                k = max(1, int(self.capacity[t] * score.shape[1]))
                masked = score.masked_fill(~eligible, float("-inf"))
                index = masked.topk(min(k, score.shape[1]), dim=1).indices
                in_top_k = torch.zeros_like(eligible).scatter(1, index, True) & eligible
            if self.aux_loss_weight > 0:  # §2.2.1 auxiliary loss: BCE(s, 1[top-k])
                bce = F.binary_cross_entropy_with_logits(score, in_top_k.float(), reduction="none")
                state.extra["aux_sum"] = state.extra["aux_sum"] + (bce * eligible).sum()
                state.extra["aux_count"] = state.extra["aux_count"] + eligible.sum()
        if self.training and self.selection == "top_k":
            chosen = in_top_k
        else:
            chosen = eligible & (score > 0.0)  # σ(s) > 0.5
        return chosen, self.alpha * torch.sigmoid(score)

    def _token_choice(self, state: HaltState, h: torch.Tensor, t: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """At step 0 the router picks each position's depth i = argmax softmax(W h + b) + 1
        (and, in training, the balancing loss); a position takes steps t < i, its last one
        gated by α·p_i."""
        if t == 0:
            probs = torch.softmax(self.router(h).float(), dim=-1)  # [B, T, N]
            depth = probs.argmax(dim=-1)  # 0-based index of the chosen depth: its last step
            state.extra["depth"] = depth
            state.extra["gate"] = self.alpha * probs.gather(-1, depth.unsqueeze(-1)).squeeze(-1)
            if self.training and self.balance_weight > 0:
                valid = state.valid.unsqueeze(-1).float()
                count = valid.sum().clamp_min(1.0)
                routed = depth.unsqueeze(-1) == torch.arange(self.depths, device=depth.device)  # no host sync
                share = (routed.float() * valid).sum(dim=(0, 1)) / count  # f_i
                mean_prob = (probs * valid).sum(dim=(0, 1)) / count  # P_i
                state.losses["mor_balance"] = self.balance_weight * self.depths * (share * mean_prob).sum()
        depth = state.extra["depth"]
        chosen = state.running & (depth >= t)
        ones = torch.ones_like(state.extra["gate"])
        return chosen, torch.where(depth == t, state.extra["gate"], ones)

    def observe(self, state: HaltState, y: torch.Tensor, t: int, last: bool, read_logits: ReadLogits,
                targets: Optional[torch.Tensor]) -> None:
        """Frozen positions carry their last state in y: the readout is y."""
        state.readout = y

    def finish(self, state: HaltState) -> torch.Tensor:
        if self.routing == "expert_choice" and self.training and self.aux_loss_weight > 0:
            state.losses["mor_router"] = self.aux_loss_weight * state.extra["aux_sum"] / state.extra["aux_count"].clamp_min(1.0)
        return state.readout

    def reset_parameters(self, init_std: float) -> None:
        """Weights N(0, init_std); biases start every position at full depth: each expert-choice
        router at ``init_bias`` (σ > 0.5: selected), the token-choice router's deepest depth
        at ``init_bias`` and the others at 0 (the untrained loop runs every step)."""
        routers = self.routers if self.routing == "expert_choice" else [self.router]
        for router in routers:
            nn.init.normal_(router.weight, std=init_std)
            nn.init.zeros_(router.bias)
        if self.routing == "expert_choice":
            for router in self.routers:
                nn.init.constant_(router.bias, self.init_bias)
        else:
            with torch.no_grad():
                self.router.bias[-1] = self.init_bias

    def step_calls(self, t: int, call: Call, readout: Readout, targets: bool) -> list[Step]:
        """Expert choice: step t's router (t < depths); token choice: the router at step 0."""
        runs = t < self.depths if self.routing == "expert_choice" else t == 0
        return [Step("halting", f"halting.{t}", self, call)] if runs else []

    def flop_cost(self, call: Call) -> Cost:
        """Expert choice, one step: the router d -> 1 with its bias and the gated update
        h + g·(h' − h) (a subtract, multiply and add per element). Token choice, listed once
        at step 0: the router d -> N and the gated update of every one of the N steps. The
        batched forward runs every position through every step (positions that left are
        frozen, not skipped): realised compute is ``ModelOutput.block_passes``."""
        if self.routing == "expert_choice":
            router, updates = self.routers[0], 1
        else:
            router, updates = self.router, self.depths
        return module_cost(router, call) + Cost(state=3 * call.rows * router.in_features * updates)
