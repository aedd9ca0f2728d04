"""The loop's shape, described once (:attr:`looplm.model_config.ModelConfig.structure`).

A looped model is prelude blocks, a core stack run T times, coda blocks (MeSH §B's
``P+CRT+Q``). Which blocks it holds, under which names they run and how many block
evaluations a forward costs follow from the layout, ``model.share_core`` and the streams'
core passes per macro step; :class:`LoopStructure` works them out, and the model, the
head-loop axis, accounting, distillation, conversion and the probes read them from it.

Three kinds of name, one per use:

* **block names** ``prelude.j`` / ``core.j`` / ``coda.j``: a block position as it runs; the
  cache, the attention record and the probes key by (block name, pass).
* **parameter paths** ``prelude.j`` / ``core.i.j`` / ``coda.j``: the module that holds a
  block's weights (``core.i`` is stack i: one when the core is shared, one per iteration
  otherwise), the state dict's prefixes.
* **distinct-block labels** ``prelude.j`` / ``core.j`` (``core[i].j`` with several stacks)
  / ``coda.j``: one per module of ``LoopLM.blocks()``, what growth events and the grown
  structure report (sparse-growing-transformer.txt §4).
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch

from looplm.config_base import check
from looplm.layout import Layout

#: The parts of the graph that hold blocks, in depth order.
PARTS = ("prelude", "core", "coda")

Steps = TypeVar("Steps", int, torch.Tensor)


@dataclasses.dataclass(frozen=True)
class LoopStructure:
    """prelude, core, coda: block counts (core 0 without a loop). iterations: the trained
    macro steps T (0 without a loop). shared: every iteration runs the one core stack
    (``model.share_core``). passes_per_step: core passes per macro step (the streams': 1,
    or H·(L + 1) for nested two streams, autoregressive-trm.txt App. B)."""

    prelude: int
    core: int
    coda: int
    iterations: int
    shared: bool
    passes_per_step: int

    def __post_init__(self) -> None:
        for name in ("prelude", "core", "coda", "iterations"):
            check(getattr(self, name) >= 0, f"structure.{name}", getattr(self, name), "an integer >= 0")
        check((self.core == 0) == (self.iterations == 0), "structure.iterations", self.iterations,
              f"0 exactly when there is no core (core={self.core}): a loop runs its core T >= 1 times")
        check(self.passes_per_step >= 1, "structure.passes_per_step", self.passes_per_step, "an integer >= 1")
        # the names, made here and not on first use: a functools.cached_property takes a lock
        # that torch.compile cannot trace (a fresh model's first forward under fullgraph=True)
        names = {part: tuple(f"{part}.{j}" for j in range(getattr(self, part))) for part in PARTS}
        object.__setattr__(self, "_names", names)

    @classmethod
    def of(cls, layout: Layout, share_core: bool, passes_per_step: int = 1) -> "LoopStructure":
        """The structure of ``layout`` with the core shared or not and the streams' core
        passes per step (1: a single stream; names and paths do not depend on it)."""
        looped = layout.is_looped
        return cls(prelude=layout.prelude, core=layout.core if looped else 0, coda=layout.coda,
                   iterations=layout.iterations if looped else 0, shared=share_core,
                   passes_per_step=passes_per_step)

    @property
    def is_looped(self) -> bool:
        return self.core > 0

    @property
    def stacks(self) -> int:
        """Core stacks the model holds: 1 when shared, T otherwise, 0 without a loop."""
        if not self.is_looped:
            return 0
        return 1 if self.shared else self.iterations

    @property
    def distinct_blocks(self) -> int:
        """Block modules the model holds (``LoopLM.blocks()``): prelude + stacks·core + coda."""
        return self.prelude + self.stacks * self.core + self.coda

    def slot(self, t: int, i: int) -> int:
        """The key of core pass i of macro step t in the cache and the attention record: t·passes + i."""
        return t * self.passes_per_step + i

    def stack_at(self, t: int) -> int:
        """The core stack that runs at iteration t (``LoopLM.core[i]``)."""
        return 0 if self.shared else t

    def count(self, part: str) -> int:
        """Block positions of ``part`` (one of :data:`PARTS`)."""
        check(part in PARTS, "part", part, f"one of {', '.join(PARTS)}")
        return getattr(self, part)

    @property
    def positions(self) -> tuple[tuple[str, int], ...]:
        """Every block position (part, j) in depth order: what a block's mixers are planned
        by (:func:`looplm.mixers.pattern.block_mixers`)."""
        return tuple((part, j) for part in PARTS for j in range(self.count(part)))

    def names_of(self, part: str) -> tuple[str, ...]:
        """The block names of ``part`` in depth order (``core.j``: one per core position)."""
        self.count(part)  # refuses an unknown part
        return self._names[part]

    @property
    def names(self) -> tuple[str, ...]:
        """Every block name in depth order: prelude.j, core.j, coda.j."""
        return sum((self._names[part] for part in PARTS), ())

    def paths_of(self, name: str) -> tuple[str, ...]:
        """The parameter paths that run under block name ``name``: one, or one per stack
        for a core position."""
        part, j = self._split(name)
        if part == "core":
            return tuple(f"core.{i}.{j}" for i in range(self.stacks))
        return (name,)

    def path(self, name: str, t: int) -> str:
        """The parameter path of the block that runs as ``name`` at iteration t."""
        part, j = self._split(name)
        return f"core.{self.stack_at(t)}.{j}" if part == "core" else name

    @property
    def block_paths(self) -> tuple[str, ...]:
        """The parameter path of every block module, in ``LoopLM.blocks()`` order (each core
        stack whole before the next)."""
        return self._per_module("core.{i}.{j}")

    @property
    def block_labels(self) -> tuple[str, ...]:
        """A label per block module, in ``LoopLM.blocks()`` order: its block name, the core's
        as ``core[i].j`` when there are several stacks."""
        return self.names if self.stacks == 1 else self._per_module("core[{i}].{j}")

    def _per_module(self, core: str) -> tuple[str, ...]:
        """prelude.j, ``core`` formatted for stack i and block j, coda.j: one per block module."""
        stacks = tuple(core.format(i=i, j=j) for i in range(self.stacks) for j in range(self.core))
        return self._names["prelude"] + stacks + self._names["coda"]

    def core_passes(self, steps: Steps) -> Steps:
        """Core block evaluations of ``steps`` macro steps: core·passes·steps (an int, or a
        tensor of per-position steps)."""
        return self.core * self.passes_per_step * steps

    def block_passes(self, steps: Steps) -> Steps:
        """Block evaluations of a position that ran ``steps`` macro steps: prelude + coda +
        core·passes·steps (autoregressive-trm.txt App. B's compute C); ``steps`` an int or
        a tensor of per-position steps (the model's realised ``halt_steps``)."""
        return self.prelude + self.coda + self.core_passes(steps)

    @property
    def trained_block_passes(self) -> int:
        """:meth:`block_passes` of the trained T: every position running every step."""
        return self.block_passes(self.iterations)

    def _split(self, name: str) -> tuple[str, int]:
        part, _, j = name.partition(".")
        if part not in PARTS or not j.isdigit() or int(j) >= self.count(part):
            raise ValueError(f"block name {name!r} is not one of this structure's: {', '.join(self.names)}")
        return part, int(j)

