"""Which implementation an op runs. A linear mixer: flash-linear-attention's Triton kernels
on CUDA when the package is installed, else looplm's PyTorch ops, chosen by the input's
device and fla's presence (no environment variables) and, where fla refuses a gated
backward, by a check of fla's kernels on the device (:mod:`looplm.ops.fla_hopper`); logged
once per mixer. looplm's own Triton kernels (DSA's selected-key attention, MeSH's
write-read): by a ``kernel`` setting (:data:`KERNELS`), on CUDA by default."""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Optional

import torch

from looplm.ops.fla_hopper import GatedOp, verified_backward

logger = logging.getLogger("looplm")


#: where looplm's own Triton kernels run: "auto" (CUDA when triton is installed, the PyTorch
#: reference elsewhere), "torch" (the reference everywhere, e.g. to rule a kernel out),
#: "triton" (the kernel everywhere; CPU tensors only under TRITON_INTERPRET=1, for tests)
KERNELS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor, kernel: str) -> bool:
    """Whether an op with a looplm Triton kernel runs it on ``x`` under setting ``kernel``."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
    return kernel == "triton" or (kernel == "auto" and x.is_cuda and triton_installed())


_FLA: list[bool] = []  # the answer, once looked up (a plain global Dynamo reads as a constant)


def fla_installed() -> bool:
    """Whether flash-linear-attention is importable (looked up once: an eager forward asks
    before a captured decoding step does, so Dynamo never traces the import machinery)."""
    if not _FLA:
        _FLA.append(importlib.util.find_spec("fla") is not None)
    return _FLA[0]


def use_fla(x: torch.Tensor, gated: Optional[GatedOp] = None) -> bool:
    """True when ``x`` lives on a CUDA device and flash-linear-attention is importable.

    ``gated``: the op has a decay gate (which op, :class:`~looplm.ops.fla_hopper.GatedOp`)
    and may be differentiated. Where fla refuses the gated backward (Hopper with Triton >=
    3.4.0 and < 3.7.1, no tilelang: fla issue #640) the op trains on fla only once fla's
    kernels, at tiles that avoid the compiler bug, passed a check against the PyTorch op on
    this device (:mod:`looplm.ops.fla_hopper`); otherwise it trains on PyTorch while grad
    is enabled (inference still runs fla's kernels)."""
    if not (x.is_cuda and fla_installed()):
        return False
    if gated is not None and torch.is_grad_enabled() and not fla_gated_backward_ok(x.device, gated, x.dtype):
        log_backend("gated ops", "torch (fla's gated backward failed its check on this GPU and Triton)")
        return False
    return True


def fla_gated_backward_ok(device: torch.device, op: Optional[GatedOp] = None,
                          dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether gated op ``op`` trains on fla on ``device``: wherever fla's own guard allows it,
    else when :func:`~looplm.ops.fla_hopper.verified_backward` passed (``op`` None: whether
    fla's guard allows every gated backward here)."""
    if fla_guard_allows(device):
        return True
    return op is not None and verified_backward(op, device, dtype)


_GUARD: dict[str, bool] = {}  # device -> fla's guard allows gated backward (a plain dict Dynamo reads as a constant)


def fla_guard_allows(device: torch.device) -> bool:
    """Whether fla's own guard lets its gated backward run on ``device`` (looked up once per device)."""
    key = str(device)
    if key not in _GUARD:
        import triton

        _GUARD[key] = gated_backward_supported(torch.cuda.get_device_capability(device)[0], triton.__version__,
                                               importlib.util.find_spec("tilelang") is not None)
    return _GUARD[key]


def check_before_compile(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> dict[GatedOp, bool]:
    """Reach the verdict of every gated op ``model``'s layers train through (their
    ``gated_op()``, :mod:`looplm.ops.fla_hopper`) before torch.compile traces it: a trace
    cannot run the check, and an op without a verdict would train on PyTorch for the whole
    run. ``dtype``: what the ops see (the autocast dtype, else the parameters'). Only where a
    verdict is needed (CUDA, fla installed, fla's own guard refusing the gated backward);
    returns the verdicts reached."""
    if device.type != "cuda" or not fla_installed() or fla_guard_allows(device):
        return {}
    ops = {module.gated_op() for module in model.modules() if callable(getattr(module, "gated_op", None))}
    return {op: verified_backward(op, device, dtype) for op in sorted(ops - {None})}


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
