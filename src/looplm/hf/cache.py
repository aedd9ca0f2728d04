"""A transformers ``Cache`` over looplm's :class:`~looplm.cache.LoopCache`.

transformers' caches are lists of per-layer key/value tensors; a looped model's decoding
state is keyed by (block, iteration) and holds typed mixer states, chunk buffers of
multi-resolution iterations and the frozen states of adaptive halting. This class keeps
that :class:`LoopCache` whole (``.loop``) and answers the part of the ``Cache`` interface
that ``generate()`` uses: the sequence length, cropping, and batch selection (beam search
reordering, row selection, repetition).
"""

from __future__ import annotations

import torch
from transformers import Cache

from looplm.cache import LoopCache


class LoopLMCache(Cache):
    """Decoding state of a :class:`~looplm.hf.LoopLMForCausalLM` for one batch; ``loop`` is the
    looplm cache the model reads and writes. It has no transformers layers: ``update`` (per-
    layer key/value writes) is never called, the model writes through ``loop``."""

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.loop = LoopCache()

    def __repr__(self) -> str:
        return f"LoopLMCache(seq_length={self.get_seq_length()}, entries={len(self.loop.states)})"

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise NotImplementedError("LoopLMCache is written by the looplm model through .loop, not per layer")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.loop.get_seq_length()

    def get_max_length(self, layer_idx=None) -> int:
        return -1  # grows without a bound (the model's max_seq_len is checked by the model)

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
        self.loop = LoopCache()

    def _device(self, index: torch.Tensor) -> torch.device:
        return index.device if self.loop.valid is None else self.loop.valid.device
