"""Streams: what one macro step of the loop iterates.

| kind | macro step | block passes | source |
| --- | --- | --- | --- |
| single | h ← U(f(h), h) (the topology) | 1 | UT, MeSH, LT2 |
| two | H × (L × [Z ← f(X+Y+Z)], Y ← f(Y+Z)) | H·(L+1) | autoregressive-trm App. B.1 |
"""

from __future__ import annotations

from torch import nn

from looplm.streams.config import STREAMS_CONFIGS, StreamsConfig
from looplm.streams.single import CorePass, SingleStream, freeze
from looplm.streams.two import TwoStream


def build_streams(cfg: StreamsConfig, d_model: int) -> nn.Module:
    """The streams ``cfg`` describes, for states of width ``d_model``."""
    return cfg.build(d_model)


__all__ = ["CorePass", "STREAMS_CONFIGS", "SingleStream", "StreamsConfig", "TwoStream", "build_streams", "freeze"]
