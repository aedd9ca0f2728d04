"""A run's tokenizer as a transformers tokenizer (``AutoTokenizer.from_pretrained(OUT)``).

looplm's byte tokenizer (UTF-8 bytes 0..255, end-of-document 256) becomes a ``tokenizers``
byte-level tokenizer: every byte is its own token with the same id, no merges, so
``encode``/``decode`` agree with :class:`~looplm.data.tokenizer.ByteTokenizer` exactly. A
run trained with a ``tokenizers`` JSON or a transformers tokenizer directory is saved as
that tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from looplm.config_base import ConfigError
from looplm.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

EOS_TOKEN = "<|endoftext|>"


def _byte_chars() -> list[str]:
    """The printable character standing for each byte in byte-level vocabularies (GPT-2's
    table: printable Latin-1 bytes are themselves, the others shift to code points 256+)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], shifted = chr(256 + shifted), shifted + 1
    return [chars[b] for b in range(256)]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """:class:`ByteTokenizer` as a fast transformers tokenizer: ids 0..255 the bytes,
    256 ``<|endoftext|>`` (eos and pad)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    vocab = {char: b for b, char in enumerate(_byte_chars())}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])  # the next id: 256, ByteTokenizer.eos_id
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def transformers_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer of a run's tokenizer (:func:`looplm.data.data_tokenizer`)."""
    if isinstance(tokenizer, ByteTokenizer):
        return byte_tokenizer()
    if isinstance(tokenizer, HFTokenizer):
        path = Path(tokenizer.name)
        if path.is_dir():
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        vocab_tokens = {i: t for t, i in PreTrainedTokenizerFast(tokenizer_file=str(path)).get_vocab().items()}
        return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=vocab_tokens[tokenizer.eos_id],
                                       pad_token=vocab_tokens[tokenizer.pad_id])
    raise ConfigError("data.tokenizer", tokenizer.name,
                      "'byte', a tokenizer.json or a transformers tokenizer directory: a task's own vocabulary "
                      "(data.source=task:NAME) has no transformers form yet")
