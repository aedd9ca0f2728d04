"""Attention probes of SpiralFormer (spiralformer.txt §4.1, Appendix I) and the Sparse
Growing Transformer (sparse-growing-transformer.txt §2, §3, §5.4).

All read the softmax probabilities the model returns with ``output_attentions=True``
([B, H, T, S] per (block, iteration)); mixers without softmax probabilities (linear
attention family, NSA, DSA) are skipped. ``attention_contribution`` also needs the value
vectors, taken by a hook on the attention's ``qkv`` projection (:mod:`looplm.probes.capture`).
"""

from __future__ import annotations

import math

import torch

from looplm.probes import plots
from looplm.probes.base import ProbeError, ProbeInput, ProbeReport, register, tolist

_EPS = 1e-12


# --------------------------------------------------------------------------- math
def key_marginal_entropy(attn: torch.Tensor) -> torch.Tensor:
    """SpiralFormer §4.1: p(k) ∝ (1/L) Σ_q A(q, k), H = −Σ_k p(k) log p(k) / log L ∈ [0, 1].

    attn: [..., L, L] causal attention (rows sum to 1) -> [...]. L is the loop-native length."""
    L = attn.shape[-1]
    p = attn.double().mean(dim=-2)
    p = p / p.sum(dim=-1, keepdim=True)
    return -(p * (p + _EPS).log()).sum(dim=-1) / math.log(L)


def local_attention_mass(attn: torch.Tensor, window: int) -> torch.Tensor:
    """SpiralFormer §4.1: LAM = (1/L) Σ_q Σ_{k ∈ W(q)} A(q, k), W(q) = {k : q − M ≤ k < q}.

    attn: [..., T, S] with the T queries the last T of the S keys -> [...]. window: M."""
    T, S = attn.shape[-2:]
    q = torch.arange(S - T, S, device=attn.device)[:, None]  # absolute query index
    k = torch.arange(S, device=attn.device)[None, :]
    local = (k >= q - window) & (k < q)
    return (attn.double() * local).sum(dim=-1).mean(dim=-1)


def last_token_entropy(attn: torch.Tensor) -> torch.Tensor:
    """SGT Eq. (4): E = −Σ_j A_{N,j} log A_{N,j} / log N of the final query. attn: [..., T, S] -> [...]."""
    a = attn[..., -1, :].double()
    N = attn.shape[-1]
    return -(a * (a + _EPS).log()).sum(dim=-1) / math.log(N)


