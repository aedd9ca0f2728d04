"""Parameter counts of a LoopLM, total and per component, each stored tensor counted once."""

from __future__ import annotations

from torch import nn

#: Top-level module name -> component name in the counts; other top-level modules keep their name.
COMPONENTS = {
    "embed": "embedding",
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
    ``embedding, prelude, core, coda, topology, final_norm, head``, which sum to
    ``total``. With tied embeddings the shared matrix is counted under ``embedding`` and
    ``head`` is 0. A looped core is counted once however many times it runs (stored, not
    unrolled, parameters; see the FLOP counter for the compute the loop spends).
    """
    counts = {name: 0 for name in COMPONENTS.values()}
    for name, param in model.named_parameters():  # yields a tied tensor once, under its first name
        top = name.split(".", 1)[0]
        component = COMPONENTS.get(top, top)
        counts[component] = counts.get(component, 0) + param.numel()
    total = sum(counts.values())
    return {"total": total, "non_embedding": total - counts["embedding"] - counts["head"], **counts}
