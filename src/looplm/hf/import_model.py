"""Import Hugging Face GPT-NeoX (Pythia) and LLaMA checkpoints as dense looplm models,
and Ouro checkpoints as looped ones.

A checkpoint directory (``config.json`` plus ``model.safetensors`` or a sharded
``model.safetensors.index.json``) becomes a :class:`~looplm.model.LoopLM` whose logits
equal the reference implementation's: GPT-NeoX and LLaMA with layout ``"N"`` (all N
blocks in ``prelude``); Ouro (``model_type: "ouro"``, ByteDance's looped LM) with layout
``"{L}R{T}"``, all L layers looped ``total_ut_steps`` times (:func:`_ouro_config`).
Reading a checkpoint needs only ``json`` and ``safetensors``; transformers is never imported.

Anything our blocks cannot reproduce exactly (RoPE scaling, another activation, a head
width other than hidden_size / num_heads, ...) is refused with a :class:`ConfigError`
naming the ``config.json`` field, its value and what is supported, rather than imported
with different numerics.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Union

import torch

from looplm.artifacts import load_tensors
from looplm.config_base import ConfigError
from looplm.model import LoopLM
from looplm.model_config import ModelConfig

#: Dense checkpoints (what ``looplm convert`` turns into loops) and every importable type.
DENSE_MODEL_TYPES = ("gpt_neox", "llama")
MODEL_TYPES = (*DENSE_MODEL_TYPES, "ouro")

# Parameter-free HF buffers that some checkpoints still carry: the causal-mask buffers of
# old GPT-NeoX (``attention.bias`` / ``attention.masked_bias``) and rotary tables.
_IGNORED = re.compile(r"(^|\.)(attention\.bias|attention\.masked_bias|rotary_emb\.inv_freq)$")

# Per-block renames that need no reshaping: HF suffix -> looplm suffix.
_NEOX_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "input_layernorm.bias": "attn_norm.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "post_attention_layernorm.bias": "ffn_norm.bias",
    "attention.dense.weight": "attn.o_proj.weight",
    "attention.dense.bias": "attn.o_proj.bias",
    "mlp.dense_h_to_4h.weight": "ffn.up.weight",
    "mlp.dense_h_to_4h.bias": "ffn.up.bias",
    "mlp.dense_4h_to_h.weight": "ffn.down.weight",
    "mlp.dense_4h_to_h.bias": "ffn.down.bias",
}
_LLAMA_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.o_proj.bias": "attn.o_proj.bias",
    "mlp.gate_proj.weight": "ffn.gate.weight",
    "mlp.gate_proj.bias": "ffn.gate.bias",
    "mlp.up_proj.weight": "ffn.up.weight",
    "mlp.up_proj.bias": "ffn.up.bias",
    "mlp.down_proj.weight": "ffn.down.weight",
    "mlp.down_proj.bias": "ffn.down.bias",
}
# Top-level names: (HF prefix of the blocks, embedding, final norm weight/bias, LM head names).
# GPT-NeoX checkpoints name the head ``embed_out`` (transformers renames it ``lm_head`` on load).
_TOP = {
    "gpt_neox": (
        "gpt_neox.layers.", "gpt_neox.embed_in.weight", "gpt_neox.final_layer_norm.", ("embed_out.weight", "lm_head.weight")
    ),
    "llama": ("model.layers.", "model.embed_tokens.weight", "model.norm.", ("lm_head.weight",)),
    "ouro": ("model.layers.", "model.embed_tokens.weight", "model.norm.", ("lm_head.weight",)),
}
# Where the HF layers go: the dense families' blocks are the prelude; Ouro's are the shared loop core.
_BLOCKS_AT = {"gpt_neox": "prelude", "llama": "prelude", "ouro": "core.0"}
# Ouro's sandwich norms (modeling_ouro.py OuroDecoderLayer): input_layernorm -> attention ->
# input_layernorm_2 -> residual; post_attention_layernorm -> MLP -> post_attention_layernorm_2 -> residual.
_OURO_OUTPUT_NORMS = {
    "input_layernorm_2.weight": "attn_out_norm.weight",
    "post_attention_layernorm_2.weight": "ffn_out_norm.weight",
}
# Ouro's per-step exit gate (d -> 1 with bias) -> the exit_gate halting rule's gate.
_OURO_EXIT_GATE = {
    "model.early_exit_gate.weight": "halting.gate.weight",
    "model.early_exit_gate.bias": "halting.gate.bias",
}


# ---------------------------------------------------------------------------- config
def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face ``config.json`` dict (gpt_neox or llama) to a dense ModelConfig.

    Both the transformers 5 form (``rope_parameters: {rope_theta, partial_rotary_factor,
    rope_type}``) and the older top-level fields (``rope_theta``; GPT-NeoX ``rotary_emb_base``,
    ``rotary_pct``; ``rope_scaling``) are read, with transformers' own precedence and defaults.
    Raises ConfigError (a ValueError) naming the field for anything not reproducible.
    """
    model_type = hf_config.get("model_type")
    _require(model_type in MODEL_TYPES, "model_type", model_type, f"one of {', '.join(MODEL_TYPES)}")
    if model_type == "ouro":
        return _ouro_config(hf_config)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        _require(key in hf_config, key, None, "present in config.json")
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    _require(heads >= 1 and hidden % heads == 0, "num_attention_heads", heads, f"a divisor of hidden_size={hidden}")
    rope = _rope_parameters(hf_config)
    common = dict(
        vocab_size=hf_config["vocab_size"],
        d_model=hidden,
        n_heads=heads,
        layout=str(hf_config["num_hidden_layers"]),
        mlp_hidden=hf_config["intermediate_size"],
        tie_embeddings=hf_config.get("tie_word_embeddings", False),
        max_seq_len=hf_config.get("max_position_embeddings", 2048),
        embed_scale=False,
    )
    if model_type == "gpt_neox":
        act = hf_config.get("hidden_act", "gelu")
        _require(act == "gelu", "hidden_act", act, "'gelu' (exact erf GELU, GPT-NeoX's default)")
        # MLP and LayerNorms always carry biases in GPT-NeoX; looplm's `bias` also covers attention.
        attn_bias = hf_config.get("attention_bias", True)
        _require(attn_bias is True, "attention_bias", attn_bias, "true (looplm's bias covers attention and MLP together)")
        # GPT-NeoX's own precedence: rope_parameters, then rotary_emb_base / rotary_pct, then 10000 / 0.25.
        theta = rope.get("rope_theta", hf_config.get("rotary_emb_base", 10000.0))
        pct = rope.get("partial_rotary_factor", hf_config.get("rotary_pct", 0.25))
        cfg = ModelConfig(
            **common,
            norm="layernorm",
            norm_eps=hf_config.get("layer_norm_eps", 1e-5),
            mlp="gelu",
            parallel_residual=hf_config.get("use_parallel_residual", True),
            bias=True,
            rotary_pct=pct,
            rope_theta=theta,
        )
    else:
        act = hf_config.get("hidden_act", "silu")
        _require(act == "silu", "hidden_act", act, "'silu' (SwiGLU, LLaMA's default)")
        head_dim = hf_config.get("head_dim")
        _require(
            head_dim is None or head_dim == hidden // heads,
            "head_dim",
            head_dim,
            f"null or hidden_size / num_attention_heads = {hidden // heads} (looplm ties head width to d_model)",
        )
        attn_bias, mlp_bias = hf_config.get("attention_bias", False), hf_config.get("mlp_bias", False)
        _require(
            attn_bias == mlp_bias,
            "mlp_bias",
            mlp_bias,
            f"equal to attention_bias={attn_bias} (looplm's bias covers attention and MLP together)",
        )
        # LlamaRotaryEmbedding rotates the whole head and ignores partial_rotary_factor.
        theta = rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))
        cfg = ModelConfig(
            **common,
            n_kv_heads=hf_config.get("num_key_value_heads") or heads,
            norm="rmsnorm",
            norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            mlp="swiglu",
            parallel_residual=False,
            bias=bool(attn_bias),
            rotary_pct=1.0,
            rope_theta=theta,
        )
    return cfg


