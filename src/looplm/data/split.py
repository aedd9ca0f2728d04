"""Held-out validation split by document, decided by a stable hash of the document's text.

Hashing the text (not its position, not Python's salted ``hash()``) gives the same split
on every run and machine, for any reading order, shard layout or seed, and keeps exact
duplicates on the same side so validation never sees a copy of a training document.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence


def document_unit(text: str) -> float:
    """Map a document to a uniform number in [0, 1): blake2b-64 of its UTF-8 bytes / 2**64."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def texts_digest(texts: Iterable[str], extra: bytes = b"") -> str:
    """blake2b-128 hex of ``texts`` in order (each length-prefixed UTF-8, so no two lists
    collide), then ``extra``: the fingerprint of a list of documents."""
    h = hashlib.blake2b(digest_size=16)
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little") + data)
    h.update(extra)
    return h.hexdigest()


def is_validation(text: str, val_fraction: float) -> bool:
    """The hash rule: a document is held out iff its unit is below ``val_fraction``."""
    return document_unit(text) < val_fraction


def split_documents(units: Sequence[float], lengths: Sequence[int], val_fraction: float, window: int) -> list[bool]:
    """Which documents are held out, for a corpus known in full.

    ``units[i]`` is :func:`document_unit` of document i and ``lengths[i]`` its token count
    (eos included). First the hash rule. Then, if ``val_fraction > 0`` but the held-out
    documents hold fewer than ``window`` tokens (no validation window: a tiny corpus),
    further documents are held out in increasing order of their unit until validation
    holds one window, stopping before the training split would drop below one window.
    The result depends only on the texts, ``val_fraction`` and ``window``, never on order.
    """
    held = [u < val_fraction for u in units]
    if val_fraction <= 0.0:
        return held
    val_tokens = sum(n for n, h in zip(lengths, held) if h)
    train_tokens = sum(lengths) - val_tokens
    # Documents with equal units (duplicates) move together, so they stay on one side.
    groups: dict[float, list[int]] = {}
    for i, (u, h) in enumerate(zip(units, held)):
        if not h:
            groups.setdefault(u, []).append(i)
    for unit in sorted(groups):
        size = sum(lengths[i] for i in groups[unit])
        if val_tokens >= window or train_tokens - size < window:
            break
        for i in groups[unit]:
            held[i] = True
        val_tokens += size
        train_tokens -= size
    return held
