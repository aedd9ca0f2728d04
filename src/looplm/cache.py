"""Decoding cache of a looped model.

Under weight sharing the same mixer runs once per iteration and sees different inputs
each time, so states are keyed by ``(block, iteration)``, never by layer alone. Each
state is the mixer's own typed object (keys/values, a window of them, a recurrent
matrix, ...; see ``looplm.mixers``). The cache also keeps which positions are real tokens
(left-padded batches) and the next position id of every row.

State-passing topologies (``looplm.topology``) act on each position independently, so
the carrier of a past position (an anchor, the MeSH buffer) is never read when later
tokens are decoded; it is recomputed for the new positions only and need not be cached.

Multi-resolution iterations (``looplm.resolution``) run the core on chunk latents: their
core states (block, t) hold compressed positions (one per completed chunk), and
``chunks[t]`` holds the chunk buffer and the finalised latents (Algorithm 2 of
spiralformer.txt); in a static cache, the chunk buffer and the shifted updates in
preallocated buffers (:class:`~looplm.resolution.state.StaticChunkState`), with the
core's states sized for the chunks that fit the capacity.

Adaptive halting (``looplm.halting``) lets a call stop its loop once all its new positions
have halted, so later macro steps have no entries for them. The cache then keeps every
position's last loop state (``frozen``: unchanged once it halted) and ``steps_done`` [S], the
macro steps whose entries exist per position. ``steps_done`` never increases along the
sequence, so the positions missing step t are a suffix; the model fills them in from
their frozen states ("catch-up") before a later position first needs step t. Logits
equal the full forward's, where halted positions pass through later steps frozen.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.utils._pytree as pytree

from looplm.config_base import ConfigError
from looplm.mixers.base import MixerState
from looplm.resolution.state import ChunkState, check_crop
from looplm.topology.base import LoopState


class LoopCache:
    """All decoding state of one model for one batch of sequences.

    ``valid`` [B, S] marks real (non-padding) positions; ``next_position`` [B] is the
    position id the next token of each row gets; ``iterations`` the loop count it was
    filled with. The model writes through the methods below; callers read.
    """

    def __init__(self, full_loop: bool = False) -> None:
        #: run every macro step on every position, halted ones frozen, instead of stopping
        #: the loop once all have halted: the cache then never lacks a step's entries (no
        #: catch-up, no frozen states), so it has a static form; same logits, more compute
        self.full_loop = full_loop
        self.states: dict[tuple[str, int], MixerState] = {}
        self.valid: Optional[torch.Tensor] = None
        self.next_position: Optional[torch.Tensor] = None
        self.padded = False  # whether any position so far is padding
        self.iterations: Optional[int] = None
        self.chunks: dict[int, ChunkState] = {}  # multi-resolution iteration t -> its chunk state
        self.frozen: Optional[LoopState] = None  # adaptive halting: each position's last loop state [B, S, ...]
        self.steps_done: Optional[torch.Tensor] = None  # [S] long, non-increasing: macro steps cached per position
        #: [B, S] long: each position's realised macro steps, kept by a full-loop cache where
        #: the halting rule needs them (``Halting.keeps_depth``: MoR's recursion-wise KV)
        self.depth: Optional[torch.Tensor] = None

    def get(self, block: str, iteration: int) -> Optional[MixerState]:
        return self.states.get((block, iteration))

    def set(self, block: str, iteration: int, state: MixerState) -> None:
        self.states[(block, iteration)] = state

    def use_iterations(self, iterations: int) -> None:
        """Fix the loop count at the first call; a later call with another count is refused
        (its entries would be keyed by other iterations)."""
        if self.iterations is None:
            self.iterations = iterations
        elif self.iterations != iterations:
            raise ConfigError("iterations", iterations, f"{self.iterations}, the count this cache was filled with")

    def extend(self, new_valid: torch.Tensor, masked: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Add T new positions, ``new_valid`` [B, T] (``masked``: they came with an attention
        mask, so some may be padding). Returns the validity of every position [B, S + T],
        each row's first new position id [B], and whether any position so far is padding."""
        B = new_valid.shape[0]
        if self.valid is None:
            valid, start = new_valid, torch.zeros(B, dtype=torch.long, device=new_valid.device)
        else:
            if self.valid.shape[0] != B:
                raise ValueError(f"batch of {B} rows does not match the cache's {self.valid.shape[0]}")
            valid, start = torch.cat([self.valid, new_valid], dim=1), self.next_position
        self.padded = self.padded or (masked and not bool(new_valid.all()))
        # without a mask every new position is real: each row moves on by T, nothing to count
        self.valid, self.next_position = valid, start + (new_valid.long().sum(dim=1) if masked else new_valid.shape[1])
        return valid, start, self.padded

    def chunk(self, t: int) -> Optional[ChunkState]:
        """Multi-resolution iteration t's chunk state (None before its first call)."""
        return self.chunks.get(t)

    def set_chunk(self, t: int, state: ChunkState) -> None:
        self.chunks[t] = state

    def first_missing(self, t: int) -> int:
        """First position without entries for macro step t (the sequence length if none)."""
        if self.steps_done is None:
            return self.get_seq_length()
        return int((self.steps_done > t).sum())

    def append_frozen(self, state: LoopState, steps: int) -> None:
        """Keep the new positions' last loop states, which have entries for ``steps`` macro steps."""
        done = torch.full((state.h.shape[1],), steps, dtype=torch.long, device=state.h.device)
        if self.frozen is None:
            self.frozen, self.steps_done = LoopState(state.h, dict(state.carrier)), done
            return
        self.frozen = LoopState(
            h=torch.cat([self.frozen.h, state.h], dim=1),
            carrier={k: torch.cat([self.frozen.carrier[k], v], dim=1) for k, v in state.carrier.items()},
        )
        self.steps_done = torch.cat([self.steps_done, done])

    def record_depth(self, steps: torch.Tensor, slots: Optional[torch.Tensor] = None) -> None:
        """Keep the new positions' realised macro steps [B, T] (``depth``)."""
        self.depth = steps if self.depth is None else torch.cat([self.depth, steps], dim=1)

    def frozen_slice(self, start: int, end: int) -> LoopState:
        """The frozen loop states of positions [start, end)."""
        return self.frozen.map(lambda x: x[:, start:end])

    def mark_caught_up(self, start: int, end: int, steps: int) -> None:
        """Positions [start, end) now have entries for ``steps`` macro steps (after a catch-up)."""
        self.steps_done[start:end] = steps

    def get_seq_length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def static(self, capacity: int) -> "StaticLoopCache":
        """This cache's contents in buffers preallocated for ``capacity`` positions
        (:class:`StaticLoopCache`); raises :class:`NotStatic` naming what cannot be."""
        return StaticLoopCache.of(self, capacity)

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (e.g. rejected speculative tokens)."""
        if self.valid is None or length >= self.get_seq_length():
            return
        # every state and chunk is cropped (or refuses) before any is replaced: a refused crop changes nothing
        states = {key: state.crop(self._compressed(key, length)) for key, state in self.states.items()}
        self.states, self.chunks = states, {t: chunk.crop(length) for t, chunk in self.chunks.items()}
        if self.frozen is not None:
            self.frozen, self.steps_done = self.frozen_slice(0, length), self.steps_done[:length]
        if self.depth is not None:
            self.depth = self.depth[:, :length]
        self.valid = self.valid[:, :length]
        self.next_position = self.valid.long().sum(dim=1)
        self.padded = not bool(self.valid.all())

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (and reorder to) the rows in ``index``, e.g. for beam search or finished rows."""
        self.states = {key: state.select(index) for key, state in self.states.items()}
        self.chunks = {t: chunk.select(index) for t, chunk in self.chunks.items()}
        if self.frozen is not None:
            self.frozen = self.frozen.map(lambda x: x[index])
        if self.depth is not None:
            self.depth = self.depth[index]
        if self.valid is not None:
            self.valid = self.valid[index]
            self.next_position = self.next_position[index]
            self.padded = not bool(self.valid.all())

    def _compressed(self, key: tuple[str, int], length: int) -> int:
        """Positions a state keeps for the first ``length`` tokens: complete chunks for the core
        blocks of a multi-resolution iteration, ``length`` otherwise."""
        block, t = key
        chunk = self.chunks.get(t) if block.startswith("core.") else None
        return length if chunk is None else chunk.resolution.complete_chunks(length)

    def coarse_triggers(self) -> dict[int, list[int]]:
        """Per multi-resolution iteration, the positions at which its coarse core ran (one per
        completed chunk, at the chunk's last position; spiralformer Appendix D)."""
        return {t: list(chunk.triggers) for t, chunk in sorted(self.chunks.items())}