def _ouro_config(hf_config: dict[str, Any]) -> ModelConfig:
    """Ouro (configuration_ouro.py / modeling_ouro.py, ByteDance Ouro-1.4B / 2.6B) as a loop:
    layout ``"{num_hidden_layers}R{total_ut_steps}"`` with no prelude or coda, LLaMA blocks
    (RMSNorm, SwiGLU, RoPE, no biases) with ``norm_placement: sandwich``;
    ``loop_input_norm``: OuroModel applies its final ``norm`` after every UT step and feeds
    that normalised state to the next step; and the halting rule ``exit_gate`` with
    ``threshold: early_exit_threshold``: OuroForCausalLM's inference logits read each
    position's state at the first step whose exit CDF reaches the threshold (null: the
    last step); ``exit_at_step: early_exit_step`` (0-based; it wins over the threshold, and
    a step beyond ``total_ut_steps``, which Ouro ignores, maps to null); ``objective:
    expected`` with ``entropy_weight`` 0.1: fine-tuning continues Ouro's Stage I loss
    (expected LM loss under the exit distribution minus β·entropy, paper §3.3), whose β
    the checkpoint does not record. Ouro's ``use_weighted_exit`` logits (Σ_t p_t logits_t,
    an inference-time option, not a config field) are not mapped."""
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        _require(key in hf_config, key, None, "present in config.json")
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    _require(heads >= 1 and hidden % heads == 0, "num_attention_heads", heads, f"a divisor of hidden_size={hidden}")
    act = hf_config.get("hidden_act", "silu")
    _require(act == "silu", "hidden_act", act, "'silu' (SwiGLU, Ouro's default)")
    head_dim = hf_config.get("head_dim")
    _require(head_dim is None or head_dim == hidden // heads, "head_dim", head_dim,
             f"null or hidden_size / num_attention_heads = {hidden // heads} (looplm ties head width to d_model)")
    steps = hf_config.get("total_ut_steps", 4)  # OuroModel's default
    _require(isinstance(steps, int) and steps >= 1, "total_ut_steps", steps, "an integer >= 1")
    sliding = hf_config.get("use_sliding_window", False)
    _require(not sliding, "use_sliding_window", sliding, "false (Ouro's sliding-window layers are not imported)")
    kinds = hf_config.get("layer_types") or []
    _require(all(k == "full_attention" for k in kinds), "layer_types", kinds, "null or only 'full_attention'")
    rope = _rope_parameters(hf_config)
    threshold = hf_config.get("early_exit_threshold", 1.0)  # OuroConfig's default
    _require(threshold is None or (isinstance(threshold, (int, float)) and 0.0 < threshold <= 1.0),
             "early_exit_threshold", threshold, "null or a number in (0, 1]")
    exit_at = hf_config.get("early_exit_step")
    _require(exit_at is None or (isinstance(exit_at, int) and not isinstance(exit_at, bool)), "early_exit_step",
             exit_at, "null or an integer (a 0-based UT step)")
    exit_at = exit_at if exit_at is not None and 0 <= exit_at < steps else None  # Ouro ignores one out of range
    return ModelConfig(
        vocab_size=hf_config["vocab_size"],
        d_model=hidden,
        n_heads=heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or heads,
        layout=f"{hf_config['num_hidden_layers']}R{steps}",
        mlp_hidden=hf_config["intermediate_size"],
        tie_embeddings=hf_config.get("tie_word_embeddings", False),
        max_seq_len=hf_config.get("max_position_embeddings", 2048),
        embed_scale=False,
        norm="rmsnorm",
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        norm_placement="sandwich",
        loop_input_norm=True,
        mlp="swiglu",
        parallel_residual=False,
        bias=False,
        rotary_pct=1.0,
        rope_theta=rope.get("rope_theta", hf_config.get("rope_theta", 10000.0)),
        halting={"kind": "exit_gate", "threshold": threshold, "exit_at_step": exit_at, "objective": "expected",
                 "entropy_weight": 0.1},
    )


