"""Which implementation a linear mixer runs: flash-linear-attention's Triton kernels on
CUDA when the package is installed, else looplm's PyTorch ops. Chosen by the input's
device and fla's presence only (no environment variables), and logged once per mixer."""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

logger = logging.getLogger("looplm")


_FLA: list[bool] = []  # the answer, once looked up (a plain global Dynamo reads as a constant)


def fla_installed() -> bool:
    """Whether flash-linear-attention is importable (looked up once: an eager forward asks
    before a captured decoding step does, so Dynamo never traces the import machinery)."""
    if not _FLA:
        _FLA.append(importlib.util.find_spec("fla") is not None)
    return _FLA[0]


def use_fla(x: torch.Tensor, gated: bool = False) -> bool:
    """True when ``x`` lives on a CUDA device and flash-linear-attention is importable.

    ``gated``: the op has a decay gate and may be differentiated. fla refuses the backward
    of gated chunk kernels on Hopper with Triton >= 3.4.0 and < 3.7.1 (wrong results, fla
    issue #640) unless tilelang is installed; there the op stays on PyTorch while grad is
    enabled (inference still runs fla's kernels)."""
    if not (x.is_cuda and fla_installed()):
        return False
    if gated and torch.is_grad_enabled() and not fla_gated_backward_ok(x.device):
        log_backend("gated ops", "torch (fla's gated backward is unsafe on Hopper with this Triton)")
        return False
    return True


@functools.lru_cache(maxsize=None)
def fla_gated_backward_ok(device: torch.device) -> bool:
    import triton

    return gated_backward_supported(torch.cuda.get_device_capability(device)[0], triton.__version__,
                                    importlib.util.find_spec("tilelang") is not None)


def gated_backward_supported(sm_major: int, triton_version: str, tilelang: bool) -> bool:
    """False where fla raises in the gated backward: Hopper (sm 9.x), 3.4.0 <= Triton < 3.7.1,
    tilelang not installed."""
    numbers = []
    for part in triton_version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        numbers.append(int(digits or 0))
    buggy = (3, 4, 0) <= tuple(numbers) < (3, 7, 1)
    return not (sm_major == 9 and buggy and not tilelang)


def log_backend(mixer: str, backend: str) -> None:
    """Log the backend a mixer kind runs on, once per (mixer, backend) per process. Not
    while torch.compile traces: Dynamo sees through the cache, and a logging call breaks the
    graph at every mixer call (an eager forward, or the trainer's evaluation, logs it)."""
    if not torch.compiler.is_compiling():
        _log_backend_once(mixer, backend)


@functools.lru_cache(maxsize=None)
def _log_backend_once(mixer: str, backend: str) -> None:
    logger.info("mixer %s runs on the %s backend", mixer, backend)


log_backend.cache_clear = _log_backend_once.cache_clear  # forget what was logged (tests check the line)
