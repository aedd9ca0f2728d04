"""Shared fixtures for the data tests: small corpora on disk and a tiny trained tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests only ever load local files; never let datasets / huggingface_hub reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from data_helpers import make_documents


@pytest.fixture
def bpe_tokenizer_json(tmp_path: Path) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained on a few strings, with ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_documents(50) + ["hello world", "the quick brown fox"], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path
