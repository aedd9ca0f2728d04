"""Head-level looping (Eq. 6) and Block Loop in the model: the sliced per-head computation
equals the masked all-heads one (forward and gradients), causality and cache equivalence
with looped heads, depth 0 is the plain block, and the grown structure is saved."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looplm import LoopCache, LoopLM
from looplm.head_loop.attention import head_subset_attention
from looplm.head_loop.block import grown_structure
from looplm.model_config import ModelConfig

VARIANTS = {
    "mha": {},
    "gqa_gate_bias": {"n_kv_heads": 2, "mixer": {"kind": "attention", "output_gate": True}},
    "window": {"mixer": {"kind": "sliding_window", "window": 3}, "norm": "rmsnorm", "bias": False},
}


def _cfg(kind="heads", layout="1+2R2+1", **kw):
    return ModelConfig(vocab_size=40, d_model=32, n_heads=4, layout=layout, head_loop={"kind": kind}, **kw)


def _grown(cfg):
    torch.manual_seed(0)
    model = LoopLM(cfg).eval()
    blocks = model.blocks()
    blocks[1].head_loop.set(2, [1.0, 0.0, 0.5, 1.0])  # a looped core block, one head fading, one dropped
    blocks[3].head_loop.set(1, [0.0, 1.0, 0.0, 0.0])  # a coda block, one head
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sliced_heads_equal_masked_all_heads(variant):
    torch.manual_seed(0)
    model = LoopLM(_cfg(**VARIANTS[variant]))
    attn = model.blocks()[1].attn
    x = torch.randn(2, 7, 32)
    ctx, _ = model._context(torch.zeros(2, 7, dtype=torch.long), None, None, x.dtype)
    heads, weights = (0, 2, 3), (1.0, 0.25, 1.0)
    loop = model.blocks()[1].head_loop
    loop.set(1, [1.0, 0.0, 0.25, 1.0])
    captured = {}
    hook = attn.o_proj.register_forward_pre_hook(lambda m, a: captured.update(y=a[0]))
    attn(x, ctx)
    hook.remove()
    scale = torch.zeros(4)
    scale[list(heads)] = torch.tensor(weights)
    masked = F.linear(captured["y"] * scale.repeat_interleave(8), attn.o_proj.weight)  # Σ_i w_i y_i W_O^(i)
    sliced, state = head_subset_attention(attn, x, ctx, loop)
    torch.testing.assert_close(sliced, masked, atol=1e-6, rtol=1e-5)
    assert state.keys.shape[1] == (3 if attn.n_kv_heads == 4 else 2)  # only the kv heads S reads

    # gradients: the sliced pass touches only S's rows/columns, exactly as the masked one
    g = torch.randn_like(sliced)
    grads = torch.autograd.grad((sliced * g).sum(), [attn.qkv.weight, attn.o_proj.weight])
    captured.clear()
    hook = attn.o_proj.register_forward_pre_hook(lambda m, a: captured.update(y=a[0]))
    attn(x, ctx)
    hook.remove()
    masked = F.linear(captured["y"] * scale.repeat_interleave(8), attn.o_proj.weight)
    ref = torch.autograd.grad((masked * g).sum(), [attn.qkv.weight, attn.o_proj.weight])
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert grads[1][:, 8:16].abs().max() == 0  # head 1 of W_O untouched


@pytest.mark.parametrize("kind", ["heads", "block"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causality_and_cache_equivalence_with_loops(kind, variant):
    model = _grown(_cfg(kind, **VARIANTS[variant]))
    x = torch.randint(0, 40, (3, 12))
    full = model(x).logits
    for j in (0, 5, 11):
        y = x.clone()
        y[:, j] = (y[:, j] + 7) % 40
        changed = model(y).logits
        torch.testing.assert_close(changed[:, :j], full[:, :j], atol=1e-6, rtol=0)
    for prefill in (1, 5):
        cache = LoopCache()
        pieces = [model(x[:, :prefill], cache=cache).logits]
        pieces += [model(x[:, i : i + 1], cache=cache).logits for i in range(prefill, 12)]
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=2e-5, rtol=1e-5)
    cache = LoopCache()
    chunks = [model(x[:, a:b], cache=cache).logits for a, b in [(0, 4), (4, 9), (9, 12)]]
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=2e-5, rtol=1e-5)
    if variant == "window":
        return  # a sliding-window cache cannot be cropped behind its window
    cache.crop(6)
    cache.select_batch(torch.tensor([2, 0]))
    tail = torch.cat([model(x[[2, 0], i : i + 1], cache=cache).logits for i in range(6, 12)], 1)
    torch.testing.assert_close(tail, full[[2, 0], 6:], atol=2e-5, rtol=1e-5)


def test_loop_level_hybrid_loops_only_its_softmax_iterations():
    """A core block with attention at iteration 0 and GDN at iteration 1: the grown passes
    run (and are counted) at iteration 0 only; decoding still equals the full forward."""
    from looplm.accounting import count_flops
    from tests.invariants import assert_decodes_like_full_forward, prefill_then_tokens

    def grown(second: str):
        torch.manual_seed(0)
        model = LoopLM(_cfg(layout="1+1R2+1", loop_mixers=[{"kind": "attention"}, {"kind": second}])).eval()
        plain = count_flops(model, 10).forward
        model.core[0][0].head_loop.set(1, [1.0, 1.0, 0.0, 0.0])
        return model, count_flops(model, 10).forward - plain

    hybrid, extra = grown("gated_deltanet")
    assert [hybrid.core[0][0].extra_passes(t) for t in range(2)] == [1, 0]
    assert extra > 0 and 2 * extra == pytest.approx(grown("attention")[1])  # one of two iterations loops
    assert_decodes_like_full_forward(hybrid, torch.randint(0, 40, (2, 10)), [prefill_then_tokens(3, 10)], atol=2e-5)


def test_depth_zero_is_the_plain_model_and_loops_change_the_output():
    torch.manual_seed(0)
    plain = LoopLM(ModelConfig(vocab_size=40, d_model=32, n_heads=4, layout="1+2R2+1")).eval()
    torch.manual_seed(0)
    looped = LoopLM(_cfg()).eval()
    x = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(looped(x).logits, plain(x).logits, atol=0, rtol=0)
    looped.blocks()[2].head_loop.set(1, [0, 1, 1, 0])
    assert (looped(x).logits - plain(x).logits).abs().max() > 1e-4
    probs = looped(x, output_attentions=True).attentions
    assert probs[("core.1.loop1", 0)].shape[1] == 2  # the extra pass's own entry, |S| heads


def test_structure_is_saved_with_the_weights(tmp_path):
    model = _grown(_cfg())
    model.save_pretrained(tmp_path)
    loaded = LoopLM.from_pretrained(tmp_path).eval()
    assert grown_structure(loaded) == grown_structure(model)
    assert grown_structure(loaded)["core.0"] == {"depth": 2, "heads": [0, 2, 3], "weights": [1.0, 0.0, 0.5, 1.0]}
    x = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=0, rtol=0)
    assert sum(p.numel() for p in loaded.parameters()) == sum(
        p.numel() for p in LoopLM(ModelConfig(vocab_size=40, d_model=32, n_heads=4, layout="1+2R2+1")).parameters())


def test_checkpoints_that_name_the_structure_loop_still_load(tmp_path):
    """Before the head_loop package, a block's structure was saved as ``<block>.loop``."""
    from safetensors.torch import load_file, save_file

    model = _grown(_cfg())
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = {k.replace(".head_loop.", ".loop."): v for k, v in load_file(str(path)).items()}
    assert "core.0.1.loop._extra_state" in state
    save_file(state, str(path))
    (tmp_path / "manifest.json").unlink()  # save_pretrained wrote none then: such directories load unverified
    loaded = LoopLM.from_pretrained(tmp_path, verify=False).eval()
    assert grown_structure(loaded) == grown_structure(model)
    x = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=0, rtol=0)


