"""Cross-loop logit lens: next-token loss and accuracy read out after every iteration.

The readout of state h^(t) is the model's own: its coda blocks, final norm and LM head,
run on h^(t) in place of the state the loop hands the coda (the natural lens of a
prelude–core–coda model, whose coda is trained to read loop states). A second, "direct"
readout skips the coda (final norm and head only), the classic transformer logit lens.
For topologies whose readout is the last state (every one so far), the coda readout of
h^(T) is the model's own output, which the tests check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from looplm.model import IGNORE_INDEX
from looplm.probes import plots
from looplm.probes.base import ProbeInput, ProbeReport, register, tolist
from looplm.probes.capture import read_out


def token_loss_and_correct(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, int, int]:
    """Summed cross-entropy, correct argmax predictions and counted targets (!= -100)."""
    flat, tgt = logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    keep = tgt != IGNORE_INDEX
    loss = F.cross_entropy(flat[keep], tgt[keep], reduction="sum")
    correct = (flat[keep].argmax(dim=-1) == tgt[keep]).sum()
    return float(loss), int(correct), int(keep.sum())


@register("logit_lens", "cross-loop logit lens: loss and accuracy of every loop state through coda, norm and head")
@torch.no_grad()
def logit_lens(probe: ProbeInput) -> ProbeReport:
    probe.require_loop("logit_lens")
    model = probe.model
    totals: dict = {}
    model_total = [0.0, 0, 0]
    for cap in probe.forward(states=True):
        for t, h in enumerate(cap.output.states):
            for name, logits in (("coda", read_out(model, cap, h)), ("direct", model.head(model.norm(h)))):
                acc = totals.setdefault((name, t), [0.0, 0, 0])
                for i, v in enumerate(token_loss_and_correct(logits, cap.targets)):
                    acc[i] += v
        for i, v in enumerate(token_loss_and_correct(cap.output.logits, cap.targets)):
            model_total[i] += v
    n_states = 1 + max(t for _, t in totals)
    result: dict = {"states": [f"h^({t})" for t in range(n_states)], "tokens": model_total[2]}
    for name in ("coda", "direct"):
        result[name] = {
            "loss": [totals[(name, t)][0] / totals[(name, t)][2] for t in range(n_states)],
            "accuracy": [totals[(name, t)][1] / totals[(name, t)][2] for t in range(n_states)],
        }
    result["model"] = {"loss": model_total[0] / model_total[2], "accuracy": model_total[1] / model_total[2]}
    result["readout"] = "coda: h^(t) -> coda blocks -> final norm -> head; direct: h^(t) -> final norm -> head"
    x = list(range(n_states))
    return ProbeReport(tolist(result), {"logit_lens": lambda plt: plots.lens(plt, x, result)})
