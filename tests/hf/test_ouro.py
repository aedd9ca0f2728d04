"""Ouro import: tiny random checkpoints in Ouro's layout (config.json + model.safetensors
with its parameter names), imported by looplm.hf.import_model, give the logits of an
independent plain-PyTorch forward of the Ouro architecture at every loop count and exit
threshold, in one forward and in prefill + token-by-token decoding.

The reference below is written from Ouro's description (modeling_ouro.py: OuroModel,
OuroDecoderLayer, OuroForCausalLM's inference logits), not from looplm's modules:
embed -> for each UT step: every layer with sandwich norms, then the final RMSNorm (whose
output the next step reads) and the exit gate σ(wᵀh + b) on it -> per position, the LM
head on the state of the first step whose exit CDF reaches the threshold (else the last).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from looplm.cache import LoopCache
from looplm.config_base import ConfigError
from looplm.hf.import_model import config_from_hf, load_hf_checkpoint
from looplm.model import LoopLM

ATOL = 1e-5
BASE = dict(
    model_type="ouro", vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=64,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False,
    total_ut_steps=3, early_exit_threshold=1.0,
)
CASES = {
    "gqa-untied": {},
    "mha-tied-theta500": dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=500.0, total_ut_steps=4),
}


# ---------------------------------------------------------------- Ouro's layout
def ouro_weights(hf: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors under Ouro's parameter names: O(1) activations and logits (the
    embedding at 0.3 so that a tied head's logits stay O(1)), norm gains far from 1."""
    g = torch.Generator().manual_seed(seed)
    d, F, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    D = d // hf["num_attention_heads"]
    kv = hf["num_key_value_heads"] * D

    def matrix(rows, cols):
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    def gain():
        return 1.0 + 0.3 * torch.randn(d, generator=g)

    w = {"model.embed_tokens.weight": 0.3 * torch.randn(V, d, generator=g), "model.norm.weight": gain(),
         "model.early_exit_gate.weight": 3 * matrix(1, d), "model.early_exit_gate.bias": -torch.rand(1, generator=g)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({
            p + "self_attn.q_proj.weight": matrix(d, d), p + "self_attn.k_proj.weight": matrix(kv, d),
            p + "self_attn.v_proj.weight": matrix(kv, d), p + "self_attn.o_proj.weight": matrix(d, d),
            p + "mlp.gate_proj.weight": matrix(F, d), p + "mlp.up_proj.weight": matrix(F, d),
            p + "mlp.down_proj.weight": matrix(d, F),
            p + "input_layernorm.weight": gain(), p + "input_layernorm_2.weight": gain(),
            p + "post_attention_layernorm.weight": gain(), p + "post_attention_layernorm_2.weight": gain(),
        })
    if not hf["tie_word_embeddings"]:
        w["lm_head.weight"] = matrix(V, d)
    return w


def write_checkpoint(directory, hf: dict, weights: dict[str, torch.Tensor]):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


# ------------------------------------------------------- the reference forward
def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, theta):
    """RoPE with the two halves of each head as the (real, imaginary) pairs. x: [B, H, T, D]."""
    D, T = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)  # [T, D/2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    first, second = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-second, first], -1) * sin


def attention(x, w, p, hf):
    B, T, d = x.shape
    H, Hkv = hf["num_attention_heads"], hf["num_key_value_heads"]
    D = d // H
    q = (x @ w[p + "q_proj.weight"].T).view(B, T, H, D).transpose(1, 2)
    k = (x @ w[p + "k_proj.weight"].T).view(B, T, Hkv, D).transpose(1, 2)
    v = (x @ w[p + "v_proj.weight"].T).view(B, T, Hkv, D).transpose(1, 2)
    q, k = rotate(q, hf["rope_theta"]), rotate(k, hf["rope_theta"])
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d)
    return out @ w[p + "o_proj.weight"].T


def ouro_states(w, hf, ids, steps):
    """The final-normed state of every UT step: [B, T, d] each."""
    eps = hf["rms_norm_eps"]
    h, states = w["model.embed_tokens.weight"][ids], []
    for _ in range(steps):
        for i in range(hf["num_hidden_layers"]):
            p = f"model.layers.{i}."
            a = attention(rms_norm(h, w[p + "input_layernorm.weight"], eps), w, p + "self_attn.", hf)
            h = h + rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
            m = (torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T))
            h = h + rms_norm(m @ w[p + "mlp.down_proj.weight"].T, w[p + "post_attention_layernorm_2.weight"], eps)
        h = rms_norm(h, w["model.norm.weight"], eps)  # closes every UT step; the next step reads it
        states.append(h)
    return states


