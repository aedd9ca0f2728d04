"""The growth operator O of SGT §4.2 and Algorithm 1, as plain Python over entropies.

Layers are indices over the model's distinct blocks in depth order (0 = shallowest). The
schedule sees one vector of head entropies per layer and optimiser step
(:meth:`GrowthSchedule.observe`), keeps their exponential moving average, and at the
decision steps t ≥ t_start, (t − t_start) mod Δt = 0 updates the architectural state
Θ_t = {𝓛_t, l*_t, {K_l}} (Eq. 8). Its whole state is JSON-like (:meth:`state_dict`).

Algorithm 1 line 20 reads ``|C| < L``; C always holds L layers, so looplm reads it as the
text of §4.2 does: a layer is activated only while *fewer than L layers are active*.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from looplm.head_loop.config import HeadLoopConfig


class GrowthSchedule:
    """Θ_t for one run. ``eligible``: the layers that may grow (softmax blocks not
    excluded); ``n_heads``: heads per layer."""

    def __init__(self, cfg: HeadLoopConfig, n_heads: int, eligible: Sequence[int]):
        self.cfg, self.n_heads, self.eligible = cfg, n_heads, sorted(eligible)
        self.ema: dict[int, list[float]] = {}  # layer -> EMA of the head entropies E^(l,i)
        self.active: list[int] = []  # 𝓛, in activation order
        self.depth: dict[int, int] = {}  # K_l
        self.heads: dict[int, list[int]] = {}  # S_l
        self.activated_at: dict[int, int] = {}
        self.growing: Optional[int] = None  # l*
        self.frozen = False
        self.history: list[dict] = []  # every decision, as logged

    # ---------------------------------------------------------------- entropy
    def observe(self, entropies: dict[int, Sequence[float]]) -> None:
        """One optimiser step's mean head entropies per layer (layers not measured: absent)."""
        decay = self.cfg.ema_decay
        for layer, values in entropies.items():
            old = self.ema.get(layer)
            self.ema[layer] = (
                [float(v) for v in values] if old is None
                else [decay * o + (1.0 - decay) * float(v) for o, v in zip(old, values)]
            )

    def layer_entropy(self, layer: int) -> float:
        """Ē^(l) of Eq. (5) on the EMA: the mean over the layer's heads."""
        values = self.ema.get(layer)
        return math.nan if values is None else sum(values) / len(values)

    def candidates(self) -> list[int]:
        """C = argtop_L of Ē^(l) over the eligible layers (Eq. 10); ties to the deeper layer."""
        measured = [l for l in self.eligible if l in self.ema]
        return sorted(measured, key=lambda l: (-self.layer_entropy(l), -l))[: self.cfg.layers]

    def select_heads(self, layer: int) -> list[int]:
        """S_l = argtop_h of E^(l,i) (Eq. 7), or the lowest h (``select: low``), or all."""
        h = self.cfg.heads
        if h is None:
            return list(range(self.n_heads))
        values = self.ema[layer]
        sign = -1.0 if self.cfg.select == "high" else 1.0
        return sorted(sorted(range(self.n_heads), key=lambda i: (sign * values[i], i))[:h])

    # ---------------------------------------------------------------- decisions
    def is_decision_step(self, step: int) -> bool:
        return step >= self.cfg.start and (step - self.cfg.start) % self.cfg.interval == 0

    def reads_entropies_at(self, step: int) -> bool:
        """Whether :meth:`advance` at ``step`` reads the EMA (a decision while not frozen);
        fade-out completions do not."""
        return not self.frozen and self.is_decision_step(step)

    def advance(self, step: int) -> list[dict]:
        """Apply step ``step``'s decision (if it is one) and report what happened: a list of
        events {action, layer, heads, depth, ...}; fade-out completions are events too."""
        events = [self._dropped(layer, step) for layer in self.active if self._fade_ends_at(layer) == step]
        if self.frozen or not self.is_decision_step(step):
            return [e for e in events if e is not None]
        pool = self.candidates()
        if self.cfg.kind == "block":  # Block Loop: the top-L layers at once, at K_max (App. D.1)
            for layer in sorted(pool, reverse=True):
                events.append(self._activate(layer, step, pool, self.cfg.max_depth))
            self.frozen = True
        elif self.growing is not None and self.growing in pool and self.depth[self.growing] < self.cfg.max_depth:
            self.depth[self.growing] += 1  # Alg. 1 line 19
            events.append(self._event("deepen", self.growing, step, pool))
        elif len(self.active) < self.cfg.layers:  # Alg. 1 line 20, read as |𝓛| < L
            layer = self._next_layer(pool)
            if layer is not None:
                events.append(self._activate(layer, step, pool, 1))
            else:
                events.append(self._event("hold", self.growing, step, pool))
        else:
            events.append(self._event("hold", self.growing, step, pool))
        if not self.frozen and self._complete():
            self.frozen = True
            events.append(self._event("freeze", self.growing, step, pool))
        events = [e for e in events if e is not None]
        self.history.extend(e for e in events if e["action"] != "drop")
        return events

    def _next_layer(self, pool: list[int]) -> Optional[int]:
        """Eq. (11): max{l ∈ C \\ 𝓛, l < min 𝓛}; shallow-to-deep: min{l ∈ C \\ 𝓛, l > max 𝓛}."""
        fresh = [l for l in pool if l not in self.active]
        if self.cfg.direction == "deep_to_shallow":
            bound = min(self.active, default=math.inf)
            options = [l for l in fresh if l < bound]
            return max(options, default=None)
        bound = max(self.active, default=-math.inf)
        options = [l for l in fresh if l > bound]
        return min(options, default=None)

    def _complete(self) -> bool:
        """The target configuration is reached: L active layers and l* at K_max, or l* at
        K_max with no eligible layer left beyond the growth front."""
        if self.growing is None or self.depth[self.growing] < self.cfg.max_depth:
            return False
        if len(self.active) >= self.cfg.layers:
            return True
        if self.cfg.direction == "deep_to_shallow":
            return not any(l < min(self.active) for l in self.eligible)
        return not any(l > max(self.active) for l in self.eligible)

    def _activate(self, layer: int, step: int, pool: list[int], depth: int) -> dict:
        self.active.append(layer)
        self.growing = layer  # Alg. 1 lines 21-24
        self.depth[layer] = depth
        self.heads[layer] = self.select_heads(layer) if self.cfg.kind == "heads" else list(range(self.n_heads))
        self.activated_at[layer] = step
        return self._event("activate", layer, step, pool)

    def _event(self, action: str, layer: Optional[int], step: int, pool: list[int]) -> dict:
        return {
            "action": action,
            "layer": layer,
            "heads": None if layer is None or layer not in self.heads else list(self.heads[layer]),
            "depth": None if layer is None else self.depth.get(layer, 0),
            "layer_entropy": None if layer is None else self.layer_entropy(layer),
            "head_entropies": None if layer is None or layer not in self.ema else list(self.ema[layer]),
            "candidates": list(pool),
            "candidate_entropies": [self.layer_entropy(l) for l in pool],
            "active": list(self.active),
            "step": step,
        }

    # ---------------------------------------------------------------- fade-out and structure
    def _fade_ends_at(self, layer: int) -> Optional[int]:
        if self.cfg.kind != "heads" or len(self.heads[layer]) == self.n_heads:
            return None
        return self.activated_at[layer] + self.cfg.fade_steps

    def _dropped(self, layer: int, step: int) -> Optional[dict]:
        if self.cfg.fade_steps == 0:
            return None  # dropped at activation: nothing faded
        return {"action": "drop", "layer": layer, "heads": list(self.heads[layer]), "depth": self.depth[layer],
                "step": step}

    def weights(self, layer: int, step: int) -> list[float]:
        """w_i of every head of an active layer after step ``step``: 1 for S_l; for the other
        heads 1 − (step − t_activate) / fade, down to 0 (dropped, no longer computed)."""
        kept = set(self.heads[layer])
        fade = self.cfg.fade_steps
        rest = 0.0 if fade == 0 else max(0.0, 1.0 - (step - self.activated_at[layer]) / fade)
        return [1.0 if i in kept else rest for i in range(self.n_heads)]

    def structure(self, step: int) -> dict[int, tuple[int, list[float]]]:
        """{layer: (K_l, head weights)} for the forwards after step ``step``."""
        return {layer: (self.depth[layer], self.weights(layer, step)) for layer in self.active}

    @property
    def measuring(self) -> bool:
        """Whether entropies still matter (not frozen)."""
        return not self.frozen

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        return {
            "ema": [[l, list(v)] for l, v in sorted(self.ema.items())],
            "active": list(self.active),
            "depth": [[l, k] for l, k in self.depth.items()],
            "heads": [[l, list(s)] for l, s in self.heads.items()],
            "activated_at": [[l, t] for l, t in self.activated_at.items()],
            "growing": self.growing,
            "frozen": self.frozen,
            "history": list(self.history),
        }

    def load_state_dict(self, state: dict) -> None:
        self.ema = {int(l): [float(x) for x in v] for l, v in state["ema"]}
        self.active = [int(l) for l in state["active"]]
        self.depth = {int(l): int(k) for l, k in state["depth"]}
        self.heads = {int(l): [int(i) for i in s] for l, s in state["heads"]}
        self.activated_at = {int(l): int(t) for l, t in state["activated_at"]}
        self.growing = None if state["growing"] is None else int(state["growing"])
        self.frozen = bool(state["frozen"])
        self.history = list(state["history"])
