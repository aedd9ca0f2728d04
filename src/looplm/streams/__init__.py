"""Streams: what one macro step of the loop iterates.

| kind | macro step | block passes | source |
| --- | --- | --- | --- |
| single | h ← U(f(h), h) (the topology) | 1 | UT, MeSH, LT2 |
| two | H × (L × [Z ← f(X+Y+Z)], Y ← f(Y+Z)) | H·(L+1) | autoregressive-trm App. B.1 |
"""

from __future__ import annotations

from torch import nn

from looplm.streams.config import StreamsConfig
from looplm.streams.single import CorePass, SingleStream, freeze
from looplm.streams.two import TwoStream


def build_streams(cfg: StreamsConfig, d_model: int) -> nn.Module:
    if cfg.kind == "two":
        return TwoStream(d_model, cfg.outer, cfg.inner, cfg.init == "learned", cfg.no_grad_cycles)
    return SingleStream()


__all__ = ["CorePass", "SingleStream", "StreamsConfig", "TwoStream", "build_streams", "freeze"]
