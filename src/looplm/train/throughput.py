"""Throughput and MFU of a run: tokens per second over the log window and the session,
and the model FLOPs per token they are turned into MFU with.

A step's time is its own work plus the wait of a read-back (:meth:`Trainer.fit`); the
FLOPs per token are those of the unrolled computation (:mod:`looplm.accounting`,
``default`` convention), counted on first use and again, explicitly, when the structure
changes (SGT growth calls :meth:`Throughput.recount` with the grown model).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch
from torch import nn

logger = logging.getLogger("looplm")


class Throughput:
    """Tokens and seconds of a run's steps, and its model FLOPs per token.

    subject: what the FLOPs are counted from (a model config, or the model when its
    structure changes while training); seq_len: the training sequence length; dtype: the
    compute dtype the device's peak is looked up for; world_size: the data-parallel ranks."""

    def __init__(self, subject: Union[Any, nn.Module], seq_len: int, device: torch.device, dtype: torch.dtype,
                 world_size: int):
        self.subject, self.seq_len = subject, seq_len
        self.device, self.dtype, self.world_size = device, dtype, world_size
        self._per_token: Optional[float] = None
        self._counted = False
        self.session_tokens, self.session_time = 0, 0.0
        self.window_tokens, self.window_time = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """One step of ``tokens`` tokens (all ranks) that took ``seconds``."""
        self.session_tokens, self.session_time = self.session_tokens + tokens, self.session_time + seconds
        self.window_tokens, self.window_time = self.window_tokens + tokens, self.window_time + seconds

    def window_rate(self) -> float:
        """Tokens per second since the last logged step (0 when no time was measured)."""
        return self.window_tokens / self.window_time if self.window_time > 0 else 0.0

    def reset_window(self) -> None:
        self.window_tokens, self.window_time = 0, 0.0

    def session_rate(self) -> Optional[float]:
        """Tokens per second of this process's steps (None before any)."""
        return self.session_tokens / self.session_time if self.session_time > 0 else None

    @property
    def per_token(self) -> Optional[float]:
        """Training FLOPs per token; None for a mechanism without a FLOP rule."""
        if not self._counted:
            self.recount(self.subject)
        return self._per_token

    def recount(self, subject: Union[Any, nn.Module]) -> None:
        """Count the FLOPs per token of ``subject`` now (the structure it has changed)."""
        from looplm.accounting import count_flops

        self.subject, self._counted = subject, True
        try:
            self._per_token = count_flops(subject, self.seq_len).training_per_token
        except Exception as err:  # a mechanism without a FLOP rule yet: report none, never fail the run
            logger.warning("model FLOPs not counted: %s", err)
            self._per_token = None

    def model_flops(self, tokens_per_s: Optional[float]) -> dict[str, Any]:
        """Model FLOPs per token and MFU against the device's peak (None where unknown)."""
        from looplm.accounting import device_peak_flops, mfu

        per_token = self.per_token
        if per_token is None:
            return {"model_flops_per_token": None, "mfu": None}
        peak = device_peak_flops(self.device, self.dtype)
        return {"model_flops_per_token": per_token,
                "mfu": None if tokens_per_s is None else mfu(per_token, tokens_per_s, peak, self.world_size)}
