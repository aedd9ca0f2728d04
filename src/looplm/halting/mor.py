"""Mixture-of-Recursions: a router gives each position its own recursion depth (Bae et al.
2025, "Mixture-of-Recursions: Learning Dynamic Recursive Depths for Adaptive Token-Level
Computation", arXiv 2507.10524, §2.2.1 "Routing strategies"; reference code
raymin0223/mixture_of_recursions, ``model/mor_model/expert_choice_router.py``).

The loop step t is the paper's recursion step r = t + 1 and the loop's shared core its
recursion block f(·; Φ'). Every position takes step 0 (every token gets a first recursion);
after step t the rule decides from y = h^(t+1), the state step t + 1 will read, who takes
it (:meth:`MoRHalting.observe`) and gates their update (:meth:`MoRHalting.fold`). A
position's decision sees only its own state, so its depth is a function of its prefix
(strict causality), and the decoding cache's catch-up (``LoopLM._catch_up``, cache.py)
gives a position that left early its entries of the later steps from its frozen state,
exactly as the full forward computes them.

How the paper's pieces map onto looplm, and the ambiguities resolved:

* **The gated update** (Eq. 2, expert choice): H^{r+1} = g^r f(H^r) + H^r for the selected
  positions, H^r for the others. looplm's core is a residual block stack whose output the
  topology folds into the state (h' = topology(h, f_core(h))), so the gate scales the
  step's change of state: h ← h + g·(h' − h), which is Eq. 2 with f the recursion block's
  residual branch, and the plain step at g = 1. ``alpha`` scales g (the reference's α for
  a sigmoid router). The first step is not routed, so it is not gated.
* **Expert choice, causally**: at step r >= 1 the top-k positions by router score continue,
  k = max(1, ⌊β_r·T⌋) of the T positions (β_r ``capacity``; default the hierarchical
  (N − r)/N: one fewer N-th each step), among those that took step r − 1. Top-k over the
  sequence makes a position's depth depend on the scores of later positions: not causal,
  and not what decoding can do. The paper's remedy (§2.2.1, "auxiliary loss"; the
  reference's ``sampling: aux_loss``) is a binary cross-entropy on the router's logits with
  the top-k membership as target, so that at inference σ(s) > 0.5 selects as top-k would:
  ``selection: threshold`` (default) selects by that threshold in training too (the BCE,
  weight ``aux_loss_weight``, still teaches the router the capacity), so training and
  inference run one causal rule. ``selection: top_k`` is the paper's training form (top-k
  in training, the threshold at inference); its training forward is not causal, which the
  config says (``MoRHaltingConfig.causal``) and tests/halting/test_mor.py shows.
  ``auxiliary: router`` is the paper's other remedy (the reference's ``sampling:
  aux_router``): a second, per-step linear router on the detached state learns the same BCE
  target and makes the threshold choice (in training under ``threshold``, at inference
  always); the main router then only gates and ranks the top-k target.
* **Token choice**: one router, on the state after the first step, gives softmax
  probabilities over depths 1..N; a position takes the argmax depth i + 1 (top-1) and runs
  steps 0..i; its chosen probability gates its last update (the paper's token-choice rule
  gates the output of the recursion the position ends at; earlier ones are plain; depth 1
  has no routed step to gate), so the router learns from the LM loss. Balancing loss
  (weight ``balance_weight``): the Switch form N·Σ_i f_i P_i with f_i the share of real
  positions routed to depth i and P_i their mean probability of it, 1 when balanced.
* Expert-choice routers: one linear d -> 1 per routed step (the reference builds one router
  per recursion); token choice: one d -> N. The auxiliary losses are added in training
  (``module.training``), as in the reference; an evaluation forward reports the LM loss.
* **KV** (``kv``): ``all`` keeps looplm's policy for every halting rule: a position that
  left keeps its state, and later steps' attention still sees its keys, computed from that
  frozen state. ``recursion`` is the paper's recursion-wise KV caching: step t's attention
  sees only the positions taking step t (:meth:`MoRHalting.step_context` narrows the
  context's key validity; a query always sees itself, as for padding). Decoding keeps each
  position's depth, so a cached position's keys are hidden from the steps it did not take:
  a growing cache with its frozen loop state (the ``mor_depth`` carrier entry), a
  full-loop or static cache (every step run for every position) in ``LoopCache.depth``,
  written after each forward (``Halting.keeps_depth``); the cache still holds entries for
  the steps a position skipped, unread. Softmax-attention mixers only (a recurrent mixer
  cannot drop a position from its state). ``shared`` is the paper's recursive KV sharing
  (§2.2.2 "KV caching strategies", below).
* **Recursive KV sharing** (``kv: shared``, §2.2.2): every token takes the first recursion,
  so the keys and values its attention computes there exist for all tokens; later
  recursions reuse them instead of projecting their own. Resolved as the reference does
  (``RecursiveDynamicCache`` writes the first recursion's entry of each block position and
  returns it, unchanged, to the same position of every later recursion): step t >= 1 of
  core block j projects queries only and attends over step 0's keys and values of block j,
  every position's (causally; padding still masked), not only those of the positions
  taking step t, whatever the routing (expert or token choice); positions that left keep
  their frozen state as under ``all``. The seam is the mixer context
  (:class:`~looplm.mixers.base.FirstStepKV`, set by :meth:`MoRHalting.step_context`): step
  0's attention keeps how its queries attend over its keys and values, the later steps'
  attention reads it (``SoftmaxAttention._forward_reusing_kv``). A decoding cache holds
  core entries of step 0 alone (no catch-up: the later steps keep none), growing,
  full-loop and static alike. The FLOP rule charges later steps' queries only
  (:meth:`MoRHalting.reuses_first_step_kv`). Softmax attention only, one shared core
  stack, one core pass per step, no per-step mixer schedule and no per-step adapter on
  ``qkv`` (``ModelConfig`` refuses the rest: a later step reads block j's first-step keys,
  so block j must be the same attention at every step).
* **Skipping** (``skip``, the paper's compute saving: "tokens that exit early skip the
  remaining recursions", §2.2.1 and the reference's selected-tokens forward): under ``kv:
  recursion`` or ``shared``, a forward without a decoding cache (under ``shared`` also the
  prefill of an empty growing cache, whose later steps keep no entries) runs each later
  step on the positions taking it, gathered into [B, K] rows (K the most any batch row keeps; a
  :class:`~looplm.mixers.base.GatheredRows` on the step's context, made by
  :meth:`MoRHalting.step_context`), and scatters them back; attention masks by the gathered
  positions (over each other under ``recursion``, over the first step's keys under
  ``shared``), so the running positions compute exactly what the frozen path gives them.
  Under ``kv: all`` a later step reads every position's keys, so every position runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost, Step, module_cost
from looplm.halting.base import Halting, HaltState, ReadLogits, Readout
from looplm.mixers.base import FirstStepKV, GatheredRows, MixerContext
from looplm.streams.single import freeze
from looplm.topology.base import LoopState

#: the carrier key of a position's depth so far (``kv: recursion``), kept with its frozen state
DEPTH = "mor_depth"
#: the halting state's entry of the first step's keys and values (``kv: shared``)
FIRST_STEP_KV = "first_step_kv"


class StepRouter(nn.Module):
    """One expert-choice recursion step's routing: ``score`` (d -> 1), the router whose
    σ gates the update and whose top-k is the BCE target, and with ``auxiliary: router`` a
    ``chooser`` (d -> 1) on the detached state that makes the threshold choice (§2.2.1's
    auxiliary router). Returns (score logits, choosing logits) [B, T]."""

    def __init__(self, d_model: int, auxiliary: bool):
        super().__init__()
        self.score = nn.Linear(d_model, 1)
        self.chooser = nn.Linear(d_model, 1) if auxiliary else None

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        score = self.score(h).squeeze(-1).float()
        if self.chooser is None:
            return score, score
        return score, self.chooser(h.detach()).squeeze(-1).float()

    def flop_cost(self, call: Call) -> Cost:
        """The score router (d -> 1 with a bias); the auxiliary router is a plan step of its
        own (:meth:`MoRHalting.step_calls`): its backward stops at its weights."""
        return module_cost(self.score, call)


class MoRHalting(Halting):
    """Per-position recursion depth by a learned router (module docstring: the paper's
    Eq. 2 and §2.2.1, and how each ambiguity is resolved). ``routing``: ``expert_choice``
    (a router per step after the first, top-k or threshold selection) or ``token_choice``
    (one router picks the depth after the first step). ``kv``: ``all`` (a step's attention
    sees every position, those that left through their frozen states), ``recursion`` (only
    the positions taking the step: the paper's recursion-wise KV caching) or ``shared``
    (every later step attends over the first step's keys and values: recursive KV sharing)."""

    freezes = True

    def __init__(self, d_model: int, depths: int, routing: str, selection: str, capacity: tuple[float, ...],
                 alpha: float, aux_loss_weight: float, balance_weight: float, init_bias: float, kv: str = "all",
                 auxiliary: str = "loss", skip: bool = True):
        super().__init__()
        self.depths, self.routing, self.selection, self.capacity = depths, routing, selection, capacity
        self.alpha, self.aux_loss_weight, self.balance_weight = alpha, aux_loss_weight, balance_weight
        self.init_bias, self.kv, self.auxiliary = init_bias, kv, auxiliary
        self.skip = skip and kv != "all"  # under all, later steps read every position's keys
        self.catches_up = kv != "shared"  # shared: later steps keep no cache entries to catch up
        self.keeps_depth = kv == "recursion"  # a full-loop cache hides keys by each position's depth
        if routing == "expert_choice":  # routers[r - 1] decides step r = 1..N-1
            self.routers = nn.ModuleList(StepRouter(d_model, auxiliary == "router") for _ in range(depths - 1))
        else:
            self.router = nn.Linear(d_model, depths)

    def extra_repr(self) -> str:
        return (f"routing={self.routing}, selection={self.selection}, depths={self.depths}, "
                f"capacity={self.capacity}, kv={self.kv}")

    def begin(self, h: torch.Tensor, valid: torch.Tensor) -> HaltState:
        """Every real position takes step 0 (depth >= 1, as every token gets a first recursion)."""
        state = super().begin(h, valid)
        state.extra = {"aux_sum": h.new_zeros((), dtype=torch.float32), "aux_count": h.new_zeros((), dtype=torch.float32)}
        return state

    def step_context(self, state: HaltState, ctx: MixerContext, cache, t: int) -> MixerContext:
        """Under ``kv: recursion``, step t's keys are the positions taking it: new positions
        still running, cached ones whose depth (kept with their frozen loop state, or in a
        full-loop or static cache's ``depth``) exceeds t.
        Under ``kv: shared``, step 0's attention keeps its keys and values and the later
        steps' read them (:class:`~looplm.mixers.base.FirstStepKV`)."""
        if self.kv == "all":
            return ctx
        if self.kv == "shared":
            if t == 0:
                state.extra[FIRST_STEP_KV] = FirstStepKV()
            first = state.extra[FIRST_STEP_KV]
            ctx = dataclasses.replace(ctx, first_step_kv=first if t == 0 else first.later())
            return self._skipping(state, ctx, cache, t) or ctx
        if t == 0:
            return ctx
        skipping = self._skipping(state, ctx, cache, t)
        if skipping is not None:
            return skipping
        keep = state.running
        if ctx.slots is not None:  # a static cache's rows: cached depths, the new positions at their rows
            keep = (cache.depth > t).index_copy(1, ctx.slots, keep)
        elif ctx.past:  # a growing cache: its positions' depths, kept by full-loop caches or frozen states
            depth = cache.depth if cache.full_loop else cache.frozen.carrier[DEPTH]
            keep = torch.cat([depth > t, keep], dim=1)
        return dataclasses.replace(ctx, valid=ctx.valid & keep, padded=True, _masks={})

    def _skipping(self, state: HaltState, ctx: MixerContext, cache, t: int) -> Optional[MixerContext]:
        """Step t's context on the gathered positions taking it (``skip``, §2.2.1: a token
        that left takes no later recursion), or None where every position runs it: with a
        decoding cache, except the prefill of an empty growing one under ``kv: shared``
        (later steps keep no entries there; under ``recursion`` the cache keeps every
        position's, and a decoding step has one position per row, nothing to save), when
        probes record attention maps (they want every position's), under torch.compile (K,
        the gathered length, is read back to the host: the frozen path keeps the step's
        shapes static and the graph whole), or when every position takes the step. Exact:
        the positions taking the step see the same keys as on the frozen path (their own, or
        the first step's under ``shared``)."""
        if not self.skip or t == 0 or ctx.attentions is not None or torch.compiler.is_compiling():
            return None
        if cache is not None and (self.kv != "shared" or cache.full_loop or ctx.slots is not None or ctx.past):
            return None
        rows = GatheredRows.of(state.running)
        if rows.index.shape[1] in (0, state.running.shape[1]):
            return None
        rope = tuple(rows.gather(table.expand(rows.index.shape[0], -1, -1)) for table in ctx.rope)
        return dataclasses.replace(ctx, rope=rope, valid=rows.valid, past=0, padded=True, gathered=rows, _masks={})

    def reuses_first_step_kv(self, t: int) -> bool:
        """Under ``kv: shared`` every step after the first reads step 0's keys and values."""
        return self.kv == "shared" and t > 0

    def fold(self, state: HaltState, old: LoopState, new: LoopState, t: int) -> LoopState:
        """The positions that take step t (decided after step t − 1) get the gated update
        h + g·(h' − h); the others keep ``old``. The depth reached so far rides in the
        carrier, so a decoding cache keeps it with each position's frozen state."""
        running, gate = state.running, self._gate(state, t)
        state.record.setdefault("mor_selected", []).append(running.detach())
        if gate is not None:  # Eq. 2 with the gate on the step's change: h + g·(h' − h), one lerp
            new = LoopState(h=torch.lerp(old.h, new.h, gate.to(old.h.dtype).unsqueeze(-1)), carrier=new.carrier,
                            record=new.record)
        folded = freeze(old, new, running)
        if self.kv == "recursion":
            folded.carrier[DEPTH] = state.steps + running.long()
        return folded

    def _gate(self, state: HaltState, t: int) -> Optional[torch.Tensor]:
        """g for step t: expert choice α·σ(s) of step t's router; token choice α·p_i at the
        position's last step i, 1 before it; none at step 0."""
        if t == 0 or "gate" not in state.extra:
            return None
        if self.routing == "expert_choice":
            return state.extra["gate"]
        return torch.where(state.extra["depth"] == t, state.extra["gate"], torch.ones_like(state.extra["gate"]))

    def observe(self, state: HaltState, y: torch.Tensor, t: int, last: bool, read_logits: ReadLogits,
                targets: Optional[torch.Tensor]) -> None:
        """Count step t for the positions that took it, then decide who takes step t + 1 from
        y, the state it will read (frozen positions carry their last state in y: the readout)."""
        state.steps = state.steps + state.running.long()
        state.readout = y
        if last:
            return
        if self.routing == "expert_choice":
            chosen = self._expert_choice(state, y, t + 1)
        else:
            chosen = self._token_choice(state, y, t + 1)
        state.running = chosen
        state.halted = state.halted | ~chosen

    def _expert_choice(self, state: HaltState, h: torch.Tensor, r: int) -> torch.Tensor:
        """Step r's router s = wᵀh + b; selection by σ(s) > 0.5 (the causal rule the
        auxiliary BCE trains for) or, in training under ``top_k``, the top-k of the positions
        still running; gate g = α·σ(s)."""
        eligible = state.running
        if r >= self.depths:  # depth beyond the trained recursions: nobody continues
            state.extra.pop("gate", None)
            return torch.zeros_like(eligible)
        score, chooser = self.routers[r - 1](h)  # [B, T]: the router's, and the logits that choose by threshold
        state.extra["gate"] = self.alpha * torch.sigmoid(score)
        if self.training and (self.selection == "top_k" or self.aux_loss_weight > 0):
            with torch.no_grad():
                k = max(1, int(self.capacity[r] * score.shape[1]))
                index = score.masked_fill(~eligible, float("-inf")).topk(k, dim=1).indices
                in_top_k = torch.zeros_like(eligible).scatter(1, index, True) & eligible
            if self.aux_loss_weight > 0:  # §2.2.1: BCE(chooser, 1[top-k of the router's scores])
                bce = F.binary_cross_entropy_with_logits(chooser, in_top_k.float(), reduction="none")
                state.extra["aux_sum"] = state.extra["aux_sum"] + (bce * eligible).sum()
                state.extra["aux_count"] = state.extra["aux_count"] + eligible.sum()
            if self.selection == "top_k":
                return in_top_k
        return eligible & (chooser > 0.0)  # σ > 0.5

    def _token_choice(self, state: HaltState, h: torch.Tensor, r: int) -> torch.Tensor:
        """After step 0 the router picks each position's last step i = argmax softmax(W h + b)
        (depth i + 1; in training, the balancing loss); a position takes steps r <= i."""
        if r == 1:
            probs = torch.softmax(self.router(h).float(), dim=-1)  # [B, T, N]
            depth = probs.argmax(dim=-1)  # 0-based: the position's last step
            state.extra["depth"] = depth
            state.extra["gate"] = self.alpha * probs.gather(-1, depth.unsqueeze(-1)).squeeze(-1)
            if self.training and self.balance_weight > 0:
                valid = state.valid.unsqueeze(-1).float()
                count = valid.sum().clamp_min(1.0)
                routed = depth.unsqueeze(-1) == torch.arange(self.depths, device=depth.device)  # no host sync
                share = (routed.float() * valid).sum(dim=(0, 1)) / count  # f_i
                mean_prob = (probs * valid).sum(dim=(0, 1)) / count  # P_i
                state.losses["mor_balance"] = self.balance_weight * self.depths * (share * mean_prob).sum()
        return state.running & (state.extra["depth"] >= r)

    def finish(self, state: HaltState) -> torch.Tensor:
        if self.routing == "expert_choice" and self.training and self.aux_loss_weight > 0:
            state.losses["mor_router"] = self.aux_loss_weight * state.extra["aux_sum"] / state.extra["aux_count"].clamp_min(1.0)
        return state.readout

    def reset_parameters(self, init_std: float) -> None:
        """Weights N(0, init_std); biases start every position at full depth: each expert-choice
        router (and auxiliary router) at ``init_bias`` (σ > 0.5: selected), the token-choice
        router's deepest depth at ``init_bias`` and the others at 0 (the untrained loop runs
        every step)."""
        routers = [self.router] if self.routing == "token_choice" else [
            linear for step in self.routers for linear in (step.score, step.chooser) if linear is not None]
        for router in routers:
            nn.init.normal_(router.weight, std=init_std)
            nn.init.zeros_(router.bias)
        with torch.no_grad():
            for router in routers:
                router.bias[-1] = self.init_bias

    def step_calls(self, t: int, call: Call, readout: Readout, targets: bool) -> list[Step]:
        """After step t: expert choice, the router of step t + 1 (t + 1 < depths, with its
        auxiliary router, which reads the detached state: a weight gradient only); token
        choice, the router after step 0. Listed under step t, where ``observe`` calls it."""
        runs = (t + 1 < self.depths) if self.routing == "expert_choice" else t == 0
        if not runs:
            return []
        steps = [Step("halting", f"halting.{t}", self, call)]
        if self.routing == "expert_choice" and self.routers[t].chooser is not None:
            steps.append(Step("halting", f"halting.aux.{t}", self.routers[t].chooser, call, input_grad=False))
        return steps

    def flop_cost(self, call: Call) -> Cost:
        """Expert choice, one step: the router d -> 1 with its bias (the auxiliary router is a
        step of its own), and the gated update
        h + g·(h' − h) of the step it decides (a subtract, multiply and add per element).
        Token choice, listed once after step 0: the router d -> N and the gated updates of the
        N − 1 steps after it. The batched forward runs every position through every step
        (positions that left are frozen, not skipped): realised compute is
        ``ModelOutput.block_passes``."""
        if self.routing == "expert_choice":
            router, width, updates = self.routers[0], self.routers[0].score.in_features, 1
        else:
            router, width, updates = self.router, self.router.in_features, self.depths - 1
        return module_cost(router, call) + Cost(state=3 * call.rows * width * updates)
