"""Helpers for the data tests (a uniquely named module: other test folders have their own conftest)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "loop state core prelude coda token window batch epoch resume shard stream query key value".split()


def make_documents(count: int, seed: int = 0, min_words: int = 3, max_words: int = 40) -> list[str]:
    """Distinct, deterministic documents of varying length (with some non-ASCII text)."""
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
        docs.append(f"doc {i} ü: " + " ".join(words))
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "n": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path
