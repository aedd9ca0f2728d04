"""config.json mapping and the errors of looplm.hf.import_model; no transformers needed."""

from __future__ import annotations

import json

import pytest
import torch

from looplm.config_base import ConfigError
from looplm.hf.import_model import config_from_hf, load_hf_checkpoint, state_dict_from_hf

NEOX_V4 = {  # a Pythia-style config.json as older transformers wrote it
    "model_type": "gpt_neox", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 128, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
    "max_position_embeddings": 64, "rotary_emb_base": 10000, "rotary_pct": 0.25, "rope_scaling": None,
    "tie_word_embeddings": False, "use_parallel_residual": True,
}
LLAMA = {
    "model_type": "llama", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "head_dim": 8, "attention_bias": False,
    "mlp_bias": False, "tie_word_embeddings": False,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
}


def test_neox_config_old_and_new_rope_fields():
    cfg = config_from_hf(NEOX_V4)
    assert (cfg.layout, cfg.norm, cfg.mlp, cfg.bias, cfg.parallel_residual) == ("2", "layernorm", "gelu", True, True)
    assert (cfg.rotary_pct, cfg.rope_theta, cfg.mlp_hidden, cfg.max_seq_len) == (0.25, 10000.0, 128, 64)
    assert cfg.topology.kind == "base" and not cfg.embed_scale
    v5 = {k: v for k, v in NEOX_V4.items() if k not in ("rotary_emb_base", "rotary_pct", "rope_scaling")}
    v5["rope_parameters"] = {"partial_rotary_factor": 0.5, "rope_theta": 123.0, "rope_type": "default"}
    cfg = config_from_hf(v5)
    assert (cfg.rotary_pct, cfg.rope_theta) == (0.5, 123.0)


def test_llama_config():
    cfg = config_from_hf(LLAMA)
    assert (cfg.norm, cfg.mlp, cfg.bias, cfg.parallel_residual, cfg.rotary_pct) == ("rmsnorm", "swiglu", False, False, 1.0)
    assert (cfg.n_kv_heads, cfg.rope_theta, cfg.norm_eps, cfg.mlp_hidden) == (2, 500000.0, 1e-6, 48)
    old = {k: v for k, v in LLAMA.items() if k != "rope_parameters"} | {"rope_theta": 1000.0, "rope_scaling": None}
    assert config_from_hf(old).rope_theta == 1000.0


@pytest.mark.parametrize(
    "base, change, field",
    [
        (LLAMA, {"model_type": "gpt2"}, "hf_config.model_type"),
        (LLAMA, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "hf_config.rope_scaling"),
        (LLAMA, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "hf_config.rope_parameters"),
        (NEOX_V4, {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "hf_config.rope_scaling"),
        (NEOX_V4, {"hidden_act": "gelu_new"}, "hf_config.hidden_act"),
        (NEOX_V4, {"attention_bias": False}, "hf_config.attention_bias"),
        (LLAMA, {"hidden_act": "gelu"}, "hf_config.hidden_act"),
        (LLAMA, {"head_dim": 16}, "hf_config.head_dim"),
        (LLAMA, {"attention_bias": True}, "hf_config.mlp_bias"),
        ({k: v for k, v in LLAMA.items() if k != "intermediate_size"}, {}, "hf_config.intermediate_size"),
    ],
)
def test_unsupported_config_is_refused(base, change, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as err:
        config_from_hf(base | change)
    assert err.value.field == field and isinstance(err.value, ValueError)


def _llama_state(cfg) -> dict[str, torch.Tensor]:
    d, f, kv = cfg.d_model, cfg.ffn_hidden, cfg.kv_heads * cfg.head_dim
    state = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, d), "model.norm.weight": torch.ones(d),
             "lm_head.weight": torch.randn(cfg.vocab_size, d)}
    for i in range(cfg.parsed_layout.prelude):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": torch.ones(d), p + "post_attention_layernorm.weight": torch.ones(d),
                  p + "self_attn.q_proj.weight": torch.randn(d, d), p + "self_attn.k_proj.weight": torch.randn(kv, d),
                  p + "self_attn.v_proj.weight": torch.randn(kv, d), p + "self_attn.o_proj.weight": torch.randn(d, d),
                  p + "mlp.gate_proj.weight": torch.randn(f, d), p + "mlp.up_proj.weight": torch.randn(f, d),
                  p + "mlp.down_proj.weight": torch.randn(d, f),
                  p + "self_attn.rotary_emb.inv_freq": torch.ones(4)}  # a buffer old checkpoints carry: ignored
    return state


