"""LT2's per-loop logit distillation (lt2.txt §5, Eq. kd-loss) and its schedules.

    L_KD = Σ_τ w_t^(τ) · KL( σ_top-k(z_T^(τ) / T_kd) ‖ σ_top-k(z_S^(τ) / T_kd) )

σ_top-k "renormalises the softmax over the teacher's top-k tokens": both distributions are
softmaxes over the same k vocabulary entries, the teacher's k largest logits at that
position. The KL is averaged over positions (those whose target is not -100) and, with
``scale_t2``, multiplied by T_kd² (Hinton et al. 2015: the soft-target gradients scale as
1/T_kd², so this keeps the loss scale independent of the temperature; the paper does not
say, this is looplm's choice). w_t ∈ Δ^{T-1} is the loop weighting at optimiser step t
(:func:`loop_weights`)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from looplm.targets import IGNORE_INDEX


def topk_kl(teacher: torch.Tensor, student: torch.Tensor, top_k: int, temperature: float,
            targets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean over positions of KL(σ_top-k(z_T/T_kd) ‖ σ_top-k(z_S/T_kd)).

    teacher, student: logits [B, L, V]; the top-k set is the teacher's k largest logits per
    position (k capped at V). targets [B, L]: positions equal to -100 are left out."""
    k = min(top_k, teacher.shape[-1])
    t_top, index = teacher.float().topk(k, dim=-1)  # [B, L, k]
    s_top = student.float().gather(-1, index)
    log_p = F.log_softmax(t_top / temperature, dim=-1)
    log_q = F.log_softmax(s_top / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [B, L]
    if targets is None:
        return kl.mean()
    keep = targets != IGNORE_INDEX
    return (kl * keep).sum() / keep.sum().clamp(min=1)


def loop_weights(step: int, total_steps: int, loops: int, schedule: str, warmup_fraction: float,
                 uniform_fraction: float) -> list[float]:
    """w_t over the loops τ = 1..T at (0-based) step ``step`` of ``total_steps``.

    ``final``: one-hot on the last loop throughout. ``per_loop`` (the paper: "we progressively
    warm up the loop-level supervision, set uniform weights ... for half of the training
    steps, and then switch to final-output supervision only"): with W = warmup_fraction·S
    and U = uniform_fraction·S steps,

    * t < W: w = (1 − t/W)·e_T + (t/W)·u, the earlier loops' share rising linearly from 0;
    * W ≤ t < W + U: w = u = (1/T, ..., 1/T);
    * t ≥ W + U: w = e_T.
    """
    final = [0.0] * (loops - 1) + [1.0]
    if schedule == "final" or loops == 1:
        return final
    warm, uniform = warmup_fraction * total_steps, uniform_fraction * total_steps
    if step < warm:
        a = step / warm
        return [a / loops + (1 - a) * f for f in final]
    if step < warm + uniform:
        return [1.0 / loops] * loops
    return final


def readout_loops(model) -> int:
    """The loop states a KD loss reads out of ``model`` (a LoopLM): the layout's T, one for a
    model without a loop."""
    return model.cfg.iterations if model.topology is not None else 1


def kd_loss(teacher: Sequence[torch.Tensor], student: Sequence[torch.Tensor], weights: Sequence[float], top_k: int,
            temperature: float, scale_t2: bool, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Σ_τ w^(τ) · topk_kl(z_T^(τ), z_S^(τ)) (Eq. kd-loss), times T_kd² with ``scale_t2``;
    loops with zero weight are not computed."""
    if not (len(teacher) == len(student) == len(weights)):
        raise ValueError(f"{len(teacher)} teacher loops, {len(student)} student loops, {len(weights)} weights")
    terms = [w * topk_kl(t, s, top_k, temperature, targets)
             for t, s, w in zip(teacher, student, weights) if w > 0]
    loss = torch.stack(terms).sum()
    return loss * temperature ** 2 if scale_t2 else loss


def length_at(step: int, total_steps: int, lengths: Sequence[int]) -> int:
    """Progressive length expansion: stage 2's steps split into len(lengths) equal phases,
    phase p training on sequences of lengths[p]."""
    phase = min(step * len(lengths) // max(total_steps, 1), len(lengths) - 1)
    return lengths[phase]


def split_length(x: torch.Tensor, length: int) -> torch.Tensor:
    """[B, S] -> [B·S/length, length]: each window cut into consecutive pieces, so every
    step trains on the same tokens whatever its length."""
    B, S = x.shape
    return x.reshape(B * (S // length), length)