def attention_contribution(attn: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """SGT §5.4: C_j = A_{N,j} · ‖V_j‖₂ from the final query to every key j.

    attn: [B, H, T, S]; values: [B, H, S, D] -> [B, H, S]."""
    return attn[..., -1, :].double() * values.double().norm(dim=-1)


def dynamic_heads(delta: torch.Tensor, fraction: float = 0.4) -> torch.Tensor:
    """Bool mask of the top ``fraction`` of heads by cross-loop range (SpiralFormer App. I.1)."""
    flat = delta.flatten()
    k = max(1, math.ceil(fraction * flat.numel()))
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[flat.argsort(descending=True)[:k]] = True
    return mask.view(delta.shape)


# ------------------------------------------------------------------------ helpers
def _block_order(name: str) -> tuple[int, int, str]:
    part, j, *rest = name.split(".")
    return ({"prelude": 0, "core": 1, "coda": 2}.get(part, 3), int(j), ".".join(rest))


def _is_pass(name: str) -> bool:
    """A grown SGT pass ("core.0.loop1"): attention over a subset of heads, left out here."""
    return name.count(".") > 1


def _per_location(probe: ProbeInput, metric, **wanted) -> dict[tuple[str, int], torch.Tensor]:
    """Sample-mean of ``metric(attn [B, H, T, S], capture, location) -> [B, H]`` per location."""
    sums: dict = {}
    count = 0
    for cap in probe.forward(attentions=True, **wanted):
        for loc, attn in cap.output.attentions.items():
            if _is_pass(loc[0]):
                continue
            sums[loc] = sums.get(loc, 0) + metric(attn, cap, loc).sum(dim=0)
        count += cap.inputs.shape[0]
    if not sums:
        raise ProbeError("no softmax attention probabilities recorded: the model's mixers are not softmax attention")
    return {loc: s / count for loc, s in sorted(sums.items(), key=lambda kv: (_block_order(kv[0][0])[0], kv[0][1],
                                                                               _block_order(kv[0][0])[1]))}


def _label(loc) -> str:
    block, t = loc
    return f"{block}@{t}" if block.startswith("core") else block


# ----------------------------------------------------------------- SpiralFormer
@register("attention_shift", "SpiralFormer §4.1-4.2 Figures 4, 5, 8: key-marginal entropy, LAM, dynamic heads")
def attention_shift(probe: ProbeInput, gamma: int = 32, fraction: float = 0.4) -> ProbeReport:
    probe.require_loop("attention_shift")
    windows: dict = {}

    def both(attn, cap, loc):
        # r_t = 1 / g_t with g_t = L / L_t the chunk size of the iteration; M_t = ⌈γ r_t⌉ (Eq. 23)
        r_t = 1.0 / max(1, round(cap.inputs.shape[1] / attn.shape[-2]))
        windows[loc[1]] = window = math.ceil(gamma * r_t)
        return torch.stack([key_marginal_entropy(attn), local_attention_mass(attn, window)], dim=-1)

    values = {loc: v for loc, v in _per_location(probe, both).items() if loc[0].startswith("core")}
    if not values:
        raise ProbeError("the loop's core blocks have no softmax attention")
    blocks = sorted({loc[0] for loc in values}, key=_block_order)
    iters = sorted({loc[1] for loc in values})
    # [T, layers, H, 2]: layer = core block j, the loop-shared block's layers
    grid = torch.stack([torch.stack([values[(b, t)] for b in blocks]) for t in iters])
    numbers: dict = {"samples": probe.samples, "lam_window": windows, "iterations": iters, "layers": blocks,
                     "dynamic_fraction": fraction}
    figures = {}
    for m, name in enumerate(["key_marginal_entropy", "lam"]):
        x = grid[..., m]  # [T, layers, H]
        delta = x.max(dim=0).values - x.min(dim=0).values  # cross-loop range Δm_{ℓ,h}
        dyn = dynamic_heads(delta, fraction)
        numbers[name] = {
            "per_head": tolist(x),  # [iteration][layer][head]
            "cross_loop_range": tolist(delta),
            "dynamic_heads": [[blocks[l], h] for l, h in dyn.nonzero().tolist()],
            "loop_mean_dynamic": tolist(torch.stack([x[t][dyn].mean() for t in range(len(iters))])),
            "loop_mean_all": tolist(x.flatten(1).mean(dim=1)),
        }
        title = "key-marginal entropy" if m == 0 else "Local Attention Mass"
        figures[f"{name}_loops"] = _loop_boxes([x[t][dyn] for t in range(len(iters))], iters, title)
        figures[f"{name}_heads"] = _head_ranges(delta, dyn, blocks, title)
    return ProbeReport(numbers, figures)


def _loop_boxes(groups, iters, title):
    return lambda plt: plots.boxes(plt, groups, [f"loop {t}" for t in iters], title,
                                   f"{title} across loops, dynamic heads (SpiralFormer Fig. 4)")


def _head_ranges(delta, dyn, blocks, title):
    return lambda plt: plots.head_heatmap(
        plt, plots.minmax(delta), dyn, blocks, f"Δ {title} per head, dynamic heads boxed (SpiralFormer Fig. 5)")


# -------------------------------------------------------------------------- SGT
@register("head_entropy", "SGT §2 Eqs. (4)-(5), Figures 7-8: per-head last-token entropy and layer-wise entropy")
def head_entropy(probe: ProbeInput) -> ProbeReport:
    ent = _per_location(probe, lambda attn, cap, loc: last_token_entropy(attn))  # loc -> [H]
    locs = list(ent)
    labels = [_label(loc) for loc in locs]
    table = torch.stack([ent[loc] for loc in locs])  # [unrolled layers, H]
    layer = table.mean(dim=1)  # Eq. (5)
    variance = table.var(dim=1, unbiased=False)
    numbers = {
        "samples": probe.samples, "layers": labels,
        "head_entropy": tolist(table), "layer_entropy": tolist(layer), "intra_layer_variance": tolist(variance),
        "note": "a layer is one (block, iteration) of the unrolled computation; entropy of the final query (Eq. 4)",
    }
    return ProbeReport(numbers, {
        "head_entropy": lambda plt: plots.matrix(plt, table, labels, [f"h{h}" for h in range(table.shape[1])],
                                                 "Last-token attention entropy per head (SGT Fig. 8)"),
        "layer_entropy": lambda plt: plots.unrolled(plt, labels, {"layer-wise entropy": layer}, "normalised entropy",
                                                    "Layer-wise attention entropy (SGT Eq. 5, Fig. 7)"),
    })



@register("entropy_dynamics", "SGT §3 Figures 2, 14b: intra-layer entropy variance over training (saved checkpoints)")
def entropy_dynamics(probe: ProbeInput) -> ProbeReport:
    from looplm.artifacts import MODEL_FILE, load_weights, step_of, verify_manifest
    from looplm.model import LoopLM

    root = probe.run_path / "checkpoints"
    steps = sorted((step_of(p.name), p) for p in root.glob("step_*") if step_of(p.name) is not None) if root.is_dir() else []
    if not steps:
        raise ProbeError(f"{probe.run_path} has no checkpoints/step_* directories: pass a run directory")
    series, labels = [], None
    for step, path in steps:
        if probe.verify:
            verify_manifest(path, (MODEL_FILE,))
        model = LoopLM(probe.model.cfg)
        load_weights(model, path / MODEL_FILE)
        sub = ProbeInput(model.eval(), probe.config, probe.run_path, probe.batches, probe.tokenizer, probe.verify)
        ent = _per_location(sub, lambda attn, cap, loc: last_token_entropy(attn))
        labels = [_label(loc) for loc in ent]
        table = torch.stack(list(ent.values()))
        series.append((step, table.var(dim=1, unbiased=False), table.mean(dim=1)))
    losses = {}
    metrics = probe.run_path / "metrics.jsonl"
    if metrics.is_file():
        from looplm.train.metrics import read_metrics

        losses = {e["step"]: e["val_loss"] for e in read_metrics(metrics) if e.get("event") == "eval"}
    var = torch.stack([v for _, v, _ in series])  # [checkpoints, layers]
    numbers = {
        "samples": probe.samples, "layers": labels, "steps": [s for s, _, _ in series],
        "intra_layer_variance": tolist(var), "layer_entropy": tolist(torch.stack([m for _, _, m in series])),
        "val_loss": {str(s): losses[s] for s, _, _ in series if s in losses},
        "source": "every saved checkpoint of the run (the training log holds losses, not attention entropies)",
    }
    steps_x = [s for s, _, _ in series]
    return ProbeReport(numbers, {"entropy_variance": lambda plt: plots.lines(
        plt, steps_x, {lab: var[:, i] for i, lab in enumerate(labels)}, "training step", "intra-layer entropy variance",
        "Intra-layer variance of head entropy over training (SGT Fig. 2)")})


@register("attention_contribution", "SGT §5.4 Figures 6, 11: weighted attention contribution C_j = A_{N,j}·‖V_j‖ across loops")
def attention_contribution_probe(probe: ProbeInput, positions: int = 24) -> ProbeReport:
    probe.require_loop("attention_contribution")
    first = None
    ent_sum: dict = {}
    shift_sum: dict = {}
    count = 0
    for cap in probe.forward(attentions=True, values=True):
        core = {loc: a for loc, a in cap.output.attentions.items()
                if loc[0].startswith("core") and not _is_pass(loc[0]) and loc in cap.values}
        if not core:
            raise ProbeError("the loop's core blocks have no softmax attention")
        contrib = {loc: attention_contribution(a, cap.values[loc]) for loc, a in core.items()}  # [B, H, S]
        if first is None:
            first = ({loc: c[0] for loc, c in contrib.items()}, cap.inputs[0])
        for loc, c in contrib.items():
            ent_sum[loc] = ent_sum.get(loc, 0) + last_token_entropy(core[loc]).sum(dim=0)
            p = c / c.sum(dim=-1, keepdim=True).clamp(min=_EPS)
            prev = (loc[0], loc[1] - 1)
            if prev in contrib:  # L1 change of the normalised contribution between consecutive loops
                q = contrib[prev] / contrib[prev].sum(dim=-1, keepdim=True).clamp(min=_EPS)
                shift_sum[loc] = shift_sum.get(loc, 0) + (p - q).abs().sum(dim=-1).sum(dim=0) / 2
        count += cap.inputs.shape[0]
    ent = {loc: v / count for loc, v in ent_sum.items()}
    blocks = sorted({loc[0] for loc in ent}, key=_block_order)
    # the case-study head: the highest mean last-token entropy over loops (the heads SGT loops)
    mean_ent = torch.stack([torch.stack([v for loc, v in ent.items() if loc[0] == b]).mean(dim=0) for b in blocks])
    layer, head = divmod(int(mean_ent.argmax()), mean_ent.shape[1])
    block = blocks[layer]
    iters = sorted(t for b, t in ent if b == block)
    case, ids = first
    S = case[(block, iters[0])].shape[-1]
    shown = list(range(max(0, S - positions), S))
    heat = torch.stack([case[(block, t)][head, shown] for t in iters])  # [loops, positions]
    tokens = _token_labels(probe, ids[shown].tolist())
    numbers = {
        "samples": count, "head": {"block": block, "head": head, "mean_last_token_entropy": tolist(mean_ent[layer, head].item())},
        "case_study": {"positions": shown, "tokens": tokens,
                       "contribution": {f"loop {t}": tolist(heat[i]) for i, t in enumerate(iters)}},
        "loop_shift": {_label(loc): tolist(v / count) for loc, v in shift_sum.items()},
        "loop_shift_note": "mean total-variation distance between consecutive loops' normalised C_j, per head",
    }
    return ProbeReport(numbers, {"attention_contribution": lambda plt: plots.matrix(
        plt, heat, [f"loop {t}" for t in iters], tokens,
        f"C_j = A_N,j·‖V_j‖, {block} head {head}, final token (SGT Fig. 6)", annotate=False)})


def _token_labels(probe: ProbeInput, ids: list[int]) -> list[str]:
    if probe.tokenizer is None:
        return [str(i) for i in ids]
    labels = []
    for i in ids:
        try:
            text = probe.tokenizer.decode([i])
        except Exception:  # noqa: BLE001 - a token the tokenizer cannot show alone
            text = str(i)
        labels.append(repr(text)[1:-1] or str(i))
    return labels
