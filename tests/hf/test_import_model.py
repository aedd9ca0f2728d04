"""HF parity: tiny random GPT-NeoX and LLaMA checkpoints imported by looplm.hf.import_model
give transformers' own logits, in one forward and in prefill + token-by-token decoding."""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")

from looplm.cache import LoopCache  # noqa: E402
from looplm.hf.import_model import load_hf_checkpoint  # noqa: E402
from tests.conftest import randomize_weights  # noqa: E402

VOCAB = 97
ATOL = 1e-5

NEOX_CASES = {
    "parallel-rot0.25": dict(use_parallel_residual=True, rotary_pct=0.25),
    "sequential-rot0.25": dict(use_parallel_residual=False, rotary_pct=0.25),
    "parallel-rot1-theta500-tied": dict(use_parallel_residual=True, rotary_pct=1.0, rotary_emb_base=500.0, tie_word_embeddings=True),
}
LLAMA_CASES = {
    "mha": dict(),
    "gqa": dict(num_key_value_heads=2),
    "tied": dict(tie_word_embeddings=True, num_key_value_heads=1),
    "bias-theta500": dict(attention_bias=True, mlp_bias=True, rope_theta=500.0),
}


def _neox(tmp_path, seed, **overrides):
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=64, **overrides,
    )
    return _save(transformers.GPTNeoXForCausalLM(cfg), tmp_path, seed)


def _llama(tmp_path, seed, **overrides):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80,
        max_position_embeddings=64, rms_norm_eps=1e-5, **overrides,
    )
    return _save(transformers.LlamaForCausalLM(cfg), tmp_path, seed)


def _save(model, tmp_path, seed, **save_kwargs):
    torch.manual_seed(seed)
    randomize_weights(model, seed)
    model.config._attn_implementation = "eager"
    model.float().eval()
    model.save_pretrained(tmp_path, safe_serialization=True, **save_kwargs)
    return model


def _ids(batch=2, length=13, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _assert_parity(hf_model, tmp_path):
    ours = load_hf_checkpoint(tmp_path)
    ids = _ids()
    with torch.no_grad():
        expected = hf_model(ids).logits
        got = ours(ids).logits
    assert expected.abs().max() > 1.0  # logits far from zero: the comparison is not vacuous
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)
    return ours, ids, expected


@pytest.mark.parametrize("case", NEOX_CASES, ids=list(NEOX_CASES))
def test_gpt_neox_logits_match(tmp_path, case):
    hf = _neox(tmp_path, seed=1, **NEOX_CASES[case])
    ours, _, _ = _assert_parity(hf, tmp_path)
    assert ours.cfg.norm == "layernorm" and ours.cfg.layout == "3" and not ours.training
    assert ours.cfg.parallel_residual == NEOX_CASES[case]["use_parallel_residual"]
    assert ours.cfg.rotary_dim == int(16 * NEOX_CASES[case]["rotary_pct"])


@pytest.mark.parametrize("case", LLAMA_CASES, ids=list(LLAMA_CASES))
def test_llama_logits_match(tmp_path, case):
    hf = _llama(tmp_path, seed=2, **LLAMA_CASES[case])
    ours, _, _ = _assert_parity(hf, tmp_path)
    assert ours.cfg.kv_heads == LLAMA_CASES[case].get("num_key_value_heads", 4)
    if ours.cfg.tie_embeddings:
        assert ours.head.weight is ours.embed.weight


@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
def test_cached_decoding_matches_hf_full_forward(tmp_path, family):
    hf = _neox(tmp_path, 3, rotary_pct=0.25) if family == "gpt_neox" else _llama(tmp_path, 3, num_key_value_heads=2)
    ours = load_hf_checkpoint(tmp_path)
    ids = _ids(seed=1)
    prefill = 6
    cache = LoopCache()
    with torch.no_grad():
        expected = hf(ids).logits
        steps = [ours(ids[:, :prefill], cache=cache).logits]
        for t in range(prefill, ids.shape[1]):
            steps.append(ours(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=ATOL, rtol=1e-5)
    assert cache.get_seq_length() == ids.shape[1]


def test_sharded_checkpoint(tmp_path):
    hf = _llama(tmp_path, 4)
    for f in tmp_path.iterdir():  # re-save sharded in place of the single file
        f.unlink()
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    _assert_parity(hf, tmp_path)


def test_missing_shard_is_named(tmp_path):
    hf = _llama(tmp_path, 5)
    for f in tmp_path.iterdir():
        f.unlink()
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_hf_checkpoint(tmp_path)
