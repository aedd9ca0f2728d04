"""The student of LT2's distillation (lt2.txt §5): the teacher's graph with a linear mixer
outside the kept-attention set F.

The student "shares the teacher's embedding, FFN, and norm parameters but uses GDN as
token mixer outside a small kept-attention set F". Here it is the teacher's
:class:`~looplm.model_config.ModelConfig` with ``mixer`` = the linear mixer and, when F is
not empty, a depth-level hybrid whose ``layers`` are F and whose mixer is the teacher's
softmax attention (``looplm.mixers.pattern``), so the student is an ordinary looplm model
(it decodes with the loop cache, exports, evaluates). Block indices count the distinct
blocks: prelude, then core (one stack when shared), then coda.

Initialisation (:func:`init_student`) copies every teacher tensor whose name and shape the
student has (embedding, head, norms, FFN, loop parameters and the attention of F's
blocks), then, in each linear mixer, the teacher attention's projections where shapes
allow: ``q_proj`` ← W_q, ``k_proj`` ← W_k, ``v_proj`` ← W_v (key/value heads repeated
when the teacher groups them, GQA), ``o_proj`` ← W_O. The attention's biases have no
place in the bias-free linear projections and are dropped; the mixer's own parameters
(short convolutions, β, decay, gates, output norm) keep their fresh init. GDN's default
here is ``expand_v = 1`` so that v and o match the teacher's shapes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import nn

from looplm.config_base import ConfigError
from looplm.mixers.attention import SoftmaxAttention
from looplm.mixers.config import MixerConfig
from looplm.mixers.pattern import HybridConfig
from looplm.model import LoopLM
from looplm.model_config import ModelConfig

log = logging.getLogger("looplm")


def block_paths(cfg: ModelConfig) -> list[list[str]]:
    """Per distinct block index (prelude, core, coda): the module paths of its blocks (a
    core position has one per stack when ``share_core`` is false)."""
    structure = cfg.structure
    return [list(structure.paths_of(name)) for name in structure.names]


def check_teacher(cfg: ModelConfig) -> None:
    """A teacher is a softmax-attention model: one softmax mixer everywhere (no hybrid, no
    loop-level schedule, no SGT head loop)."""
    if not cfg.mixer.is_softmax or cfg.mixer.kind not in ("attention", "sliding_window"):
        raise ConfigError("teacher model.mixer.kind", cfg.mixer.kind,
                          "attention or sliding_window: distillation replaces a softmax-attention teacher's mixers")
    for name in ("hybrid", "loop_mixers", "head_loop"):
        if getattr(cfg, name) is not None:
            raise ConfigError(f"teacher model.{name}", getattr(cfg, name),
                              "null: the teacher must run one softmax attention in every block")


def student_config(teacher: ModelConfig, mixer: MixerConfig, keep: Sequence[int]) -> ModelConfig:
    """The teacher's config with ``mixer`` everywhere except the blocks in ``keep`` (F),
    which keep the teacher's attention."""
    check_teacher(teacher)
    hybrid = HybridConfig(mixer=teacher.mixer, layers=tuple(sorted(set(keep)))) if keep else None
    return ModelConfig.from_dict({**teacher.to_dict(), "mixer": mixer.to_dict(),
                                  "hybrid": None if hybrid is None else hybrid.to_dict()}, prefix="model")


def _fit(source: torch.Tensor, shape: torch.Size, head_dim: int) -> Optional[torch.Tensor]:
    """``source`` [out, in] as a tensor of ``shape``: itself, or its key/value heads
    repeated along the output rows (GQA → one per query head); None when neither fits."""
    if source.shape == shape:
        return source
    out, width = source.shape
    if width == shape[1] and shape[0] % out == 0 and out % head_dim == 0:
        groups = shape[0] // out
        heads = out // head_dim
        return source.view(heads, head_dim, width).repeat_interleave(groups, dim=0).reshape(shape)
    return None


