"""A transformers ``Cache`` over looplm's :class:`~looplm.cache.LoopCache`.

transformers' caches are lists of per-layer key/value tensors; a looped model's decoding
state is keyed by (block, iteration) and holds typed mixer states, chunk buffers of
multi-resolution iterations and the frozen states of adaptive halting. This class keeps
that :class:`LoopCache` whole (``.loop``) and answers the part of the ``Cache`` interface
that ``generate()`` uses: the sequence length, cropping, and batch selection (beam search
reordering, row selection, repetition).

``LoopLMCache(max_cache_len=N)`` is the static form (transformers' ``StaticCache``
counterpart): after the prefill the loop cache moves into buffers preallocated for N
positions (:class:`~looplm.cache.StaticLoopCache`), written in place by every later step.
A model whose cache has no static form keeps the growing one, and the reason is logged.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from transformers import Cache

from looplm.cache import LoopCache, NotStatic, StaticLoopCache

logger = logging.getLogger(__name__)


class LoopLMCache(Cache):
    """Decoding state of a :class:`~looplm.hf.LoopLMForCausalLM` for one batch; ``loop`` is the
    looplm cache the model reads and writes. It has no transformers layers: ``update`` (per-
    layer key/value writes) is never called, the model writes through ``loop``."""

    def __init__(self, max_cache_len: Optional[int] = None) -> None:
        super().__init__(layers=[])
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len={max_cache_len!r} is invalid: None (a growing cache) or an integer >= 1")
        self.max_cache_len = max_cache_len
        self.loop = LoopCache()

    @property
    def is_compileable(self) -> bool:
        """Whether the loop cache is static (its buffers never move between steps)."""
        return isinstance(self.loop, StaticLoopCache)

    def after_forward(self) -> None:
        """Called by the model after each forward: with ``max_cache_len``, the first one (the
        prefill) moves the loop cache into its static buffers."""
        if self.max_cache_len is None or self.loop.valid is None or isinstance(self.loop, StaticLoopCache):
            return
        try:
            self.loop = self.loop.static(self.max_cache_len)
        except NotStatic as reason:
            logger.warning("LoopLMCache(max_cache_len=%d) stays a growing cache: %s", self.max_cache_len, reason)
            self.max_cache_len = None

    @property
    def is_linear(self) -> list[bool]:
        """[False]: not a recurrent-state-only cache, so ``generate()`` feeds the model only the
        positions the cache lacks when it restarts from one (an assistant's draft rounds;
        with no layers, transformers >= 5.24 would read ``all([])`` as linear and resend all)."""
        return [False]

    def __repr__(self) -> str:
        return f"LoopLMCache(seq_length={self.get_seq_length()}, entries={len(self.loop.states)})"

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise NotImplementedError("LoopLMCache is written by the looplm model through .loop, not per layer")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.loop.get_seq_length()

    def get_max_length(self, layer_idx=None) -> int:
        """The static capacity, or -1: a growing cache (the model checks its max_seq_len)."""
        return self.max_cache_len if self.max_cache_len is not None else -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.get_max_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def batch_size(self) -> int:
        """Rows held, or -1 before the first forward."""
        return -1 if self.loop.valid is None else self.loop.valid.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes the old row ``beam_idx[i]``."""
        self.loop.select_batch(beam_idx.to(self._device(beam_idx)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.loop.select_batch(indices.to(self._device(indices)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = self.batch_size
        if rows > 0:
            index = torch.arange(rows, device=self.loop.valid.device).repeat_interleave(repeats)
            self.loop.select_batch(index)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: a negative count removes that many positions from the
        end, 0 none; a positive value is the length to keep (the older convention)."""
        length = tokens_to_remove if tokens_to_remove > 0 else self.get_seq_length() + tokens_to_remove
        self.loop.crop(max(length, 0))

    def reset(self) -> None:
        self.loop = LoopCache()  # a static capacity applies again after the next prefill

    def _device(self, index: torch.Tensor) -> torch.device:
        return index.device if self.loop.valid is None else self.loop.valid.device
