"""Process-group setup for ``torchrun``: PyTorch's own DDP, nothing home-made."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def process_group_from_env() -> Iterator[None]:
    """Initialise torch.distributed when launched with WORLD_SIZE > 1 (torchrun sets it;
    NCCL on CUDA, Gloo on CPU) and tear it down afterwards; otherwise do nothing."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        yield
        return
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()
