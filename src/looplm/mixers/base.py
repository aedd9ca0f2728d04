"""The token-mixer interface and what all mixers of one forward share.

A mixer maps x [B, T, d] to [B, T, d] given a :class:`MixerContext` and its own decoding
state for this (block, iteration): ``forward(x, ctx, state) -> (out, new_state)``. In
training ``state`` is None and the returned state is ignored; in decoding the model keeps
it in :class:`~looplm.cache.LoopCache`. States are typed per mixer and know how to crop
and select rows (:class:`MixerState`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Optional, Protocol

import torch

from looplm.recompute import recomputing


class MixerState(Protocol):
    """A mixer's decoding state: everything it needs from earlier positions."""

    def crop(self, length: int) -> "MixerState":
        """The state as it was after the first ``length`` positions."""

    def select(self, index: torch.Tensor) -> "MixerState":
        """Keep (and reorder to) the batch rows in ``index``."""


class AuxLosses:
    """name -> auxiliary loss summed over a forward (:meth:`MixerContext.add_loss`), with a
    dict's methods (``[name]``, ``in``, ``items``, ``values``, ``get``, ``pop``, ``clear``, …).

    Not a ``dict``: FSDP2 hooks the backward of every tensor requiring grad that a unit's
    arguments hold, rebuilding the dicts and dataclasses around them
    (``torch.distributed.fsdp._common_utils.replace_grad_tensors``). Once a loss was added,
    every later unit would get a copy of the context and add its loss to the copy, lost;
    FSDP2 does not look inside other objects. A plain class (no ``abc`` base), so that
    torch.compile traces its construction in a captured decoding step."""

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._values[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._values[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def items(self):
        return self._values.items()

    def values(self):
        return self._values.values()

    def keys(self):
        return self._values.keys()

    def get(self, name: str, default=None):
        return self._values.get(name, default)

    def pop(self, name: str, *default):
        return self._values.pop(name, *default)

    def clear(self) -> None:
        self._values.clear()

    def __eq__(self, other: object) -> bool:
        return dict(self._values) == (dict(other._values) if isinstance(other, AuxLosses) else other)

    def __repr__(self) -> str:
        return f"AuxLosses({self._values!r})"


#: how a step's queries q [B, H, T, D] attend over the keys and values a block's attention
#: prepared, called with the running step's context; returns [B, H, T, D]
AttendOver = Callable[[torch.Tensor, "MixerContext"], torch.Tensor]


class FirstStepKV:
    """Mixture-of-Recursions' recursive KV sharing (Bae et al. 2025, arXiv 2507.10524,
    §2.2.2 "KV caching strategies"; :mod:`looplm.halting.mor`): the keys and values each
    core block's attention computes at the first recursion step serve every later step of
    that block. One per forward, made by the halting rule; the first step's context holds
    it with ``reusing`` False and each block's attention keeps how its queries attend over
    its keys and values (:meth:`keep`, by block name); the later steps' contexts hold a view
    with ``reusing`` True, whose attention projects queries only and attends over the first
    step's (:meth:`attend`). A decoding cache then holds entries of the first step alone."""

    def __init__(self, kept: Optional[dict[str, AttendOver]] = None, reusing: bool = False) -> None:
        self.kept: dict[str, AttendOver] = {} if kept is None else kept
        self.reusing = reusing

    def later(self) -> "FirstStepKV":
        """The view a later recursion step reads through (the same kept attention)."""
        return FirstStepKV(self.kept, reusing=True)

    def keep(self, block: str, attend: AttendOver) -> None:
        """Keep block ``block``'s attention over its first-step keys and values. Not again in
        an activation-checkpointing recomputation: the forward's are kept already."""
        if not recomputing():
            self.kept[block] = attend

    def attend(self, block: str, q: torch.Tensor, ctx: "MixerContext") -> torch.Tensor:
        """Queries q [B, H, T, D] of a later step of ``block`` over its first step's keys -> [B, H, T, D]."""
        return self.kept[block](q, ctx)


def visible(query: torch.Tensor, key: torch.Tensor, seen: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """Which keys each query may attend to, bool [..., T, S]: causal by position (``query``
    [..., T, 1] and ``key`` [..., 1, S] are positions or columns), within the last ``window``
    positions (all when None), among the real keys (``seen``, broadcast to [..., T, S]); a
    query always sees its own position (no NaN rows for padding). The one rule of every
    attention mask here: growing cache, static cache and gathered rows."""
    allowed = key <= query
    if window is not None:
        allowed = allowed & (key > query - window)  # the last `window` positions, itself included
    return (allowed & seen) | (key == query)


@dataclasses.dataclass
class GatheredRows:
    """The positions a loop step runs on when the others skip it: Mixture-of-Recursions'
    compute saving (Bae et al. 2025, arXiv 2507.10524, §2.2.1: a token that left the
    recursion takes no later step; :mod:`looplm.halting.mor`). Per batch row, the indices
    of the positions taking the step in ascending order, padded to the longest row's count
    K; a padding slot holds the index of a position not taking the step (all K indices of a
    row are distinct, so a scatter back writes each position once) and is not a valid key.
    The step's blocks run on the [B, K] rows; attention masks by these indices, so
    causality and windows are those of the positions themselves."""

    index: torch.Tensor  # [B, K] long
    valid: torch.Tensor  # [B, K] bool: a position taking the step (not a padding slot)

    @classmethod
    def of(cls, running: torch.Tensor) -> "GatheredRows":
        """The rows of ``running`` [B, T] bool. Reads K, the longest row's count, back to the
        host: the shape of the step (one host sync per skipping step)."""
        count = running.sum(dim=1)
        K = int(count.max())
        index = torch.argsort((~running).to(torch.uint8), dim=1, stable=True)[:, :K]  # running first, in order
        return cls(index, torch.arange(K, device=running.device)[None, :] < count[:, None])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] -> the step's rows [B, K, ...]."""
        index = self.index.view(*self.index.shape, *([1] * (x.dim() - 2)))
        return x.gather(1, index.expand(-1, -1, *x.shape[2:]))

    def scatter(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] with the step's rows [B, K, ...] written back at their positions
        (padding slots write into positions not taking the step, which the halting rule
        keeps frozen)."""
        index = self.index.view(*self.index.shape, *([1] * (x.dim() - 2)))
        return x.scatter(1, index.expand(-1, -1, *x.shape[2:]), rows)

    def mask(self, key_index: torch.Tensor, key_valid: torch.Tensor, window: Optional[int]) -> torch.Tensor:
        """Bool [B, 1, K, S]: the gathered queries over keys at ``key_index`` ([B or 1, S]),
        causal by position, over the last ``window`` positions (all when None), real keys
        only; a query always sees its own position (no NaN rows for padding slots)."""
        return visible(self.index[:, :, None], key_index[:, None, :], key_valid[:, None, :], window)[:, None]


@dataclasses.dataclass
class MixerContext:
    """Computed once per forward and passed to every mixer.

    rope: (cos, sin) [B, T, R] for the new positions. valid: [B, S] bool, real (not
    padding) key positions, the cache's earlier ones first. past: cached positions
    S - T. padded: whether any of the S positions is padding. slots: with a static cache
    (:class:`~looplm.cache.StaticLoopCache`), the [T] buffer rows the new positions are
    written to; then ``valid`` is the whole buffer's [B, C] (rows not yet written are
    False) and ``past`` is None: nothing on the host changes from one decoding step to the
    next, so one captured step serves them all. losses: auxiliary training
    losses mixers add during this forward (e.g. DSA's indexer loss), summed per name over
    every block and iteration; the model adds them to its loss. attentions: when a dict,
    softmax mixers store their attention probabilities under ``location``, the
    (block, iteration) the model is running. first_step_kv: within a loop step of
    Mixture-of-Recursions' recursive KV sharing (:class:`FirstStepKV`), where softmax
    attention keeps (first step) or reuses (later steps) the first step's keys and values.
    gathered: a loop step run on the positions taking it alone (:class:`GatheredRows`,
    Mixture-of-Recursions' token skipping): the rows are the gathered ones, ``rope`` and
    ``valid`` theirs ([B, K]), ``past`` 0, and attention masks by their positions.
    """

    rope: tuple[torch.Tensor, torch.Tensor]
    valid: torch.Tensor
    past: Optional[int]
    padded: bool
    slots: Optional[torch.Tensor] = None
    losses: Optional[AuxLosses] = None  # a new AuxLosses (__post_init__)
    attentions: Optional[dict[tuple[str, int], torch.Tensor]] = None
    location: tuple[str, int] = ("", 0)
    first_step_kv: Optional[FirstStepKV] = None
    gathered: Optional[GatheredRows] = None
    _masks: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.losses is None:  # not a default_factory: torch.compile cannot call one of a user class
            self.losses = AuxLosses()

    def at(self, block: str, slot: int) -> None:
        """Name the (block, pass) that runs next: the key :meth:`record_attention` and the
        hooks of probes and distillation read from ``location``. The one writer of
        ``location``: the model names each block it runs (``LoopLM._run``), a grown block
        each of its extra passes (:mod:`looplm.head_loop.block`)."""
        self.location = (block, slot)

    def record_attention(self, probs: torch.Tensor) -> None:
        """Keep softmax probabilities [B, H, T, S] of the running (block, iteration) when the
        caller asked for them (``attentions`` is a dict); probes read them from the output.
        Not again in an activation-checkpointing recomputation (:mod:`looplm.recompute`)."""
        if self.attentions is not None and not recomputing():
            self.attentions[self.location] = probs.detach()

    def add_loss(self, name: str, value: torch.Tensor) -> None:
        """Add an already weighted auxiliary loss under ``name``. An activation-checkpointing
        recomputation adds nothing: the loss of this forward is already counted."""
        if recomputing():
            return
        self.losses[name] = self.losses[name] + value if name in self.losses else value

    def unaliased_rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope``'s (cos, sin) with storage of their own, made once per context:
        :class:`~looplm.modules.rotary.Rotary` slices both from one gathered table, and the inputs of
        a nested compile region (:mod:`looplm.modules.region`) may not alias one another."""
        if "unaliased_rope" not in self._masks:
            self._masks["unaliased_rope"] = tuple(table.clone() for table in self.rope)
        return self._masks["unaliased_rope"]

    @property
    def length(self) -> int:
        """T, the number of new positions."""
        return self.slots.shape[0] if self.slots is not None else self.valid.shape[1] - self.past

    @property
    def new_valid(self) -> torch.Tensor:
        """[B, T] bool: which new positions are real tokens."""
        if self.slots is not None:
            return self.valid.index_select(1, self.slots)
        return self.valid[:, self.past :]

    def attention_mask(self, window: Optional[int] = None) -> Optional[torch.Tensor]:
        """Bool [B, 1, T, S] (True = may attend) for causal attention over the last
        ``window`` positions (all when None), or None when plain causal attention of the
        new positions over all S keys is exact (no padding, and no past or one query).
        With static slots: [B, 1, T, C] over the whole buffer, never None (rows not yet
        written are masked out). With gathered rows: [B, 1, K, K] by their positions."""
        if self.slots is not None:
            return self.static_mask("window", window)
        if self.gathered is not None:
            if window not in self._masks:
                self._masks[window] = self.gathered.mask(self.gathered.index, self.valid, window)
            return self._masks[window]
        T, S = self.length, self.valid.shape[1]
        if not self.padded and (self.past == 0 or T == 1) and (window is None or S <= window):
            return None
        if window not in self._masks:
            device = self.valid.device
            query = torch.arange(self.past, S, device=device)[:, None]  # [T, 1] absolute index
            key = torch.arange(S, device=device)[None, :]  # [1, S]
            self._masks[window] = visible(query, key, self.valid[:, None, :], window)[:, None]  # [B, 1, T, S]
        return self._masks[window]

    def gathered_mask(self, key_valid: torch.Tensor, window: Optional[int]) -> torch.Tensor:
        """The gathered rows over all S positions' keys, valid per ``key_valid`` [B, S]: what a
        later step of MoR's recursive KV sharing attends over (the first step's keys), made
        once per forward and window."""
        key = ("gathered over all", window)
        if key not in self._masks:
            index = torch.arange(key_valid.shape[1], device=key_valid.device)[None, :]
            self._masks[key] = self.gathered.mask(index, key_valid, window)
        return self._masks[key]

    def static_bias(self, mask: tuple, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`static_mask` ``(*mask)`` as an additive bias of ``dtype`` (0 where allowed,
        -inf elsewhere), made once per forward: SDPA would otherwise convert a boolean mask
        in every layer."""
        key = ("bias", mask, dtype)
        if key not in self._masks:
            allowed = self.static_mask(*mask)
            self._masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf"))
        return self._masks[key]

    def static_mask(self, kind: str, *args) -> torch.Tensor:
        """Bool [B, 1, T, K] over a static cache's K key rows (:class:`StaticLoopCache`).

        ``("window", w)``: rows are positions' columns 0..C-1 (w None: no window).
        ``("ring", R, w, written)``: a window's ring of R rows, row j holding the latest
        column ≡ j (mod R); ``written``: the new position is already in its row (one query),
        else the keys are the ring before this step followed by the T new ones.
        A key is visible iff its column c satisfies 0 <= c <= i, c > i - w and is valid;
        a query always sees itself. Columns, as in the growing cache's mask."""
        key = (kind, *args)
        if key in self._masks:
            return self._masks[key]
        query = self.slots[:, None]  # [T, 1]
        if kind == "window":
            (window,) = args
            column = torch.arange(self.valid.shape[1], device=self.valid.device)[None, :]  # [1, C]
            seen = self.valid[:, None, :]
        else:
            rows, window, written = args
            j = torch.arange(rows, device=self.valid.device)
            last = self.slots[-1] if written else self.slots[0] - 1  # the latest column in the ring
            column = last - torch.remainder(last - j, rows)  # [R]
            if not written:
                column = torch.cat([column, self.slots])  # [R + T]
            column = column[None, :]
            seen = self.valid.index_select(1, column[0].clamp(min=0))[:, None, :] & (column >= 0)[None]
        self._masks[key] = visible(query, column, seen, window)[:, None]
        return self._masks[key]
