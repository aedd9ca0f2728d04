"""Functional sparse attention (plain PyTorch references): NSA (``nsa``) and DSA (``dsa``).

The mixers in ``looplm.mixers.nsa`` / ``looplm.mixers.dsa`` own the projections and the
decoding state; these functions take already projected, rotated tensors.
"""

from looplm.ops.sparse.common import gathered_attention, grouped_attention, masked_softmax, topk_indices, topk_mask
from looplm.ops.sparse.dsa import (
    dsa_attention,
    index_kl_loss,
    index_kl_sum,
    index_scores,
    select_key_indices,
    select_keys,
)
from looplm.ops.sparse.nsa import (
    compressed_block_count,
    naive_nsa_attention,
    nsa_attention,
    select_blocks,
    selection_overlap,
)

__all__ = [
    "compressed_block_count",
    "dsa_attention",
    "gathered_attention",
    "grouped_attention",
    "index_kl_loss",
    "index_kl_sum",
    "index_scores",
    "masked_softmax",
    "naive_nsa_attention",
    "nsa_attention",
    "select_blocks",
    "select_key_indices",
    "select_keys",
    "selection_overlap",
    "topk_indices",
    "topk_mask",
]