def attention_projections(attn: SoftmaxAttention) -> dict[str, torch.Tensor]:
    """W_q, W_k, W_v [out, d] and W_O [d, H·D] of a softmax attention layer, by the linear
    mixers' projection names."""
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = attn.qkv.weight.split([H * D, Hkv * D, Hkv * D], dim=0)
    return {"q_proj": q, "k_proj": k, "v_proj": v, "o_proj": attn.o_proj.weight}


@torch.no_grad()
def init_student(student: LoopLM, teacher: LoopLM, linear_from: Optional[LoopLM] = None) -> dict[str, str]:
    """Initialise ``student`` from ``teacher`` as the module docstring says; with
    ``linear_from`` (a stage-1 student), its linear mixers' weights are taken from there
    instead of the attention projections. Returns ``{student tensor: where it came from}``."""
    source: dict[str, str] = {}
    teacher_state = teacher.state_dict()
    own = student.state_dict()
    for name, tensor in own.items():
        if name in teacher_state and teacher_state[name].shape == tensor.shape:
            tensor.copy_(teacher_state[name])
            source[name] = f"teacher {name}"
    linear_state = linear_from.state_dict() if linear_from is not None else {}
    teacher_modules = dict(teacher.named_modules())
    for paths in block_paths(student.cfg):
        for path in paths:
            block, teacher_block = student.get_submodule(path), teacher_modules.get(path)
            if isinstance(block.attn, SoftmaxAttention) or teacher_block is None:
                continue
            mixer_prefix = f"{path}.attn."
            mixer_names = [n for n in own if n.startswith(mixer_prefix)]
            if linear_from is not None and all(n in linear_state and linear_state[n].shape == own[n].shape
                                               for n in mixer_names):
                for n in mixer_names:
                    own[n].copy_(linear_state[n])
                    source[n] = f"stage-1 student {n}"
                continue
            projections = attention_projections(teacher_block.attn)
            for proj, weight in projections.items():
                name = f"{mixer_prefix}{proj}.weight"
                if name not in own:
                    continue
                fitted = _fit(weight, own[name].shape, teacher_block.attn.head_dim)
                if fitted is not None:
                    own[name].copy_(fitted)
                    source[name] = f"teacher {path}.attn {proj[0]}"
    return source


def load_teacher(path: Union[str, Path], device: Union[str, torch.device] = "cpu") -> LoopLM:
    """The frozen teacher (eval mode, no gradients): a looplm run, checkpoint or
    ``save_pretrained`` directory, or a Hugging Face checkpoint looplm imports (a
    ``config.json`` with ``model_type``: GPT-NeoX, LLaMA, Ouro)."""
    import json

    path = Path(path)
    config = path / "config.json"
    if config.is_file() and "model_type" in json.loads(config.read_text(encoding="utf-8")):
        from looplm.hf.import_model import load_hf_checkpoint

        model = load_hf_checkpoint(path)
    else:
        model = LoopLM.from_pretrained(path)
    check_teacher(model.cfg)
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def freeze_all_but_linear_mixers(student: LoopLM) -> list[str]:
    """Stage 1 trains the linear mixers alone: every other parameter stops requiring a
    gradient. Returns the trainable parameter names."""
    trainable = set()
    for paths in block_paths(student.cfg):
        for path in paths:
            block = student.get_submodule(path)
            if not isinstance(block.attn, SoftmaxAttention):
                trainable.update(f"{path}.attn.{n}" for n, _ in block.attn.named_parameters())
    for name, param in student.named_parameters():
        param.requires_grad_(name in trainable)
    return sorted(trainable)


def linear_mixer_layers(student: nn.Module) -> list[str]:
    """Paths of the student's blocks that run a linear mixer."""
    return [p for paths in block_paths(student.cfg) for p in paths
            if not isinstance(student.get_submodule(p).attn, SoftmaxAttention)]
