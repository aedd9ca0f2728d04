"""The trainer side of SGT: measure, average, decide, apply (Algorithm 1's outer loop).

After every optimiser step t the trainer calls :meth:`Growth.after_step`: the step's mean
last-query entropies (all micro-batches, all data-parallel ranks, so every rank decides
alike) update the EMA, kept on the device in float64 (the same arithmetic as the
schedule's host EMA, without a host read per step); at a decision step the EMA is read
back once and the growth operator updates Θ_t; the grown
structure for the next forwards (loop depths, fading head weights) is written into the
blocks. When a layer is activated its heads are arranged so that the selected ones lie in
consecutive slots (:meth:`HeadLoopBlock.arrange_heads`, a re-parameterisation that moves
the optimiser's state with the weights), so its extra passes read narrow weight views.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from looplm.head_loop.entropy import EntropyMeter
from looplm.head_loop.schedule import GrowthSchedule
from looplm.head_loop.block import HeadLoopBlock, grown_blocks


class Growth:
    """Growth of ``model`` (a LoopLM with ``model.head_loop`` set)."""

    def __init__(self, model: nn.Module, device: torch.device):
        cfg = model.cfg.head_loop
        self.grown = grown_blocks(model)  # {layer: block}, layers indexing model.blocks()
        self.names = model.cfg.structure.block_labels  # growth events name blocks as the grown structure does
        eligible = [l for l in self.grown if l not in cfg.exclude]
        self.schedule = GrowthSchedule(cfg, model.cfg.n_heads, eligible)
        self.meter: Optional[EntropyMeter] = EntropyMeter(model.blocks(), eligible, model.cfg.n_heads, device)
        # the EMA of the measured layers (rows of meter.layers) on the device; seen: rows with a value
        self.ema = torch.zeros(len(eligible), model.cfg.n_heads, dtype=torch.float64, device=device)
        self.seen = torch.zeros(len(eligible), dtype=torch.bool, device=device)
        self.optimizer: Optional[torch.optim.Optimizer] = None  # its state follows arranged heads (set by the trainer)

    def after_step(self, step: int, distributed: bool = False) -> list[dict]:
        """Account step ``step`` (already completed) and return its growth events, each with
        the block's name, ready for metrics.jsonl."""
        events: list[dict] = []
        if self.meter is not None:
            self._observe(distributed)
            if self.schedule.reads_entropies_at(step):
                self._sync()
            events = self.schedule.advance(step)
            if self.schedule.frozen:
                self.meter.detach()
                self.meter = None
        else:
            events = self.schedule.advance(step)  # fade-outs still finish
        self.apply(step)
        for event in events:
            event["block"] = None if event.get("layer") is None else self.names[event["layer"]]
        return events

    def _observe(self, distributed: bool) -> None:
        """GrowthSchedule.observe's EMA update, on the device: E ← decay·E + (1 − decay)·e
        for layers measured before, E ← e for a layer's first measurement."""
        means, measured = self.meter.step_means(distributed)
        decay = self.schedule.cfg.ema_decay
        blended = torch.where(self.seen[:, None], decay * self.ema + (1.0 - decay) * means, means)
        self.ema = torch.where(measured[:, None], blended, self.ema)
        self.seen = self.seen | measured

    def _sync(self) -> None:
        """The device EMA into the schedule (one host read)."""
        rows, seen = self.ema.tolist(), self.seen.tolist()
        self.schedule.ema = {layer: row for layer, row, s in zip(self.meter.layers, rows, seen) if s}

    def _load_ema(self) -> None:
        """The schedule's EMA (restored from a checkpoint) onto the device."""
        for row, layer in enumerate(self.meter.layers):
            values = self.schedule.ema.get(layer)
            self.seen[row] = values is not None
            if values is not None:
                self.ema[row] = torch.tensor(values, dtype=torch.float64)

    def apply(self, step: int) -> None:
        """Write Θ after step ``step`` into the grown blocks; arrange the heads of a newly
        activated layer (S_l in consecutive slots: a no-op once arranged, and after
        resuming, whose checkpoint holds the arranged weights and their order)."""
        structure = self.schedule.structure(step)
        for layer, block in self.grown.items():
            depth, weights = structure.get(layer, (0, None))
            block.head_loop.set(depth, weights)
            if isinstance(block, HeadLoopBlock) and layer in self.schedule.heads:
                block.arrange_heads(self.schedule.heads[layer], self.optimizer)

    def state_dict(self) -> dict:
        if self.meter is not None:
            self._sync()
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict, step: int) -> None:
        """Restore the schedule saved at step ``step`` and the structure it implies."""
        self.schedule.load_state_dict(state)
        if self.meter is not None:
            self._load_ema()
        if self.schedule.frozen and self.meter is not None:
            self.meter.detach()
            self.meter = None
        self.apply(step)