def test_state_dict_complete_and_strict():
    cfg = config_from_hf(LLAMA)
    state = _llama_state(cfg)
    out = state_dict_from_hf(state, cfg, "llama")
    assert out["prelude.1.attn.qkv.weight"].shape == (32 + 2 * 16, 32)
    torch.testing.assert_close(out["prelude.1.attn.qkv.weight"][32:48], state["model.layers.1.self_attn.k_proj.weight"])

    with pytest.raises(ValueError, match=r"prelude\.0\.ffn\.gate\.weight"):
        state_dict_from_hf({k: v for k, v in state.items() if k != "model.layers.0.mlp.gate_proj.weight"}, cfg, "llama")
    with pytest.raises(ValueError, match=r"unexpected keys.*model\.layers\.2\.mlp\.up_proj\.weight.*model\.rogue"):
        state_dict_from_hf(state | {"model.layers.2.mlp.up_proj.weight": torch.ones(1), "model.rogue": torch.ones(1)}, cfg, "llama")
    with pytest.raises(ValueError, match=r"mlp\.down_proj\.weight has shape \(32, 47\)"):
        state_dict_from_hf(state | {"model.layers.0.mlp.down_proj.weight": torch.ones(32, 47)}, cfg, "llama")
    with pytest.raises(ValueError, match=r"missing keys.*v_proj"):
        state_dict_from_hf({k: v for k, v in state.items() if "layers.0.self_attn.v_proj" not in k}, cfg, "llama")


def test_tied_checkpoint_with_a_different_head_is_refused():
    cfg = config_from_hf(LLAMA | {"tie_word_embeddings": True})
    state = _llama_state(cfg)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        state_dict_from_hf(state, cfg, "llama")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    out = state_dict_from_hf(state, cfg, "llama")
    assert out["head.weight"] is out["embed.weight"]


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_neox_qkv_is_deinterleaved_per_head_and_buffers_ignored():
    cfg = config_from_hf(NEOX_V4 | {"num_hidden_layers": 1})
    d, H, D, f = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.ffn_hidden
    p = "gpt_neox.layers.0."
    fused = torch.arange(3 * d * d, dtype=torch.float32).reshape(3 * d, d)  # rows [H, 3 (q,k,v), D]
    state = {"gpt_neox.embed_in.weight": torch.randn(50, d), "embed_out.weight": torch.randn(50, d),
             "gpt_neox.final_layer_norm.weight": torch.ones(d), "gpt_neox.final_layer_norm.bias": torch.zeros(d),
             p + "attention.query_key_value.weight": fused, p + "attention.query_key_value.bias": fused[:, 0].clone(),
             p + "attention.dense.weight": torch.randn(d, d), p + "attention.dense.bias": torch.zeros(d),
             p + "mlp.dense_h_to_4h.weight": torch.randn(f, d), p + "mlp.dense_h_to_4h.bias": torch.zeros(f),
             p + "mlp.dense_4h_to_h.weight": torch.randn(d, f), p + "mlp.dense_4h_to_h.bias": torch.zeros(d),
             p + "attention.bias": torch.ones(1, 1, 4, 4, dtype=torch.bool), p + "attention.masked_bias": torch.tensor(-1e9),
             p + "attention.rotary_emb.inv_freq": torch.ones(2)}
    for ln in ("input_layernorm", "post_attention_layernorm"):
        state |= {p + ln + ".weight": torch.ones(d), p + ln + ".bias": torch.zeros(d)}
    out = state_dict_from_hf(state, cfg, "gpt_neox")
    qkv, bias = out["prelude.0.attn.qkv.weight"], out["prelude.0.attn.qkv.bias"]
    by_head = fused.reshape(H, 3, D, d)
    for j, part in enumerate("qkv"):  # ours: [q (H·D) | k (H·D) | v (H·D)], heads in order
        for h in range(H):
            rows = slice(j * H * D + h * D, j * H * D + (h + 1) * D)
            assert torch.equal(qkv[rows], by_head[h, j]), (part, h)
            assert torch.equal(bias[rows], by_head[h, j, :, 0]), (part, h)
    assert out["head.weight"] is state["embed_out.weight"]
