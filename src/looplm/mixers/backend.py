"""Which implementation a linear mixer runs: flash-linear-attention's Triton kernels on
CUDA when the package is installed, else looplm's PyTorch ops. Chosen by the input's
device and fla's presence only (no environment variables), and logged once per mixer."""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

logger = logging.getLogger("looplm")


@functools.lru_cache(maxsize=None)
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def use_fla(x: torch.Tensor) -> bool:
    """True when ``x`` lives on a CUDA device and flash-linear-attention is importable."""
    return x.is_cuda and fla_installed()


@functools.lru_cache(maxsize=None)
def log_backend(mixer: str, backend: str) -> None:
    """Log the backend a mixer kind runs on, once per (mixer, backend) per process."""
    logger.info("mixer %s runs on the %s backend", mixer, backend)
