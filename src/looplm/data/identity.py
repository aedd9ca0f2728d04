"""What identifies a run's tokens across machines, so that no run is resumed, or read back
into a study, on other data than it trained on.

A config names its data (``data.source``, ``data.tokenizer``), but the built-in corpora are
made from the running Python (pydoc's topics, the standard library's sources) and a
``bpe:N`` tokenizer is trained on the machine that first needs it: the same config can mean
other tokens on a machine with another Python. A training session records
:func:`data_identity` in its ``start`` / ``resume`` event
(:func:`looplm.train.metrics.recorded_data` reads it back); resuming, and a study reading a
finished run back, compare it with this machine's (:func:`refuse_other_data`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from looplm.config_base import ConfigError
from looplm.data.config import DataConfig
from looplm.data.source_kinds import BuiltinCorpus, TokenShards
from looplm.data.tokenizer import Tokenizer, tokenizer_identity

#: The fields of an identity, as the differences name them.
FIELDS = {"corpus": "the corpus", "tokenizer": "the tokenizer"}


def data_identity(cfg: DataConfig, tokenizer: Tokenizer) -> Optional[dict[str, Optional[str]]]:
    """``{"corpus", "tokenizer"}``: a digest of the corpus where looplm makes it (the built-in
    corpora: their documents; token shards: their files' checksums) and the sha256 of the
    tokenizer's files (a trained ``bpe:N`` or a path); None for a field looplm cannot tell
    cheaply (a dataset by name, local files, a task's generator, the byte tokenizer: fixed by
    the code), and None for the whole when it can tell neither."""
    identity = {"corpus": _corpus_digest(cfg), "tokenizer": tokenizer_identity(tokenizer)["sha256"]}
    return identity if any(identity.values()) else None


def data_differences(recorded: Optional[dict[str, Any]], current: Optional[dict[str, Any]]) -> list[str]:
    """``"the corpus: recorded X, here Y"`` for each field both identities know and disagree on
    (a run recorded before runs carried an identity, or a field unknown on one side, is not
    a difference)."""
    if not recorded or not current:
        return []
    return [f"{FIELDS[key]}: recorded {recorded[key]}, here {current[key]}" for key in FIELDS
            if recorded.get(key) is not None and current.get(key) is not None and recorded[key] != current[key]]


def refuse_other_data(run_dir: Path, data: DataConfig, recorded: Optional[dict[str, Any]],
                      current: Optional[dict[str, Any]], remedy: str) -> None:
    """Raise a ConfigError naming what differs when ``run_dir``'s sessions recorded other data
    (``recorded``) than this machine's (``current``); ``remedy`` says what to do instead."""
    differences = data_differences(recorded, current)
    if differences:
        raise ConfigError("data.source", data.source,
                          f"the data {run_dir} trained on, which differs here ({'; '.join(differences)}): {remedy}")


def _corpus_digest(cfg: DataConfig) -> Optional[str]:
    source = cfg.parsed_source
    if source == BuiltinCorpus("python-stdlib"):
        from looplm.data.stdlib import corpus_identity

        return corpus_identity()["fingerprint"]
    if source == BuiltinCorpus("pydoc"):
        from looplm.data.sources import iter_documents
        from looplm.data.split import texts_digest

        return texts_digest(iter_documents(cfg))
    if isinstance(source, TokenShards):
        from looplm.data.shards import read_manifest

        files = read_manifest(Path(source.directory).expanduser())["files"]
        return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:32]
    return None
