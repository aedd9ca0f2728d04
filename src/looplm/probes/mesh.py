"""MeSH's loop diagnostics (mesh.txt §2, §4.1, Appendix E.8, F).

* ``update_magnitude``: relative update 2‖f(h) − h‖_F / (‖f(h)‖_F + ‖h‖_F) of every block
  along prelude → core × T → coda (Figure 1a / 3), per sample, mean and std.
* ``cka``: centred kernel alignment with an RBF kernel between the hidden-state matrices
  h ∈ ℝ^{seq×d} (h_emb, h^(0..T), h_out), per sample then averaged (Figure 1b / 4).
* ``spectrum``: top-50 normalised singular values σ_i/σ_0 of each state (Figure 1c / 5).
* ``shared_subspace``: cumulative variance of each loop state h^(0..T) along a basis
  shared by all of them (Appendix E.8, Figure 10).
* ``routers``: MeSH write/read router weights per iteration, sequence average and one
  token, and the state-composition coefficients of Eq. (7) derived from them (Appendix F,
  Figure 11); for the learnable combinations of Appendix E.3, their coefficients α.
"""

from __future__ import annotations

import torch

from looplm.probes import plots
from looplm.probes.base import ProbeInput, ProbeReport, register, tolist


# --------------------------------------------------------------------------- math
def relative_update(h: torch.Tensor, f_h: torch.Tensor) -> torch.Tensor:
    """2‖f(h) − h‖_F / (‖f(h)‖_F + ‖h‖_F) per sample (Figure 1a). h, f_h: [B, T, d] -> [B]."""
    h, f_h = h.double().flatten(1), f_h.double().flatten(1)
    return 2 * (f_h - h).norm(dim=1) / (f_h.norm(dim=1) + h.norm(dim=1))


def gram_rbf(x: torch.Tensor, threshold: float = 1.0) -> torch.Tensor:
    """RBF Gram matrix [n, n] of rows of x [n, p], bandwidth σ² = threshold² · median squared
    distance (Kornblith et al. 2019's ``gram_rbf``; the median makes it scale invariant)."""
    x = x.double()
    dots = x @ x.T
    sq_norms = dots.diagonal()
    sq_dist = (sq_norms[:, None] + sq_norms[None, :] - 2 * dots).clamp(min=0)
    median = sq_dist.median()
    if median <= 0:  # all rows equal: every kernel value is 1
        return torch.ones_like(sq_dist)
    return torch.exp(-sq_dist / (2 * threshold**2 * median))


def _center(gram: torch.Tensor) -> torch.Tensor:
    n = gram.shape[0]
    h = torch.eye(n, dtype=gram.dtype, device=gram.device) - 1.0 / n
    return h @ gram @ h


def cka(x: torch.Tensor, y: torch.Tensor, kernel: str = "rbf", threshold: float = 1.0) -> torch.Tensor:
    """CKA(x, y) = HSIC(K, L) / sqrt(HSIC(K, K) · HSIC(L, L)) of x [n, p], y [n, q] (rows
    are the same n examples, here tokens). kernel: "rbf" (MeSH) or "linear"."""
    if kernel == "rbf":
        k, l = gram_rbf(x, threshold), gram_rbf(y, threshold)
    elif kernel == "linear":
        k, l = x.double() @ x.double().T, y.double() @ y.double().T
    else:
        raise ValueError(f"kernel={kernel!r}; expected 'rbf' or 'linear'")
    k, l = _center(k), _center(l)
    hsic_kl = (k * l).sum()
    denom = ((k * k).sum() * (l * l).sum()).sqrt()
    return hsic_kl / denom if denom > 0 else torch.zeros((), dtype=torch.float64)


def normalized_spectrum(x: torch.Tensor, top: int = 50) -> torch.Tensor:
    """σ_i / σ_0 for the top singular values of x [..., n, p] -> [..., min(top, n, p)]."""
    s = torch.linalg.svdvals(x.double())
    return (s / s[..., :1].clamp(min=1e-300))[..., :top]


