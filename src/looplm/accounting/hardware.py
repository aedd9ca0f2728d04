"""Peak FLOP/s of common accelerators and model-FLOPs utilisation (MFU, PaLM App. B).

Dense (no structured sparsity) tensor-core peaks from the vendors' data sheets, per
device, by a substring of ``torch.cuda.get_device_name``. fp32 means plain FP32 (not
TF32). CPU: unknown, MFU omitted.
"""

from __future__ import annotations

from typing import Optional

import torch

#: name substring -> {dtype: peak FLOP/s}; the first matching entry wins (more specific first)
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM
    "GH200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "fp32": 80e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "A800": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "fp32": 31.2e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12},
    "RTX 3090": {"bf16": 71e12, "fp16": 71e12, "fp32": 35.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def peak_flops(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """Peak FLOP/s of a device called ``device_name`` in ``dtype``, or None if unknown."""
    key = _DTYPES.get(dtype)
    for name, peaks in PEAK_FLOPS.items():
        if name.lower() in device_name.lower():
            return peaks.get(key)
    return None


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """Peak FLOP/s of ``device`` (CUDA only; None on CPU or an unknown GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops(torch.cuda.get_device_name(device), dtype)


def mfu(flops_per_token: float, tokens_per_second: float, peak: Optional[float], devices: int = 1) -> Optional[float]:
    """Achieved model FLOP/s over the devices' peak; None when the peak is unknown."""
    if not peak:
        return None
    return flops_per_token * tokens_per_second / (peak * devices)
