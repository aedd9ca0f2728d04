"""Parameter counts of a LoopLM: measured from the built modules, and an analytic formula
to cross-check them (docs/accounting.md)."""

from __future__ import annotations

from torch import nn

from looplm.model_config import ModelConfig

#: Top-level module name -> component name in the counts; other top-level modules keep their name.
COMPONENTS = {
    "embed": "embedding",
    "pos_embed": "embedding",  # a learned position table is embedding, as in Kaplan et al.'s N
    "prelude": "prelude",
    "core": "core",
    "coda": "coda",
    "topology": "topology",
    "norm": "final_norm",
    "head": "head",
}


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Stored parameters of ``model`` (a :class:`~looplm.model.LoopLM`).

    Returns ``total``; ``non_embedding`` (total minus the embedding and the LM head; a
    tied embedding/head matrix is subtracted once); and one entry per component:
    ``embedding, prelude, core, coda, topology, final_norm, head`` (and any other
    top-level module under its own name: resolution scorers, ``step_embedding``, the
    ``streams``' learned Y⁰ / Z⁰, the ``halting`` unit or q head), which sum to ``total``.
    A learned position table (``pos_embed``) counts under ``embedding``, so
    ``non_embedding`` excludes it. With tied embeddings the shared matrix is counted under
    ``embedding`` and ``head`` is 0. A looped core is counted once however many times it runs (stored, not
    unrolled, parameters; see the FLOP counter for the compute the loop spends).
    """
    counts = {name: 0 for name in COMPONENTS.values()}
    for name, param in model.named_parameters():  # yields a tied tensor once, under its first name
        top = name.split(".", 1)[0]
        component = COMPONENTS.get(top, top)
        counts[component] = counts.get(component, 0) + param.numel()
    total = sum(counts.values())
    return {"total": total, "non_embedding": total - counts["embedding"] - counts["head"], **counts}


def _norm(cfg: ModelConfig) -> int:
    return 2 * cfg.d_model if cfg.norm == "layernorm" else cfg.d_model  # LayerNorm has a bias


def _ffn(cfg: ModelConfig, part: str) -> int:
    """A block's FFN: dense (with biases when ``model.bias``), or the mixture of experts'
    router and bias-free experts, one set per loop iteration where ``per_iteration``."""
    d, F, b = cfg.d_model, cfg.ffn_hidden, cfg.bias
    if cfg.moe is not None:
        return cfg.ffn_sets(part) * cfg.moe.parameters_per_set(d, F, cfg.mlp)
    if cfg.mlp == "gelu":
        return 2 * d * F + (F + d) * b
    return 3 * d * F + (2 * F + d) * b


def _ffn_linears(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of the FFN's linears: up, down (and SwiGLU's gate)."""
    d, F = cfg.d_model, cfg.ffn_hidden
    return [(d, F), (F, d)] + ([(d, F)] if cfg.mlp == "swiglu" else [])


def _lora(cfg: ModelConfig, specs) -> int:
    """Per-iteration adapters of one core block (Bae et al. 2024 §2.3): T·r·(in + out) per
    adapted linear, softmax attention's qkv d -> (H + 2H_kv)·D, output gate d -> H·D and
    W_O H·D -> d per mixer layer, and the FFN's (:mod:`looplm.modules.lora`)."""
    if not cfg.lora.enabled:
        return 0
    d, H, Hkv, D = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    shapes = _ffn_linears(cfg) if "mlp" in cfg.lora.targets else []
    for spec in specs if cfg.lora.adapts_mixer else ():  # softmax attention only (the config checks)
        mixer = {"qkv": (d, (H + 2 * Hkv) * D), "o_proj": (H * D, d), **({"gate": (d, H * D)} if spec.output_gate else {})}
        shapes += cfg.lora.linear_shapes(mixer, [])
    return cfg.lora.parameter_count(shapes, cfg.iterations)


def mixer_parameters(spec, cfg: ModelConfig) -> int:
    """Parameters of one mixer layer. Softmax attention (full / windowed, optionally with
    the output gate) by formula; other kinds from their layer built on the meta device."""
    from looplm.mixers.config import AttentionConfig

    d, H, Hkv, D, b = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.bias
    if isinstance(spec, AttentionConfig):
        qkv = d * (H + 2 * Hkv) * D + (H + 2 * Hkv) * D * b
        out = H * D * d + d * b
        gate = (d * H * D + H * D * b) if spec.output_gate else 0
        return qkv + out + gate
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in spec.build(cfg.block_shape).parameters())