class NotStatic(ValueError):
    """A cache that has no static form (a growing state, adaptive halting that stopped
    early); the message says which part and why. ``after``: the cache has one once it holds
    that many positions (a multi-resolution iteration before its first chunk), else None."""

    def __init__(self, message: str, after: Optional[int] = None) -> None:
        super().__init__(message)
        self.after = after


class StaticLoopCache(LoopCache):
    """A :class:`LoopCache` whose tensors are preallocated for ``capacity`` positions and
    written in place, so a decoding step reads and writes the same storage every time and
    changes nothing on the host: it compiles to one graph and replays as a CUDA graph.

    Made from a filled cache (:meth:`LoopCache.static`, after the prefill), sized at
    ``generate`` time from the prompt and ``max_new_tokens``. ``valid`` [B, C] holds the
    validity of every buffer row (False beyond the written ones); ``position`` [] the next
    row to write, on the device; ``next_position`` [B] each row's next position id.
    Attention keys live in :class:`~looplm.mixers.attention.StaticKVState` buffers; a
    fixed-size state (a linear mixer's S and conv windows) keeps its tensors and each step
    copies the new values into them (:meth:`set`). ``length`` mirrors ``position`` on the
    host for the eager callers' checks; a captured step leaves it to its caller
    (:meth:`advance`).

    Multi-resolution iterations keep a :class:`~looplm.resolution.state.StaticChunkState`
    each; whenever ``length`` moves, the cache tells each one what the next position does at
    its resolution (``closing``: completes a chunk or not), the host-side phase a captured
    step branches on.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(full_loop=True)
        self.capacity = capacity
        self.length = 0
        self.position: Optional[torch.Tensor] = None
        #: a captured step runs each block pass as one nested compile region, traced and
        #: compiled once for all passes alike (:mod:`looplm.modules.region`); False: unrolled
        self.block_regions = True

    @classmethod
    def of(cls, cache: LoopCache, capacity: int) -> "StaticLoopCache":
        if cache.valid is None:
            raise NotStatic("an empty cache: fill it with a prefill forward first")
        if cache.frozen is not None:
            raise NotStatic("adaptive halting with frozen positions: its loop length depends on the data "
                            "(fill the cache with LoopCache(full_loop=True) to give it a static form)")
        length = cache.get_seq_length()
        if capacity < length:
            raise NotStatic(f"capacity {capacity} is below the {length} positions already cached")
        static = cls(capacity)
        for key, state in cache.states.items():
            convert = getattr(state, "static", None)
            if convert is None:
                raise NotStatic(f"block {key[0]} (pass {key[1]}) holds a {type(state).__name__}, which has no static form")
            try:
                static.states[key] = convert(cache._compressed(key, capacity))  # chunks for a coarse core
                register_pytree(static.states[key])
            except TypeError as reason:  # a composite state with a part that has none
                raise NotStatic(f"block {key[0]} (pass {key[1]}): {reason}") from None
        B, device = cache.valid.shape[0], cache.valid.device
        static.valid = torch.zeros(B, capacity, dtype=torch.bool, device=device)
        static.valid[:, :length] = cache.valid
        if cache.depth is not None:
            static.depth = torch.zeros(B, capacity, dtype=torch.long, device=device)
            static.depth[:, :length] = cache.depth
        static.next_position = cache.next_position.clone()
        static.position = torch.tensor(length, device=device)
        for t, chunk in cache.chunks.items():
            try:
                static.chunks[t] = chunk.static(capacity)
            except TypeError as reason:  # no chunk completed yet
                raise NotStatic(f"multi-resolution iteration {t}: {reason}", after=chunk.resolution.trigger(0) + 1) \
                    from None
        static.padded, static.iterations = cache.padded, cache.iterations
        static._move_to(length)
        return static

    def _move_to(self, length: int) -> None:
        """Set the host length and each multi-resolution iteration's phase at it."""
        self.length = length
        for chunk in self.chunks.values():
            chunk.closing = chunk.resolution.closing(length)

    def recount(self, length: int) -> None:
        """Set the host count to ``length`` positions (a recorded CUDA graph ran the step's
        Python, which counted, but none of its kernels)."""
        self._move_to(length)

    def phase(self) -> tuple:
        """The host-side phase of the next position: each multi-resolution iteration's
        ``closing`` (empty without such iterations). A captured step is one graph per phase."""
        return tuple(chunk.closing for chunk in self.chunks.values())

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer a decoding step reads or writes (to mark as static addresses for
        CUDA graphs)."""
        found = [self.valid, self.next_position, self.position, *([] if self.depth is None else [self.depth])]
        for state in [*self.states.values(), *self.chunks.values()]:
            _leaves(state, found)
        return found

    def set(self, block: str, iteration: int, state: MixerState) -> None:
        """Keep the state's tensors where they are: copy a new state's values into them."""
        old = self.states.get((block, iteration))
        if old is None:
            self.states[(block, iteration)] = state
        else:
            copy_into(old, state)

    def record_depth(self, steps: torch.Tensor, slots: Optional[torch.Tensor] = None) -> None:
        """Write the new positions' realised macro steps [B, T] into their rows ``slots``."""
        self.depth.index_copy_(1, slots, steps)

    def extend(self, new_valid: torch.Tensor, masked: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
        raise NotStatic("a static cache is extended by extend_static (LoopLM._context)")

    def extend_static(self, new_valid: torch.Tensor, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Write T new positions' validity into their rows. Returns (slots [T], the rows
        written; positions [B, T], their position ids). Host state is untouched while
        compiling (:meth:`advance` is then the caller's)."""
        B, T = new_valid.shape
        if B != self.valid.shape[0]:
            raise ValueError(f"batch of {B} rows does not match the cache's {self.valid.shape[0]}")
        if not torch.compiler.is_compiling():
            if self.length + T > self.capacity:
                raise ValueError(f"{self.length + T} positions exceed the static cache's capacity {self.capacity}")
            if masked and not self.padded and not bool(new_valid.all()):
                raise ValueError("a static cache cannot take padding after its prefill (pad the prompt instead)")
        # a new tensor (not a view of position, which moves on below)
        slots = self.position.reshape(1).clone() if T == 1 else self.position + torch.arange(T, device=new_valid.device)
        self.valid.index_copy_(1, slots, new_valid)
        if masked:
            positions = (self.next_position[:, None] + new_valid.long().cumsum(dim=1) - 1).clamp(min=0)
            self.next_position.add_(new_valid.sum(dim=1))
        else:
            step = torch.arange(T, device=new_valid.device) if T > 1 else 0
            positions = self.next_position[:, None] + step  # a new tensor: next_position moves on below
            self.next_position.add_(T)
        self.position.add_(T)
        self.advance(T)
        return slots, positions

    def advance(self, length: int) -> None:
        """Count ``length`` more positions on the host (a captured step's caller does this)."""
        if not torch.compiler.is_compiling():
            self._move_to(self.length + length)

    def get_seq_length(self) -> int:
        return self.length

    def phase_count(self) -> int:
        """Distinct host-side phases of the positions left (each multi-resolution iteration's
        ``closing``): the graphs a captured step compiles, 1 without such iterations."""
        chunks = [chunk.resolution for chunk in self.chunks.values()]
        return len({tuple(it.closing(p) for it in chunks) for p in range(self.length, self.capacity)}) or 1

    def coarse_triggers(self) -> dict[int, list[int]]:
        """As :meth:`LoopCache.coarse_triggers`: every completed chunk's last position."""
        return {t: [chunk.resolution.trigger(j) for j in range(chunk.resolution.complete_chunks(self.length))]
                for t, chunk in sorted(self.chunks.items())}

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on; the rows stay and are rewritten later.
        Refused when a state summarises every position (a linear mixer's S)."""
        if length >= self.length:
            return
        for chunk in self.chunks.values():
            check_crop(chunk.resolution, self.length, length)
        for (block, t), state in self.states.items():
            rewind = getattr(state, "rewind", 0)  # positions it may lose: None any, 0 none (S summarises all)
            lost = self._compressed((block, t), self.length) - self._compressed((block, t), length)
            if rewind == 0 and lost:
                raise ValueError(f"cannot crop the static cache to {length} positions: block {block} (pass {t}) "
                                 f"holds a {type(state).__name__}, which cannot be rewound")
            if rewind is not None and lost > rewind:
                raise ValueError(f"cannot crop the static cache by {self.length - length} positions: block {block} "
                                 f"(pass {t}) keeps a sliding window's ring that can rewind {rewind}")
        for chunk in self.chunks.values():
            chunk.crop(self.length, length)
        self.valid[:, length:] = False
        self.next_position.copy_(self.valid.long().sum(dim=1))
        self.position.fill_(length)
        self._move_to(length)

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder rows in place when ``index`` keeps the batch size (beam search)."""
        same = index.shape[0] == self.valid.shape[0]
        for key, state in self.states.items():
            if same:
                self.set(*key, state.select(index))  # buffers reorder in place; new values are copied in
            else:
                self.states[key] = state.select(index)
        for t, chunk in self.chunks.items():
            self.chunks[t] = chunk.select(index)  # the same object when in place
        for name in ("valid", "next_position", *(("depth",) if self.depth is not None else ())):
            value = getattr(self, name)
            if same:
                value.copy_(value[index])
            else:
                setattr(self, name, value[index])
        self.padded = not bool(self.valid[:, : self.length].all())


def _leaves(state, found: list) -> None:
    """The tensors of a (possibly nested) state dataclass, appended to ``found``."""
    if isinstance(state, torch.Tensor):
        found.append(state)
    elif isinstance(state, (tuple, list)):
        for part in state:
            _leaves(part, found)
    elif dataclasses.is_dataclass(state):
        for field in dataclasses.fields(state):
            _leaves(getattr(state, field.name), found)


def register_pytree(state) -> None:
    """Register the dataclasses of a static state (and those nested in it) as pytree nodes:
    a nested compile region (:mod:`looplm.modules.region`) is traced once and reused only
    when its inputs flatten to tensors and constants. Idempotent."""
    if isinstance(state, (tuple, list)):
        for part in state:
            register_pytree(part)
    elif dataclasses.is_dataclass(state) and not isinstance(state, type):
        if type(state) not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(type(state))
        for field in dataclasses.fields(state):
            register_pytree(getattr(state, field.name))


def copy_into(dest, value) -> None:
    """Copy ``value``'s tensors into ``dest``'s (same structure), in place; anything else
    (ints, the same object) is left as it is."""
    if isinstance(dest, torch.Tensor):
        dest.copy_(value)
    elif isinstance(dest, (tuple, list)):
        for d, v in zip(dest, value):
            copy_into(d, v)
    elif dataclasses.is_dataclass(dest) and dest is not value:  # a state written in place is its own update
        for field in dataclasses.fields(dest):
            copy_into(getattr(dest, field.name), getattr(value, field.name))