def test_config_checks():
    from looplm.config_base import ConfigError

    with pytest.raises(ConfigError, match="model.head_loop.heads"):
        ModelConfig(n_heads=4, head_loop={"heads": 9})
    with pytest.raises(ConfigError, match="model.head_loop.kind"):
        ModelConfig(parallel_residual=True, head_loop={"kind": "heads"})
    with pytest.raises(ConfigError, match="model.head_loop.exclude"):
        ModelConfig(layout="4", head_loop={"exclude": [4]})
    with pytest.raises(ConfigError, match="model.head_loop"):
        ModelConfig(mixer={"kind": "retnet"}, head_loop={})


@pytest.mark.parametrize("mixer", [{"kind": "nsa", "block_size": 2, "select_blocks": 3, "window": 3},
                                   {"kind": "dsa", "top_k": 3, "index_heads": 2, "index_head_dim": 8}])
def test_sparse_softmax_mixers_build_grown_blocks_that_never_loop(mixer):
    """NSA and DSA count as softmax attention (entropy) but have no SoftmaxAttention layer to
    slice: their grown blocks build, and run the plain block whatever the structure says."""
    torch.manual_seed(0)
    model = LoopLM(ModelConfig(vocab_size=40, d_model=32, n_heads=4, layout="3", mixer=mixer, head_loop={}))
    block = model.blocks()[1]
    block.head_loop.set(2, [1.0, 1.0, 0.0, 0.0])
    assert block.extra_passes() == 0 and block.softmax_layers() == []
    assert not block.arrange_heads([1, 3]) and block.head_loop.order == (0, 1, 2, 3)
    model(torch.randint(0, 40, (2, 9)))