def _rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict as transformers builds it (``rope_scaling`` wins over ``rope_parameters``);
    refuse any RoPE type but the plain one, and per-layer-type RoPE."""
    field = "rope_scaling" if hf_config.get("rope_scaling") else "rope_parameters"
    rope = hf_config.get(field) or {}
    _require(isinstance(rope, dict), field, rope, "a mapping or null")
    if any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError(field, rope, "a single RoPE for every layer (per-layer-type RoPE is not supported)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    _require(
        kind == "default",
        field,
        rope,
        "null or rope_type 'default': looplm implements plain RoPE without scaling (linear, dynamic, yarn, llama3, ...)",
    )
    return rope


def _require(condition: bool, field: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ConfigError(f"hf_config.{field}", value, allowed)


# ---------------------------------------------------------------------- state dict
def state_dict_from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig, model_type: str) -> dict[str, torch.Tensor]:
    """Rename and reshape a ``*ForCausalLM`` state dict into looplm parameter names.

    hf_state: the checkpoint's tensors; cfg: from :func:`config_from_hf`. Blocks go to
    ``prelude.{i}`` (Ouro's to the shared loop core ``core.0.{i}``, its exit gate to
    ``halting.gate``); the attention projections are fused into ``attn.qkv`` laid out as
    [q (H·D) | k (H_kv·D) | v (H_kv·D)]. Every looplm parameter must be produced with its
    exact shape, and every HF key must be used (or be a known buffer); otherwise ValueError.
    """
    if model_type not in MODEL_TYPES:
        raise ConfigError("model_type", model_type, f"one of {', '.join(MODEL_TYPES)}")
    looped = model_type == "ouro"
    if cfg.parsed_layout.is_looped != looped:
        raise ConfigError("model.layout", cfg.layout, "a loop 'LRT' for ouro" if looped else
                          f"a dense layout 'N' (a {model_type} checkpoint has no loop)")
    n_layers = cfg.parsed_layout.core if looped else cfg.parsed_layout.prelude
    layer_prefix, embed_key, norm_prefix, head_keys = _TOP[model_type]
    pattern = re.compile(rf"^{re.escape(layer_prefix)}(\d+)\.(.+)$")

    rest = {k: v for k, v in hf_state.items() if not _IGNORED.search(k)}
    blocks: list[dict[str, torch.Tensor]] = [{} for _ in range(n_layers)]
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # looplm key -> HF key(s), for error messages

    def put(key: str, tensor: torch.Tensor, origin: str) -> None:
        out[key], source[key] = tensor, origin

    unexpected = []
    for key, tensor in rest.items():
        m = pattern.match(key)
        if m and int(m[1]) < n_layers:
            blocks[int(m[1])][m[2]] = tensor
        elif key == embed_key:
            put("embed.weight", tensor, key)
        elif key.startswith(norm_prefix) and key[len(norm_prefix):] in ("weight", "bias"):
            put(f"norm.{key[len(norm_prefix):]}", tensor, key)
        elif key in head_keys:
            put("head.weight", tensor, key)
        elif looped and key in _OURO_EXIT_GATE:
            put(_OURO_EXIT_GATE[key], tensor, key)
        else:
            unexpected.append(key)

    convert = {"gpt_neox": _neox_block, "llama": _llama_block, "ouro": _ouro_block}[model_type]
    for i, block in enumerate(blocks):
        for name, (tensor, origin) in convert(block, cfg, f"{layer_prefix}{i}.").items():
            put(f"{_BLOCKS_AT[model_type]}.{i}.{name}", tensor, origin)
        unexpected += [f"{layer_prefix}{i}.{k}" for k in block]  # convert pops what it used

    if cfg.tie_embeddings and "embed.weight" in out:
        # A tied model has one matrix; a checkpoint that also stores the head must agree with it.
        head = out.get("head.weight")
        if head is not None and not torch.equal(head, out["embed.weight"]):
            raise ValueError(
                f"tie_word_embeddings is true but {source['head.weight']} differs from {embed_key}; "
                "set tie_word_embeddings=false in config.json to import an untied head"
            )
        put("head.weight", out["embed.weight"], embed_key)

    if unexpected:
        raise ValueError(
            f"unexpected keys in the {model_type} checkpoint (no looplm parameter takes them): "
            f"{', '.join(sorted(unexpected)[:8])}{' ...' if len(unexpected) > 8 else ''}"
        )
    _check_against_model(out, source, cfg)
    return out


def _neox_block(block: dict[str, torch.Tensor], cfg: ModelConfig, prefix: str) -> dict[str, tuple[torch.Tensor, str]]:
    """One GPT-NeoX layer; pops the keys it uses from ``block``."""
    H, D = cfg.n_heads, cfg.head_dim
    out = {dst: (block.pop(src), prefix + src) for src, dst in _NEOX_BLOCK.items() if src in block}
    for kind in ("weight", "bias"):
        src = f"attention.query_key_value.{kind}"
        if src in block:
            fused = block.pop(src)
            # GPT-NeoX interleaves per head: rows [H, 3, D] -> ours [3, H, D] (q | k | v).
            rows = fused.reshape(H, 3, D, *fused.shape[1:]).transpose(0, 1)
            out[f"attn.qkv.{kind}"] = (rows.reshape(3 * H * D, *fused.shape[1:]).contiguous(), prefix + src)
    return out


def _llama_block(block: dict[str, torch.Tensor], cfg: ModelConfig, prefix: str) -> dict[str, tuple[torch.Tensor, str]]:
    """One LLaMA layer; pops the keys it uses from ``block``."""
    out = {dst: (block.pop(src), prefix + src) for src, dst in _LLAMA_BLOCK.items() if src in block}
    for kind in ("weight", "bias"):
        names = [f"self_attn.{p}_proj.{kind}" for p in "qkv"]
        present = [n for n in names if n in block]
        if len(present) == 3:
            # q [H·D], k [H_kv·D], v [H_kv·D] stacked along the output dim.
            fused = torch.cat([block.pop(n) for n in names], dim=0)
            out[f"attn.qkv.{kind}"] = (fused, f"{prefix}self_attn.{{q,k,v}}_proj.{kind}")
        elif present:
            missing = [prefix + n for n in names if n not in block]
            raise ValueError(f"missing keys in the llama checkpoint: {', '.join(missing)}")
    return out


def _ouro_block(block: dict[str, torch.Tensor], cfg: ModelConfig, prefix: str) -> dict[str, tuple[torch.Tensor, str]]:
    """One Ouro layer: a LLaMA layer plus the output norms of its sandwich; pops what it uses."""
    out = {dst: (block.pop(src), prefix + src) for src, dst in _OURO_OUTPUT_NORMS.items() if src in block}
    return {**_llama_block(block, cfg, prefix), **out}


def _check_against_model(out: dict[str, torch.Tensor], source: dict[str, str], cfg: ModelConfig) -> None:
    """Every parameter of LoopLM(cfg), and nothing else, with its exact shape."""
    with torch.device("meta"):  # names and shapes only: no memory, no init cost
        expected = {k: v.shape for k, v in LoopLM(cfg).state_dict().items()}
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(
            f"the checkpoint does not fill these looplm parameters: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}"
        )
    extra = sorted(set(out) - set(expected))
    if extra:  # a mapping bug, not a checkpoint problem
        raise ValueError(f"mapped keys that LoopLM({cfg.layout!r}) does not have: {', '.join(extra[:8])}")
    for key, shape in expected.items():
        if out[key].shape != shape:
            raise ValueError(
                f"{source[key]} has shape {tuple(out[key].shape)} but looplm's {key} needs {tuple(shape)}"
                " (does config.json match the weights?)"
            )


# ---------------------------------------------------------------------- checkpoint
def load_hf_checkpoint(directory: Union[str, Path]) -> LoopLM:
    """Build a LoopLM from a local HF checkpoint directory; float32, on CPU, in eval mode.

    Reads ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json`` with
    its shards; loads with ``strict=True``.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: expected a Hugging Face checkpoint directory")
    hf_config = json.loads(config_path.read_text())
    cfg = config_from_hf(hf_config)
    hf_state = read_safetensors(directory)
    state = state_dict_from_hf(hf_state, cfg, hf_config["model_type"])
    model = LoopLM(cfg)
    model.load_state_dict(state, strict=True)
    return model.eval()


def read_safetensors(directory: Union[str, Path]) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors``, or of the shards named by its index file."""
    directory = Path(directory)
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return load_tensors(single)
    if not index.is_file():
        raise FileNotFoundError(
            f"neither {single.name} nor {index.name} in {directory}; only safetensors checkpoints are read"
        )
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        path = directory / shard
        if not path.is_file():
            raise FileNotFoundError(f"{path} (a shard named by {index.name}) not found")
        state.update(load_tensors(path))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ValueError(f"{index.name} lists tensors its shards do not hold: {', '.join(missing[:8])}")
    return state
