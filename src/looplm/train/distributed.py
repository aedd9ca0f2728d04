"""Process-group setup for ``torchrun`` (PyTorch's own DDP, nothing home-made), and
:class:`Ranks`, the one place the trainer asks which rank it is."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in the data-parallel group: every rank decision of the
    trainer reads it (rank 0 writes files and logs; under FSDP every rank takes part in
    forwards and saves), so none re-asks torch.distributed."""

    rank: int = 0
    world_size: int = 1
    distributed: bool = False

    @classmethod
    def current(cls) -> "Ranks":
        """This process's place in the initialised process group, or a single process."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), True)
        return cls()

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes metrics, summaries and (unsharded) checkpoints."""
        return self.rank == 0

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` over the ranks in place (one all-reduce; nothing in one process)."""
        if self.distributed:
            dist.all_reduce(tensor)
            tensor /= self.world_size
        return tensor

    def barrier(self) -> None:
        """Wait for every rank (nothing in one process)."""
        if self.distributed:
            dist.barrier()
