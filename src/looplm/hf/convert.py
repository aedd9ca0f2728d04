"""Pretrained dense checkpoints into looped models (Relaxed Recursive Transformers init).

A dense GPT-NeoX or LLaMA checkpoint of L layers becomes a looped model with layout
``P+CRT+Q`` by building every looplm block from dense layers: the prelude keeps the first P
dense layers, the coda the last Q (so the first and last layers stay fixed), and each of
the C shared core blocks is built from the M = L - P - Q middle layers by one of the
initialisations of Bae et al. 2024, "Relaxed Recursive Transformers" (§2.2, Fig. 3), with
the middle split into k = ⌊M / C⌋ consecutive groups of C layers (k = T when the middle
fills the loop exactly, the paper's setting; extra middle layers are left unused):

* ``average`` (paper: *Average*): core block j = mean of dense layers P + g·C + j for
  g = 0..k-1, the layers that unrolled iteration g places at position j (Φ'_j = 1/k Σ_g Φ_{gC+j}).
* ``stepwise`` (paper: *Stepwise*): core block j = dense layer P + j·k, every k-th middle
  layer (Φ'_j = Φ_{kj}).
* ``select`` (paper: *Lower*): core block j = dense layer P + j, the first C middle layers
  (Φ'_j = Φ_j).

Worked example, a 24-layer model into ``4+8R2+4`` (M = 16, k = 2), 0-based dense indices:

=============  ========================  ====================  =====================
looplm block   average                   stepwise              select
=============  ========================  ====================  =====================
prelude.0..3   0, 1, 2, 3                0, 1, 2, 3            0, 1, 2, 3
core.0.j       mean(4+j, 12+j): (4,12),  4+2j: 4, 6, 8, 10,    4+j: 4, 5, 6, 7,
               (5,13), ..., (11,19)      12, 14, 16, 18        8, 9, 10, 11
coda.0..3      20, 21, 22, 23            20, 21, 22, 23        20, 21, 22, 23
=============  ========================  ====================  =====================

With per-iteration LoRA (``model.lora.rank`` r > 0, ``looplm convert --lora-rank r``; the
paper's *Relaxed* Recursive Transformer, §2.3) the unrolled layer at iteration t, position j
is dense layer P + t·C + j, the one the dense model runs there, and each adapted linear's
(A_t, B_t) starts from the truncated SVD of its residual W_{P+tC+j} - W'_j (§2.3, under
either shared init): B_t = U_r Σ_r, A_t = V_rᵀ. A full-rank adapter (r >= min(in, out) of
every adapted linear) then reproduces the dense model's linears exactly, so the converted
model equals the dense one wherever the tied norms and biases agree (the adapters relax
the linear weights only, as in the paper; norms and biases stay averaged/selected). This
needs the middle to hold T groups of C layers (k >= T).

Embedding, final norm and head are copied. Parameters with no dense counterpart (step
embeddings, topology gates, halting heads, ...) keep looplm's own init and are listed in
the map as ``fresh``. The map is logged and written to ``OUT/layer_map.json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Sequence, Union

import torch

from looplm.config_base import ConfigError, set_dotted
from looplm.hf.import_model import DENSE_MODEL_TYPES, config_from_hf, load_hf_checkpoint
from looplm.layout import Layout, parse_layout
from looplm.model import LoopLM
from looplm.model_config import ModelConfig
from looplm.modules.lora import svd_init
from looplm.structure import LoopStructure

log = logging.getLogger("looplm")

INITS = ("average", "select", "stepwise")
MAP_FILE = "layer_map.json"
TRAIN_FILE = "train.yaml"


@dataclasses.dataclass(frozen=True)
class LayerMap:
    """For each looplm block, the dense layers (0-based) whose mean initialises it."""

    init: str
    dense_layers: int
    layout: str
    prelude: tuple[tuple[int, ...], ...]
    core: tuple[tuple[int, ...], ...]
    coda: tuple[tuple[int, ...], ...]

    def blocks(self) -> list[tuple[str, tuple[int, ...]]]:
        """(looplm block prefix, dense sources) for every block; the shared core is ``core.0``."""
        structure = LoopStructure.of(parse_layout(self.layout), share_core=True)
        sources = self.prelude + self.core + self.coda  # in depth order, as structure.names
        return [(structure.path(name, 0), s) for name, s in zip(structure.names, sources)]

    @property
    def unused(self) -> tuple[int, ...]:
        used = {i for _, sources in self.blocks() for i in sources}
        return tuple(i for i in range(self.dense_layers) if i not in used)

    def to_dict(self) -> dict[str, Any]:
        return {
            "init": self.init,
            "dense_layers": self.dense_layers,
            "layout": self.layout,
            "prelude": [list(s) for s in self.prelude],
            "core": [list(s) for s in self.core],
            "coda": [list(s) for s in self.coda],
            "unused": list(self.unused),
        }

    def unrolled(self, iterations: int) -> tuple[tuple[int, ...], ...]:
        """For each core block j, the dense layer the unrolled loop runs at each iteration t:
        P + t·C + j (the layer whose residual initialises iteration t's adapters)."""
        P, C = len(self.prelude), len(self.core)
        return tuple(tuple(P + t * C + j for t in range(iterations)) for j in range(C))

    def describe(self) -> str:
        """One line per block: ``core.0.3 <- mean(7, 15)``."""
        lines = [f"layer map ({self.init}, {self.dense_layers} dense layers -> {self.layout}):"]
        for name, sources in self.blocks():
            rhs = str(sources[0]) if len(sources) == 1 else f"mean({', '.join(map(str, sources))})"
            lines.append(f"  {name:<12} <- dense {rhs}")
        if self.unused:
            lines.append(f"  unused dense layers: {', '.join(map(str, self.unused))}")
        return "\n".join(lines)


def layer_map(dense_layers: int, layout: Union[str, Layout], init: str) -> LayerMap:
    """The dense layers behind each block of ``layout`` under ``init`` (see the module docstring).

    Raises ConfigError if ``init`` is unknown or the layout needs more dense layers than there are.
    """
    if init not in INITS:
        raise ConfigError("init", init, f"one of {', '.join(INITS)}")
    parsed = parse_layout(layout, field="layout") if isinstance(layout, str) else layout
    P, Q, L = parsed.prelude, parsed.coda, dense_layers
    C = parsed.core if parsed.is_looped else 0
    if P + Q + C > L:
        raise ConfigError(
            "layout", str(parsed),
            f"prelude + core + coda <= {L}, the dense depth (here {P} + {C} + {Q} = {P + C + Q}): every block "
            "needs at least one dense layer",
        )
    k = (L - P - Q) // C if C else 0  # groups of C middle layers; T in the paper's exact fit
    if init == "average":
        core = tuple(tuple(P + g * C + j for g in range(k)) for j in range(C))  # §2.2 Average
    elif init == "stepwise":
        core = tuple((P + j * k,) for j in range(C))  # §2.2 Stepwise: every k-th layer
    else:
        core = tuple((P + j,) for j in range(C))  # §2.2 Lower: the first C middle layers
    return LayerMap(
        init=init,
        dense_layers=L,
        layout=str(parsed),
        prelude=tuple((j,) for j in range(P)),
        core=core,
        coda=tuple((L - Q + j,) for j in range(Q)),
    )


def looped_config(dense: ModelConfig, layout: str, overrides: Sequence[tuple[str, Any]] = ()) -> ModelConfig:
    """The dense model's config with ``layout`` and ``model.KEY=VALUE`` overrides (topology,
    step embeddings, ...); the result must keep one shared core."""
    data = dense.to_dict()
    data["layout"] = layout
    for key, value in overrides:
        if not key.startswith("model.") or key == "model.layout":
            raise ConfigError(key, value, "a model.KEY=VALUE override other than model.layout (use --layout)")
        set_dotted(data, key[len("model."):], value)
    cfg = ModelConfig.from_dict(data, prefix="model")
    if not cfg.share_core:
        raise ConfigError("model.share_core", cfg.share_core, "true: the converted core is one shared stack")
    return cfg


def convert_dense(
    hf_dir: Union[str, Path], layout: str, init: str, overrides: Sequence[tuple[str, Any]] = ()
) -> tuple[LoopLM, LayerMap, list[str]]:
    """A looped LoopLM built from the dense checkpoint in ``hf_dir``; float32, CPU, eval mode.

    Returns (model, layer map, names of parameters left at looplm's fresh init).
    """
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: expected a Hugging Face checkpoint directory")
    hf_config = json.loads(config_path.read_text())
    model_type = hf_config.get("model_type")
    if model_type not in DENSE_MODEL_TYPES:
        raise ConfigError(
            "hf_config.model_type", model_type,
            f"a dense checkpoint: one of {', '.join(DENSE_MODEL_TYPES)} (a looped checkpoint is imported, not converted)",
        )
    # The map (and its errors) before reading any weights.
    layer_map(config_from_hf(hf_config).parsed_layout.prelude, layout, init)
    return convert_model(load_hf_checkpoint(hf_dir), layout, init, overrides)


def convert_model(
    dense: LoopLM, layout: str, init: str, overrides: Sequence[tuple[str, Any]] = ()
) -> tuple[LoopLM, LayerMap, list[str]]:
    """:func:`convert_dense` of a dense LoopLM (a layout with no loop: an imported checkpoint,
    or a looplm run trained dense, as the ``conversion`` study's)."""
    if dense.cfg.parsed_layout.is_looped:
        raise ConfigError("model.layout", dense.cfg.layout, "a dense layout (no loop): only dense models are converted")
    mapping = layer_map(dense.cfg.parsed_layout.prelude, layout, init)
    cfg = looped_config(dense.cfg, layout, overrides)
    model = LoopLM(cfg)
    state = _combine(dense.state_dict(), mapping)
    target = model.state_dict()
    for key, tensor in state.items():
        if key not in target or target[key].shape != tensor.shape:
            shape = "absent" if key not in target else f"shape {tuple(target[key].shape)}"
            raise ConfigError(
                "overrides", [f"{k}={v}" for k, v in overrides],
                f"overrides that keep the dense block's parameters ({key}: dense {tuple(tensor.shape)}, "
                f"looped {shape})",
            )
    if cfg.lora.enabled:
        state.update(_adapters(dense.state_dict(), state, mapping, cfg, target))
    fresh = sorted(set(target) - set(state))
    model.load_state_dict(state, strict=False)
    return model.eval(), mapping, fresh


def _adapters(dense_state: dict[str, torch.Tensor], shared: dict[str, torch.Tensor], mapping: LayerMap,
              cfg: ModelConfig, target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every core adapter (A_t, B_t) from the truncated SVD of W_{P+tC+j} - W'_j (Bae et al.
    2024 §2.3), t = 0..T-1: ``core.0.j.lora.attn.0.NAME.{A,B}.t`` for the linear
    ``core.0.j.attn.NAME``, ``core.0.j.lora.ffn.NAME.{A,B}.t`` for ``core.0.j.ffn.NAME``."""
    T, C, L = cfg.iterations, len(mapping.core), mapping.dense_layers
    middle = L - len(mapping.prelude) - len(mapping.coda)
    if middle // C < T:
        raise ConfigError("model.lora.rank", cfg.lora.rank,
                          f"0 for layout {mapping.layout!r} of a {L}-layer model: per-iteration adapters start from "
                          f"the dense layer each iteration replaces, so the middle needs T·C = {T * C} layers "
                          f"(it has {middle})")
    out = {}
    for j, layers in enumerate(mapping.unrolled(T)):
        prefix = f"core.0.{j}.lora."
        for key in target:
            if not (key.startswith(prefix) and key.endswith(".A.0")):
                continue
            part, *_, name, _, _ = key[len(prefix):].split(".")  # attn.0.qkv.A.0 or ffn.up.A.0
            linear = f"{part}.{name}.weight"
            for t, i in enumerate(layers):
                A, B = svd_init(dense_state[f"prelude.{i}.{linear}"] - shared[f"core.0.{j}.{linear}"], cfg.lora.rank)
                out[f"{key[:-4]}.A.{t}"], out[f"{key[:-4]}.B.{t}"] = A, B
    return out


def _combine(dense_state: dict[str, torch.Tensor], mapping: LayerMap) -> dict[str, torch.Tensor]:
    """looplm state dict of the looped model: each block the mean of its dense layers, the rest copied."""
    out = {k: v for k, v in dense_state.items() if not k.startswith("prelude.")}  # embed, norm, head
    names = [k[len("prelude.0."):] for k in dense_state if k.startswith("prelude.0.")]
    for prefix, sources in mapping.blocks():
        for name in names:
            stacked = torch.stack([dense_state[f"prelude.{i}.{name}"] for i in sources])
            out[f"{prefix}.{name}"] = stacked.mean(dim=0)  # a single source is copied exactly
    return out


def convert_checkpoint(
    hf_dir: Union[str, Path],
    out: Union[str, Path],
    layout: str,
    init: str,
    overrides: Sequence[tuple[str, Any]] = (),
) -> LayerMap:
    """Convert ``hf_dir`` and write ``out``: a ``save_pretrained`` directory (loadable by
    ``looplm eval/generate`` and ``LoopLM.from_pretrained``), ``layer_map.json`` and
    ``train.yaml`` (the model config and ``train.init_from``, for ``looplm train out/train.yaml``)."""
    model, mapping, fresh = convert_dense(hf_dir, layout, init, overrides)
    out = Path(out)
    model.save_pretrained(out)
    adapters = {"lora": {"rank": model.cfg.lora.rank, "iterations": [list(u) for u in mapping.unrolled(model.cfg.iterations)]}
                } if model.cfg.lora.enabled else {}
    (out / MAP_FILE).write_text(json.dumps({**mapping.to_dict(), **adapters, "fresh": fresh}, indent=2) + "\n")
    train = {"model": model.cfg.to_dict(), "train": {"init_from": str(out.resolve())}}
    (out / TRAIN_FILE).write_text(json.dumps(train, indent=2) + "\n")  # JSON is YAML
    log.info("%s", mapping.describe())
    if adapters:
        log.info("  per-iteration LoRA (rank %d) from the SVD of each residual W_l - W'_j, l per core block and "
                 "iteration: %s", model.cfg.lora.rank, adapters["lora"]["iterations"])
    if fresh:
        log.info("  fresh (looplm init, no dense counterpart): %s", ", ".join(fresh))
    return mapping
