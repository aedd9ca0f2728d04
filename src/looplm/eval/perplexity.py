"""Perplexity of named corpora, comparable across tokenizers (``looplm eval --corpus``).

Token perplexity depends on the tokenizer: a byte model predicts ~4x as many tokens as a
BPE model on the same text, each one easier. So every corpus is reported three ways from
the same summed negative log-likelihood L (nats, every token of every document scored
exactly once):

- token perplexity  exp(L / tokens)
- bits per byte     L / (ln 2 · UTF-8 bytes)       (tokenizer-free)
- word perplexity   exp(L / words), words split on whitespace (tokenizer-free)

as lm-evaluation-harness reports its ``loglikelihood_rolling`` tasks (WikiText, Pile).

Each document is scored on its own, conditioned on a leading end-of-document token (the
packer puts one before every document in training). A document longer than the window
is scored with a sliding window (Hugging Face's perplexity guide): windows of ``window``
input tokens start every ``stride`` tokens and score only the tokens the previous window
did not, so each token is scored once, with at least ``window - stride`` tokens of
context once the first window is full. ``stride = window`` is the disjoint split.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from looplm.config_base import ConfigError
from looplm.data import DataConfig, Tokenizer, data_tokenizer, iter_documents
from looplm.errors import LoopLMError
from looplm.eval.load import eval_data_config, load_run, set_step_embeddings
from looplm.eval.scoring import Window, score_windows

if TYPE_CHECKING:
    from looplm.model import LoopLM

#: windows scored per chunk of a corpus: bounds the token lists held in memory at once
_WINDOWS_PER_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class CorpusPerplexity:
    """Totals of one corpus; the three perplexities are derived from them."""

    name: str
    documents: int
    tokens: int
    bytes: int
    words: int
    nll: float  # Σ −log p over every token, nats

    @property
    def loss(self) -> float:
        """Mean negative log-likelihood per token (nats)."""
        return self.nll / self.tokens if self.tokens else math.nan

    @property
    def token_ppl(self) -> float:
        return _exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / (math.log(2) * self.bytes) if self.bytes else math.nan

    @property
    def word_ppl(self) -> float:
        return _exp(self.nll / self.words) if self.words else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "loss": self.loss, "token_ppl": self.token_ppl,
                "bits_per_byte": self.bits_per_byte, "word_ppl": self.word_ppl}


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else math.inf  # NaN stays NaN


def strided_windows(tokens: Sequence[int], prefix: int, window: int, stride: int) -> list[Window]:
    """Windows scoring each of ``tokens`` once, the first conditioned on ``prefix``.

    Over x = [prefix] + tokens, a window starting at b reads x[b : b + window] and scores
    the predictions not scored before it; b advances by ``stride`` (1 <= stride <= window).
    """
    _check_stride(stride, window)
    x = [prefix, *tokens]
    n = len(tokens)
    windows, done, begin = [], 0, 0  # done: tokens[:done] already scored
    while done < n:
        end = min(begin + window, n)  # reads x[begin:end], predicts x[begin + 1 : end + 1]
        windows.append(Window(tokens=x[begin : end + 1], scored=end - done))
        done, begin = end, begin + stride
    return windows


def corpus_perplexity(
    model: "LoopLM",
    tokenizer: Tokenizer,
    documents: Iterable[str],
    *,
    name: str = "corpus",
    window: Optional[int] = None,
    stride: Optional[int] = None,
    batch_size: int = 8,
    iterations: Optional[int] = None,
) -> CorpusPerplexity:
    """Score every document of ``documents``. window: input tokens per forward (default
    and maximum model.max_seq_len); stride: default ``window`` (disjoint windows)."""
    window = _window(model, window)
    stride = window if stride is None else _check_stride(stride, window)
    totals = {"documents": 0, "tokens": 0, "bytes": 0, "words": 0}
    nll = 0.0
    pending: list[Window] = []
    for text in documents:
        ids = tokenizer.encode(text)
        if not ids:
            continue
        totals["documents"] += 1
        totals["tokens"] += len(ids)
        totals["bytes"] += len(text.encode("utf-8"))
        totals["words"] += len(text.split())
        pending += strided_windows(ids, tokenizer.eos_id, window, stride)
        if len(pending) >= _WINDOWS_PER_CHUNK:
            nll -= sum(s.logprob for s in score_windows(model, pending, batch_size, iterations))
            pending = []
    nll -= sum(s.logprob for s in score_windows(model, pending, batch_size, iterations))
    return CorpusPerplexity(name=name, nll=nll, **totals)


def _window(model: "LoopLM", window: Optional[int]) -> int:
    limit = model.cfg.max_seq_len
    if window is None:
        return limit
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= limit:
        raise ConfigError("window", window, f"an integer in [1, model.max_seq_len={limit}]")
    return window


def _check_stride(stride: int, window: int) -> int:
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= window:
        raise ConfigError("stride", stride, f"an integer in [1, window={window}]")
    return stride


def parse_corpus(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (NAME, PATH); PATH is anything ``data.source`` accepts."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ConfigError("--corpus", spec, "NAME=PATH, e.g. wiki=data/wiki.txt (a .txt/.jsonl/.parquet file, "
                          "a folder of them, 'pydoc' or 'hf:NAME')")
    return name, path


def evaluate_corpora(
    path: str | Path,
    corpora: Mapping[str, str],
    *,
    overrides: Sequence[str] = (),
    window: Optional[int] = None,
    stride: Optional[int] = None,
    batch_size: int = 8,
    iterations: Optional[int] = None,
    step_embeddings: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Perplexities of a run on named corpora: {name: path} where path is anything
    ``data.source`` accepts (read with the run's data settings, ``data.key=value``
    overrides applied, e.g. ``data.text_field=body``), all with the run's tokenizer."""
    if not corpora:
        raise ConfigError("corpora", dict(corpora), "at least one NAME=PATH")
    run = load_run(path, verify=verify)
    set_step_embeddings(run.model, step_embeddings)
    window = _window(run.model, window)
    stride = window if stride is None else _check_stride(stride, window)
    data = eval_data_config(run.config.data, overrides)
    tokenizer = data_tokenizer(data)
    results = {}
    for name, source in corpora.items():
        fields = {**data.to_dict(), "source": source, "task": None}
        documents = _documents(name, DataConfig.from_dict(fields, prefix="data"))
        result = corpus_perplexity(run.model, tokenizer, documents, name=name, window=window,
                                   stride=stride, batch_size=batch_size, iterations=iterations)
        if result.documents == 0:
            raise LoopLMError(f"corpus {name!r} ({source}) has no text: every document is empty")
        results[name] = result.to_dict()
    return {"checkpoint": str(run.path), "window": window, "stride": stride, "corpora": results}


def _documents(name: str, data: DataConfig) -> Iterator[str]:
    """The documents of ``data.source``, with a source error saying which corpus it concerns."""
    try:
        yield from iter_documents(data)
    except ConfigError as err:
        raise LoopLMError(f"corpus {name!r}: {err}") from err