def shared_subspace_variance(states: list[torch.Tensor]) -> torch.Tensor:
    """Cumulative fraction of each state's variance along a basis shared by all of them
    (Appendix E.8): the right singular vectors of the stacked, centred states.

    states: S matrices [n, d] of one sample -> [S, r] with r = min(S·n, d); row s, column k
    is Σ_{i≤k} ‖X_s v_i‖² / ‖X_s‖² for centred X_s."""
    centred = [x.double() - x.double().mean(dim=0, keepdim=True) for x in states]
    _, _, vh = torch.linalg.svd(torch.cat(centred, dim=0), full_matrices=False)  # vh: [r, d]
    out = []
    for x in centred:
        energy = (x @ vh.T).pow(2).sum(dim=0)  # [r]: variance along each shared direction
        out.append(energy.cumsum(0) / x.pow(2).sum().clamp(min=1e-300))
    return torch.stack(out)


def composition_coefficients(write: list[torch.Tensor], read: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Eq. (7): h^(k) = α_emb h_emb + Σ_{i=-1}^{k-1} α_i h_m^(i), unrolled from the routers.

    write, read: the MeSH record, index k ↔ iteration t = k − 1 (k = 0 the transitional
    write-read of the prelude output h_m^(-1)), each [B, T, S]. Slot 0 starts as h_emb
    and every slot as zeros otherwise (Eq. 2), so with m_b = [b = 0] h_emb + Σ_i w^(i)_b h_m^(i)
    and h^(k) = Σ_b r^(k)_b m_b:  α_emb = r^(k)_0 and α_i = Σ_b r^(k)_b w^(i+1)_b.
    Returns, for each state h^(k), {"h_emb": [B, T], "h_m^(i)": [B, T] for i = -1 .. k-1}."""
    out = []
    for k, r in enumerate(read):
        coeffs = {"h_emb": r[..., 0]}
        for i in range(-1, k):
            coeffs[f"h_m^({i})"] = (r * write[i + 1]).sum(dim=-1)
        out.append(coeffs)
    return out


# ------------------------------------------------------------------------ helpers
def _state_names(n_iter: int) -> list[str]:
    return ["h_emb", *[f"h^({t})" for t in range(n_iter + 1)], "h_out"]


def _hidden_states(capture) -> list[torch.Tensor]:
    """h_emb, h^(0..T), h_out, each [B, T, d] (Figure 1's states)."""
    return [capture.h_emb, *capture.output.states, capture.h_out]


def _mean_std(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.cat(rows, dim=0).double()
    return x.mean(dim=0), (x.std(dim=0) if x.shape[0] > 1 else torch.zeros_like(x[0]))


def _label(location) -> str:
    block, t = location
    return f"{block}@{t}" if block.startswith("core") else block


# ------------------------------------------------------------------------ probes
@register("update_magnitude", "MeSH §2 Figure 1a, §4.1 Figure 3: relative update magnitude per block")
def update_magnitude(probe: ProbeInput) -> ProbeReport:
    per_block: dict = {}
    per_iteration: dict[int, list] = {}
    for cap in probe.forward(blocks=True):
        for call in cap.blocks:
            per_block.setdefault(call.location, []).append(relative_update(call.input, call.output))
        core = [c for c in cap.blocks if c.location[0].startswith("core")]
        for t in sorted({c.location[1] for c in core}):  # the whole core stack: f_core(h^(t)) vs h^(t)
            calls = [c for c in core if c.location[1] == t]
            per_iteration.setdefault(t, []).append(relative_update(calls[0].input, calls[-1].output))
    labels = [_label(loc) for loc in per_block]
    stats = [_mean_std(v) for v in per_block.values()]
    numbers = {
        "definition": "2*||f(h)-h||_F / (||f(h)||_F + ||h||_F), Frobenius over the [seq, d] matrix of one sample",
        "samples": probe.samples,
        "blocks": [{"block": loc[0], "iteration": loc[1], "mean": float(m), "std": float(s)}
                   for loc, (m, s) in zip(per_block, stats)],
        "core_iterations": [{"iteration": t, "mean": float(m), "std": float(s)}
                            for t, (m, s) in ((t, _mean_std(v)) for t, v in per_iteration.items())],
    }
    means = [float(m) for m, _ in stats]
    stds = [float(s) for _, s in stats]
    return ProbeReport(tolist(numbers), {"update_magnitude": lambda plt: plots.bars(
        plt, labels, means, stds, "relative update magnitude", "Relative update magnitude per block (MeSH Fig. 1a)")})


@register("cka", "MeSH §2 Figure 1b, §4.1 Figure 4: RBF-kernel CKA between hidden states")
def cka_probe(probe: ProbeInput, threshold: float = 1.0) -> ProbeReport:
    probe.require_loop("cka")
    total, count, names = None, 0, None
    for cap in probe.forward(states=True):
        states = _hidden_states(cap)
        names = _state_names(len(cap.output.states) - 1)
        S = len(states)
        for b in range(cap.inputs.shape[0]):
            m = torch.eye(S, dtype=torch.float64)
            for i in range(S):
                for j in range(i + 1, S):
                    m[i, j] = m[j, i] = cka(states[i][b], states[j][b], "rbf", threshold)
            total = m if total is None else total + m
            count += 1
    mean = total / count
    numbers = {"kernel": "rbf", "bandwidth": f"sigma^2 = {threshold}^2 * median squared distance",
               "samples": count, "states": names, "cka": tolist(mean)}
    return ProbeReport(numbers, {"cka": lambda plt: plots.matrix(
        plt, mean, names, names, "CKA (RBF) between hidden states (MeSH Fig. 4)", annotate=True, vmin=0, vmax=1)})


@register("spectrum", "MeSH §2 Figure 1c, §4.1 Figure 5: normalised singular-value spectra")
def spectrum(probe: ProbeInput, top: int = 50) -> ProbeReport:
    probe.require_loop("spectrum")
    rows: dict[int, list] = {}
    names = None
    for cap in probe.forward(states=True):
        states = _hidden_states(cap)
        names = _state_names(len(cap.output.states) - 1)
        for i, x in enumerate(states):
            rows.setdefault(i, []).append(normalized_spectrum(x, top))
    stats = [_mean_std(rows[i]) for i in range(len(names))]
    numbers = {"top": top, "samples": probe.samples, "definition": "sigma_i / sigma_0 of each [seq, d] state",
               "spectra": {n: {"mean": tolist(m), "std": tolist(s)} for n, (m, s) in zip(names, stats)}}
    return ProbeReport(numbers, {"spectrum": lambda plt: plots.curves(
        plt, {n: m for n, (m, _) in zip(names, stats)}, {n: s for n, (_, s) in zip(names, stats)},
        "index i", "σ_i / σ_0", "Normalised singular values (MeSH Fig. 5)", log_y=True)})


@register("shared_subspace", "MeSH Appendix E.8 Figure 10: cumulative variance in the shared loop subspace")
def shared_subspace(probe: ProbeInput, top: int = 64) -> ProbeReport:
    probe.require_loop("shared_subspace")
    rows: list[torch.Tensor] = []
    for cap in probe.forward(states=True):
        for b in range(cap.inputs.shape[0]):
            rows.append(shared_subspace_variance([h[b] for h in cap.output.states])[:, :top])
    x = torch.stack(rows)  # [N, T+1, r]
    mean, std = x.mean(dim=0), (x.std(dim=0) if x.shape[0] > 1 else torch.zeros_like(x[0]))
    names = [f"h^({t})" for t in range(x.shape[1])]
    numbers = {"samples": x.shape[0], "states": names,
               "basis": "right singular vectors of the stacked, per-state centred h^(0..T) of each sample",
               "cumulative_variance": {n: {"mean": tolist(mean[i]), "std": tolist(std[i])} for i, n in enumerate(names)}}
    return ProbeReport(numbers, {"shared_subspace": lambda plt: plots.curves(
        plt, {n: mean[i] for i, n in enumerate(names)}, {n: std[i] for i, n in enumerate(names)},
        "shared direction k", "cumulative variance", "Variance in the shared subspace (MeSH Fig. 10)")})


@register("routers", "MeSH Appendix F Figure 11: router weights and Eq. (7) state composition")
def routers(probe: ProbeInput, token: int = -1) -> ProbeReport:
    probe.require_loop("routers")
    record: dict[str, list] = {}
    for cap in probe.forward():
        for key, values in cap.output.record.items():
            record.setdefault(key, []).append(values)
    numbers: dict = {"samples": probe.samples, "topology": probe.model.cfg.topology.kind}
    figures = {}
    if "write" in record and "read" in record:
        write = [torch.cat([batch[k] for batch in record["write"]]) for k in range(len(record["write"][0]))]
        read = [torch.cat([batch[k] for batch in record["read"]]) for k in range(len(record["read"][0]))]
        its = [f"t={k - 1}" for k in range(len(write))]
        tok = token % write[0].shape[1]
        w_avg = torch.stack([w.double().mean(dim=(0, 1)) for w in write])  # [T+1, S]
        r_avg = torch.stack([r.double().mean(dim=(0, 1)) for r in read])
        w_tok = torch.stack([w[0, tok].double() for w in write])  # sample 0, one token
        r_tok = torch.stack([r[0, tok].double() for r in read])
        comp = composition_coefficients(write, read)
        comp_avg = [{src: float(c.double().mean()) for src, c in state.items()} for state in comp]
        sources = ["h_emb", *[f"h_m^({i})" for i in range(-1, len(write) - 1)]]
        table = torch.full((len(comp), len(sources)), float("nan"), dtype=torch.float64)
        for k, state in enumerate(comp_avg):
            for src, v in state.items():
                table[k, sources.index(src)] = v
        states = [f"h^({k})" for k in range(len(comp))]
        numbers.update({
            "iterations": its, "slots": write[0].shape[-1], "token": tok,
            "write_mean": tolist(w_avg), "read_mean": tolist(r_avg),
            "write_token": tolist(w_tok), "read_token": tolist(r_tok),
            "composition": {s: c for s, c in zip(states, tolist(comp_avg))},
            "composition_note": "Eq. (7) coefficients from the routers, averaged over samples and tokens; "
                                "h_m^(-1) is the prelude output, h_m^(t) the core output of iteration t",
        })
        slots = [f"slot {b}" for b in range(write[0].shape[-1])]
        figures["router_weights"] = lambda plt: plots.matrices(plt, [
            (w_avg, "write (mean)"), (w_tok, f"write (token {tok})"), (r_avg, "read (mean)"), (r_tok, f"read (token {tok})"),
        ], its, slots, "MeSH router weights (MeSH Fig. 11a)")
        figures["composition"] = lambda plt: plots.matrix(
            plt, table, states, sources, "State composition, Eq. (7) (MeSH Fig. 11b)", annotate=True)
    if "alpha" in record:  # learnable combinations (Appendix E.3): α for (f(h), h^(0), h_emb, h)
        alphas = [torch.stack([a.double().reshape(-1, 4).mean(dim=0) for a in batch]) for batch in record["alpha"]]
        alpha = torch.stack(alphas).mean(dim=0)  # [T, 4]
        terms = ["f(h^(t))", "h^(0)", "h_emb", "h^(t)"]
        its = [f"t={t}" for t in range(alpha.shape[0])]
        numbers["combination"] = {"terms": terms, "alpha_mean": tolist(alpha)}
        figures["combination"] = lambda plt: plots.matrix(
            plt, alpha, its, terms, "Combination coefficients α (MeSH App. E.3)", annotate=True)
    if len(numbers) == 2:
        numbers["note"] = f"topology {probe.model.cfg.topology.kind!r} records no router or combination weights"
    return ProbeReport(numbers, figures)