def ouro_logits(w, hf, ids, steps, threshold=None):
    """Logits and each position's exit step: the last step's state, or with ``threshold``
    the first whose exit CDF reaches it (p_t = λ_t Π_{s<t}(1 − λ_s), the last step the rest)."""
    states = ouro_states(w, hf, ids, steps)
    head = w["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else w["lm_head.weight"]
    if threshold is None:
        return states[-1] @ head.T, torch.full(ids.shape, steps - 1)
    pdf, remaining = [], torch.ones(ids.shape)
    for t, h in enumerate(states):
        lam = torch.sigmoid(h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"]).squeeze(-1)
        pdf.append(lam * remaining if t < steps - 1 else remaining)
        remaining = remaining * (1 - lam)
    reached = torch.stack(pdf, dim=2).cumsum(dim=2) >= threshold  # [B, T, steps]
    exit_step = torch.where(reached.any(dim=2), reached.float().argmax(dim=2), steps - 1)
    chosen = torch.stack(states, dim=2).gather(2, exit_step[..., None, None].expand(-1, -1, 1, h.shape[-1])).squeeze(2)
    return chosen @ head.T, exit_step


def _ids(batch=2, length=11, vocab=53, seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------ tests
@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_the_reference_at_every_loop_count(tmp_path, case):
    hf = {**BASE, **CASES[case]}
    weights = ouro_weights(hf, seed=1)
    model = load_hf_checkpoint(write_checkpoint(tmp_path / case, hf, weights))
    steps = hf["total_ut_steps"]
    assert model.cfg.layout == f"{hf['num_hidden_layers']}R{steps}"
    assert model.cfg.norm_placement == "sandwich" and model.cfg.loop_input_norm
    ids = _ids()
    with torch.no_grad():
        for t in range(1, steps + 1):
            expected, _ = ouro_logits(weights, hf, ids, t)
            got = model(ids, iterations=t).logits
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        assert model(ids).logits.shape == (2, 11, hf["vocab_size"])
        torch.testing.assert_close(model(ids).logits, ouro_logits(weights, hf, ids, steps)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("iterations,threshold", [(None, 1.0), (2, 1.0), (None, 0.6)])
def test_cached_decoding_equals_the_reference(tmp_path, iterations, threshold):
    hf = {**BASE, "early_exit_threshold": threshold}
    weights = ouro_weights(hf, seed=2)
    model = load_hf_checkpoint(write_checkpoint(tmp_path, hf, weights))
    ids = _ids(length=9, seed=3)
    cache = LoopCache()
    with torch.no_grad():
        logits = [model(ids[:, :4], cache=cache, iterations=iterations).logits]
        for t in range(4, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], cache=cache, iterations=iterations).logits)
    expected, _ = ouro_logits(weights, hf, ids, iterations or hf["total_ut_steps"], threshold)
    torch.testing.assert_close(torch.cat(logits, dim=1), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.9, None])
@pytest.mark.parametrize("steps", [2, 4])
def test_exit_threshold_reads_out_the_reference_exit_step(tmp_path, threshold, steps):
    """The exit gate as Ouro's threshold rule: per position, the state of the first step
    whose exit CDF reaches ``early_exit_threshold`` (null: the last step)."""
    hf = {**BASE, "total_ut_steps": 4, "early_exit_threshold": threshold}
    weights = ouro_weights(hf, seed=6)
    model = load_hf_checkpoint(write_checkpoint(tmp_path, hf, weights))
    assert model.cfg.halting.kind == "exit_gate" and model.cfg.halting.threshold == threshold
    torch.testing.assert_close(model.halting.gate.weight, weights["model.early_exit_gate.weight"], atol=0, rtol=0)
    ids = _ids(length=13, seed=7)
    expected, exit_step = ouro_logits(weights, hf, ids, steps, threshold)
    with torch.no_grad():
        out = model(ids, iterations=steps)
    torch.testing.assert_close(out.logits, expected, atol=ATOL, rtol=0)
    assert torch.equal(out.record["exit_step"][0], exit_step)
    if threshold is not None:  # the rule does choose here: positions exit at different steps
        assert len(exit_step.unique()) == steps


@pytest.mark.parametrize("exit_step", [0, 1, 2])
def test_early_exit_step_reads_out_that_steps_reference_state(tmp_path, exit_step):
    """Ouro's ``early_exit_step`` (modeling_ouro.py ``exit_at_step``): the LM head on that
    step's final-normed state for every position, whatever the threshold."""
    hf = {**BASE, "early_exit_step": exit_step, "early_exit_threshold": 0.5}
    weights = ouro_weights(hf, seed=10)
    model = load_hf_checkpoint(write_checkpoint(tmp_path, hf, weights))
    assert model.cfg.halting.exit_at_step == exit_step
    ids = _ids(seed=11)
    expected, _ = ouro_logits(weights, hf, ids, exit_step + 1)  # the last of exit_step + 1 steps: that state
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, atol=ATOL, rtol=0)
        cache, pieces = LoopCache(), []
        for start, end in ((0, 5), (5, 6), (6, 11)):
            pieces.append(model(ids[:, start:end], cache=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, atol=ATOL, rtol=0)


def test_an_early_exit_step_beyond_the_loop_is_ignored_as_ouro_ignores_it():
    assert config_from_hf({**BASE, "early_exit_step": 3}).halting.exit_at_step is None  # total_ut_steps = 3
    with pytest.raises(ConfigError, match="hf_config.early_exit_step"):
        config_from_hf({**BASE, "early_exit_step": 1.5})


def test_training_loss_is_ouros_stage_one_objective_on_the_reference_states(tmp_path):
    """Imported with Ouro's Stage I objective: Σ_t p(t) CE(head(h_t)) − 0.1·H(p) per token,
    averaged, from the reference forward's states and gate."""
    hf = dict(BASE)
    weights = ouro_weights(hf, seed=12)
    model = load_hf_checkpoint(write_checkpoint(tmp_path, hf, weights))
    assert (model.cfg.halting.objective, model.cfg.halting.entropy_weight) == ("expected", 0.1)
    ids, targets = _ids(seed=13), _ids(seed=14)
    states = ouro_states(weights, hf, ids, hf["total_ut_steps"])
    survive, loss = torch.ones(ids.shape), 0.0
    for t, h in enumerate(states):
        lam = torch.sigmoid(h @ weights["model.early_exit_gate.weight"].T + weights["model.early_exit_gate.bias"])
        p = survive if t == len(states) - 1 else lam.squeeze(-1) * survive
        survive = survive * (1 - lam.squeeze(-1))
        ce = torch.nn.functional.cross_entropy((h @ weights["lm_head.weight"].T).transpose(1, 2), targets,
                                               reduction="none")
        loss = loss + p * ce + 0.1 * p * p.log()  # Σ_t p L^(t) − β H(p), H = −Σ p log p
    with torch.no_grad():
        torch.testing.assert_close(model(ids, targets).loss, loss.mean(), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("field,value", [
    ("use_sliding_window", True), ("hidden_act", "gelu"), ("total_ut_steps", 0), ("head_dim", 16),
    ("layer_types", ["full_attention", "sliding_attention"]), ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}),
    ("early_exit_threshold", 1.5),
])
def test_unsupported_fields_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=f"hf_config.{field}"):
        config_from_hf({**BASE, field: value})


def test_an_unknown_ouro_tensor_is_refused(tmp_path):
    hf = dict(BASE)
    weights = {**ouro_weights(hf, seed=5), "model.layers.0.extra_norm.weight": torch.ones(32)}
    with pytest.raises(ValueError, match="extra_norm"):
        load_hf_checkpoint(write_checkpoint(tmp_path, hf, weights))


def test_an_imported_ouro_model_round_trips_through_save_pretrained(tmp_path):
    hf = {**BASE, "early_exit_threshold": 0.6}
    model = load_hf_checkpoint(write_checkpoint(tmp_path / "ouro", hf, ouro_weights(hf, seed=8)))
    model.save_pretrained(tmp_path / "looplm")
    again = LoopLM.from_pretrained(tmp_path / "looplm").eval()
    assert again.cfg == model.cfg
    ids = _ids(seed=9)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
