"""FSDP2 (``torch.distributed.fsdp.fully_shard``), applied by the trainer from outside the model.

``train.parallel=fsdp`` shards every parameter, its gradient and its optimiser state
across the data-parallel ranks (dim 0 of each tensor, as ``DTensor``); a unit's
parameters are all-gathered just before it runs and its gradients reduce-scattered after
its backward. The model code stays single-device: this module only groups modules into
units, bottom-up, in one place:

- every prelude and coda block is one unit (resharded after its forward, re-gathered in
  the backward: peak memory holds one such block unsharded at a time);
- the shared looped core (``model.core[0]``, all its blocks together) is one unit however
  many times it loops, with ``reshard_after_forward=False``: the loop runs it T times per
  forward, so resharding after each pass would all-gather the same weights again for
  every pass; kept gathered, the forward gathers the core once (measured for T = 3: 3
  all-gathers per step instead of 7), at the memory cost of the unsharded core, which
  every iteration needs anyway. In the backward FSDP2 runs one post-backward per module
  call: after each pass's backward the core's gradient is reduce-scattered (summed into
  the sharded gradient) and the core resharded, and the previous pass gathers it again,
  so a step costs T reduce-scatters and T - 1 backward all-gathers of the core. Without
  sharing (``model.share_core=false``) each iteration has its own stack, run once, so
  each of those blocks is an ordinary unit;
- the experts of a mixture-of-experts FFN (``model.moe``: its router and expert weights,
  most of a block's parameters) are a unit of their own inside their block's unit, first:
  a block gathers its attention and its experts separately, and a core with one expert set
  per iteration gathers each set only for its iteration (resharded after its forward), while
  the loop keeps the shared core's other weights gathered. Experts shared by a shared core
  run every iteration and are kept gathered like it;
- the root (``model`` itself) last: embedding, head (tied or not), final norm and every
  loop-level part the recurrence calls between core passes (topology and MeSH routers,
  step embeddings, streams, halting, resolution scalers). FSDP2 keeps the root gathered
  from forward to backward.

Mixed precision (``train.fsdp_precision``): ``bf16`` casts the gathered parameters to
bf16 for compute and communication and reduces gradients in fp32
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); ``fp32`` keeps fp32
throughout. The sharded master weights and AdamW state are fp32 in both.

Parameters stay registered under the same names (FSDP2 swaps them in place), so state
dicts, parameter counts, SGT's growth hooks and the activation-checkpointing seam see
the same model; checkpoints go through :mod:`looplm.train.sharded_checkpoint`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from looplm.config_base import ConfigError
from looplm.model import LoopLM
from looplm.modules.moe import MoE


def mixed_precision(fsdp_precision: str, autocast_dtype: Optional[torch.dtype]):
    """The ``MixedPrecisionPolicy`` for ``train.fsdp_precision`` (``auto`` follows the run's
    autocast dtype: bf16 when training autocasts to bf16, else fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = fsdp_precision == "bf16" or (fsdp_precision == "auto" and autocast_dtype == torch.bfloat16)
    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def units(model: LoopLM) -> list[tuple[list[nn.Module], bool]]:
    """The FSDP units below the root, bottom-up: (modules grouped in one unit,
    reshard_after_forward). See the module docstring for why the shared core is one
    unit kept gathered."""
    groups: list[tuple[list[nn.Module], bool]] = _expert_units(model)
    groups += [([block], True) for block in model.prelude]
    if model.cfg.structure.shared:
        groups += [(list(stack), False) for stack in model.core if len(stack)]
    else:
        groups += [([block], True) for stack in model.core for block in stack]
    groups += [([block], True) for block in model.coda]
    return groups


def _expert_units(model: LoopLM) -> list[tuple[list[nn.Module], bool]]:
    """One unit per mixture-of-experts FFN (per expert set), kept gathered only when a
    shared core runs the same set every iteration."""
    groups = []
    for part, blocks in (("prelude", model.prelude), ("core", [b for stack in model.core for b in stack]),
                         ("coda", model.coda)):
        kept = part == "core" and model.cfg.structure.shared and model.cfg.ffn_sets("core") == 1
        groups += [([ffn], not kept) for block in blocks for ffn in block.ffn_layers() if isinstance(ffn, MoE)]
    return groups


def apply_fsdp(model: LoopLM, *, fsdp_precision: str, autocast_dtype: Optional[torch.dtype],
               world_size: int) -> LoopLM:
    """Shard ``model`` in place across the default process group (one unit per block, the
    shared core one unit, the root last); returns the same object, now an FSDP module.
    Call after activation checkpointing is set and before the optimiser is built (the
    optimiser must hold the sharded parameters)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()) or world_size < 2:
        raise ConfigError(
            "train.parallel", "fsdp",
            "auto or ddp in a single process: FSDP2 shards the model across ranks, so launch with "
            "torchrun --nproc_per_node=N (N >= 2), or drop train.parallel=fsdp for a one-process run",
        )
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (world_size,))
    policy = mixed_precision(fsdp_precision, autocast_dtype)
    for modules, reshard in units(model):
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, reshard_after_forward=reshard,
                    mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` has been sharded by :func:`apply_fsdp` (FSDP2 swaps its class)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
