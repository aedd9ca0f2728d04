"""AdamW with two parameter groups: weight decay on matrices, none on gains, biases and gates."""

from __future__ import annotations

import torch
from torch import nn

from looplm.train.config import TrainConfig

#: Modules whose ``weight`` is a matrix that weight decay should pull towards zero.
DECAYED_MODULES = (nn.Linear, nn.Embedding)


def split_decay(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """``(decay, no_decay)``: trainable parameters by name, each shared tensor once.

    A parameter decays when it is the ``weight`` of an ``nn.Linear`` or ``nn.Embedding``
    (projections, embeddings, the head, MeSH and dynamic-combination routers). Everything
    else does not: norm gains, biases and parameters a module owns directly, such as the
    topology's per-iteration gates ρ and mixing coefficients α (2-D in shape, but
    interpolation weights whose natural value is not 0). Deciding by module type rather
    than by ``ndim`` keeps those gates out of decay. A tied embedding/head matrix is
    listed once, under its first name (``embed.weight``).
    """
    decayed = {id(m.weight) for m in model.modules() if isinstance(m, DECAYED_MODULES)}
    decay, no_decay = {}, {}
    for name, param in model.named_parameters():  # named_parameters yields a shared tensor once
        if not param.requires_grad:
            continue
        (decay if id(param) in decayed else no_decay)[name] = param
    return decay, no_decay


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW(betas=(beta1, beta2), eps) with group 0 ``decay`` (weight_decay) and group 1
    ``no_decay`` (0, or weight_decay too when ``decay_norms_and_biases``).

    The learning rate is a placeholder: the trainer sets every group's ``lr`` from
    :func:`looplm.train.schedule.lr_at` before each step. The fused kernel (one launch for
    every parameter) is used when every parameter is a plain tensor on CUDA or the CPU; it
    also skips a step on the device (``found_inf``, :meth:`Trainer._train_step`). Sharded
    (DTensor) parameters keep the foreach kernels.
    """
    decay, no_decay = split_decay(model)
    params = [*decay.values(), *no_decay.values()]
    if not params:
        raise ValueError("the model has no trainable parameters")
    groups = [
        {"params": list(decay.values()), "param_names": list(decay), "weight_decay": cfg.weight_decay},
        {
            "params": list(no_decay.values()),
            "param_names": list(no_decay),
            "weight_decay": cfg.weight_decay if cfg.decay_norms_and_biases else 0.0,
        },
    ]
    fused = all(not hasattr(p, "placements") and p.device.type in ("cuda", "cpu") for p in params) or None  # no DTensor
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