def _resolution(cfg: ModelConfig) -> int:
    """Per multi-resolution iteration with g_t > 1 (spiralformer.txt §2.3): the scorer A^(t)
    (d -> 1, Eq. 17) for ``aggregate`` and the router B^(t) (d -> g_t, Eq. 21) for ``router``,
    each with its bias. Full-resolution iterations own none (not even with a shift)."""
    from looplm.resolution.schedule import iteration_resolutions

    if not cfg.parsed_layout.is_looped:
        return 0
    d, res = cfg.d_model, cfg.resolution
    total = 0
    for it in iteration_resolutions(cfg.parsed_layout.resolutions, res.offsets, res.shifts):
        if it.identity or it.chunk == 1:
            continue
        total += (d + 1) if res.down == "aggregate" else 0
        total += (d * it.chunk + it.chunk) if res.up == "router" else 0
    return total


def _loop_axes(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of the loop axes, only those a config holds: ``step_embedding`` T·d (one
    e_t per trained macro step), ``streams`` 2·d (learned Y⁰ and Z⁰; zeros are buffers),
    ``halting`` d + 1 (ACT's unit or Q-halt's q head, d -> 1 with bias)."""
    if not cfg.parsed_layout.is_looped:
        return {}
    d, counts = cfg.d_model, {}
    if cfg.step_embeddings:
        counts["step_embedding"] = cfg.iterations * d
    for name, count in (("streams", cfg.streams.parameter_count(d)), ("halting", cfg.halting.parameter_count(d))):
        if count:
            counts[name] = count
    return counts


def analytic_parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """The counts of :func:`parameter_counts` from the config alone:

    embedding V·d (+ max_seq_len·d with learned positions); head V·d (0 when tied); final
    norm; per block two norms (four under ``norm_placement: sandwich``), the FFN and the
    mixer layer(s) (one per parameter group of its mixer schedule); the core once per
    stack (one stack when shared, T otherwise), with its per-iteration adapters
    (:func:`_lora`); topology parameters (MeSH:
    (T + 1)·2·(d·B + B), Appendix E.4); ``resolution`` (only when it holds parameters):
    SpiralFormer's scorers d + 1 and routers (d + 1)·g_t per iteration with g_t > 1; the
    loop axes' parameters (:func:`_loop_axes`). SGT's grown loop adds no parameters (its
    structure is extra state)."""
    layout, d, V = cfg.parsed_layout, cfg.d_model, cfg.vocab_size

    def block(specs, part: str) -> int:
        groups = {}
        for spec in specs:
            groups.setdefault(spec.parameter_group(), spec)
        norms = cfg.block_shape.norms_per_block * _norm(cfg)
        adapters = _lora(cfg, list(groups.values())) if part == "core" else 0
        return norms + _ffn(cfg, part) + sum(mixer_parameters(s, cfg) for s in groups.values()) + adapters

    plan = cfg.block_mixers()
    prelude = sum(block(plan[("prelude", j)], "prelude") for j in range(layout.prelude))
    core = cfg.structure.stacks * sum(block(plan[("core", j)], "core") for j in range(cfg.structure.core))
    coda = sum(block(plan[("coda", j)], "coda") for j in range(layout.coda))
    topology = cfg.topology.parameter_count(d, cfg.iterations) if layout.is_looped else 0
    counts = {
        "embedding": V * d + (cfg.max_seq_len * d if cfg.position == "learned" else 0),
        "prelude": prelude,
        "core": core,
        "coda": coda,
        "topology": topology,
        "final_norm": _norm(cfg),
        "head": 0 if cfg.tie_embeddings else V * d,
    }
    resolution = _resolution(cfg)
    if resolution:
        counts["resolution"] = resolution
    counts.update(_loop_axes(cfg))
    total = sum(counts.values())
    return {"total": total, "non_embedding": total - counts["embedding"] - counts["head"], **counts}


def active_parameter_count(cfg: ModelConfig) -> int:
    """Parameters one token's forward uses (Switch / OLMoE's "active" count): the total less
    the E − k experts each mixture-of-experts FFN does not send it to, in every block and
    expert set (a per-iteration core uses k experts of each iteration's set). Equals the
    total without ``model.moe``."""
    total = analytic_parameter_counts(cfg)["total"]
    if cfg.moe is None:
        return total
    structure, moe = cfg.structure, cfg.moe
    sets = (structure.prelude + structure.coda + structure.stacks * structure.core * cfg.ffn_sets("core"))
    idle = moe.parameters_per_set(cfg.d_model, cfg.ffn_hidden, cfg.mlp) - \
        moe.active_parameters_per_set(cfg.d_model, cfg.ffn_hidden, cfg.mlp)
    return total - sets * idle
