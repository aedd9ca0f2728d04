"""LT2's unrolled diagnostics (lt2.txt §4.4, "attention sinks and the SDPA output gate").

Along the unrolled computation (prelude → core block j of loop t → coda), per block:

* first-token attention mass: the softmax probability the queries give key 0, averaged
  over heads, samples and queries q ≥ 1 (query 0 can only attend to itself);
* maximum residual activation: max |h| of the block's output residual stream (after the
  FFN residual), per sample, averaged over samples (and the overall maximum);
* residual RMS norm: sqrt(mean_d h²) of the block's output, averaged over tokens and samples.

Block outputs come from a forward hook on every block; the attention from the model's
``output_attentions``.
"""

from __future__ import annotations

import torch

from looplm.probes import plots
from looplm.probes.base import ProbeInput, ProbeReport, register, tolist


def first_token_mass(attn: torch.Tensor) -> torch.Tensor:
    """Mean probability on key 0 over heads and queries q ≥ 1. attn: [B, H, T, S] -> [B]."""
    T, S = attn.shape[-2:]
    a = attn[..., :, 0].double()  # [B, H, T]
    if S - T == 0 and T > 1:  # no cache: query 0 is key 0 and sees only itself
        a = a[..., 1:]
    return a.mean(dim=(1, 2))


def max_activation(h: torch.Tensor) -> torch.Tensor:
    """max |h| per sample. h: [B, T, d] -> [B]."""
    return h.double().abs().flatten(1).max(dim=1).values


def rms_norm(h: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of sqrt(mean_d h²) per sample. h: [B, T, d] -> [B]."""
    return h.double().pow(2).mean(dim=-1).sqrt().mean(dim=-1)


@register("unrolled_diagnostics", "LT2 §4.4 figure 'loop_sink_and_massact': first-token mass, max activation, RMS norm")
def unrolled_diagnostics(probe: ProbeInput) -> ProbeReport:
    sums: dict = {}
    peak: dict = {}
    order: list = []
    count = 0
    for cap in probe.forward(attentions=True, blocks=True):
        for call in cap.blocks:
            loc = call.location
            if loc not in sums:
                order.append(loc)
                sums[loc] = torch.zeros(3, dtype=torch.float64)
            attn = cap.output.attentions.get(loc)
            mass = first_token_mass(attn).sum() if attn is not None else torch.tensor(float("nan"))
            sums[loc] += torch.stack([mass.double(), max_activation(call.output).sum(), rms_norm(call.output).sum()])
            peak[loc] = max(peak.get(loc, 0.0), float(max_activation(call.output).max()))
        count += cap.inputs.shape[0]
    labels = [f"{b}@{t}" if b.startswith("core") else b for b, t in order]
    table = torch.stack([sums[loc] / count for loc in order])  # [unrolled, 3]
    loop_starts = [i for i, (b, t) in enumerate(order) if b == "core.0"]
    numbers = {
        "samples": count, "unrolled": labels, "loop_starts": loop_starts,
        "first_token_mass": tolist(table[:, 0]), "max_activation": tolist(table[:, 1]),
        "max_activation_overall": [round(peak[loc], 6) for loc in order], "rms_norm": tolist(table[:, 2]),
        "note": "first_token_mass is null for blocks whose mixer has no softmax probabilities",
    }
    series = {"first-token attention mass": table[:, 0], "max |residual| (log)": table[:, 1],
              "residual RMS norm": table[:, 2]}
    return ProbeReport(numbers, {"unrolled_diagnostics": lambda plt: plots.panels(
        plt, labels, series, loop_starts, "Unrolled diagnostics (LT2 §4.4)", log_panels=("max |residual| (log)",))})
