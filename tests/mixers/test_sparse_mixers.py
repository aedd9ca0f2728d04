"""Sparse-attention mixers (NSA, DSA): causality, cache and padding equivalence alone and in
loops, agreement with flash-linear-attention's naive references, hand-made selections, and
the DSA indexer's training loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looplm import LoopCache, LoopLM
from looplm.config_base import ConfigError
from looplm.mixers import MixerContext
from looplm.mixers.attention import SoftmaxAttention
from looplm.mixers.dsa import DeepSeekSparseAttention, DSAConfig
from looplm.mixers.nsa import NativeSparseAttention, NSAConfig
from looplm.model_config import ModelConfig
from looplm.modules.rotary import Rotary, apply_rotary
from looplm.ops.sparse import (
    dsa_attention,
    index_kl_loss,
    index_scores,
    naive_nsa_attention,
    nsa_attention,
    select_blocks,
    topk_indices,
    topk_mask,
)
from tests.conftest import random_ids, tiny_config
from tests.invariants import (
    assert_decodes_like_full_forward,
    assert_strictly_causal,
    prefill_then_tokens,
)

NSA_MEAN = {"kind": "nsa", "block_size": 2, "select_blocks": 4, "window": 3}
NSA_MLP = {"kind": "nsa", "block_size": 4, "block_stride": 2, "select_block_size": 3, "select_blocks": 4,
           "window": 2, "compression": "mlp", "output_gate": True}
DSA = {"kind": "dsa", "top_k": 3, "index_heads": 2, "index_head_dim": 8}
MIXERS = {"nsa-mean": NSA_MEAN, "nsa-mlp": NSA_MLP, "dsa": DSA}
SETTINGS = [("mesh", "1+1R3+1", 4), ("anchor", "1+1R3+1", 2), ("base", "2", 4)]  # topology, layout, kv heads
GRID = [(f"{m}-{topo}-{layout}", MIXERS[m], topo, layout, kv) for m in MIXERS for topo, layout, kv in SETTINGS]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _model(mixer, topology="mesh", layout="1+1R3+1", kv=4) -> LoopLM:
    return LoopLM(tiny_config(topology, layout=layout, mixer=mixer, n_kv_heads=kv)).eval()


def _context(batch: int, length: int, rotary_dim: int, dtype=torch.float32) -> MixerContext:
    positions = torch.arange(length).expand(batch, length)
    valid = torch.ones(batch, length, dtype=torch.bool)
    return MixerContext(rope=Rotary(rotary_dim, 10000.0)(positions, dtype), valid=valid, past=0, padded=False)


# ---------------------------------------------------------------- invariants in a model
@pytest.mark.parametrize("name,mixer,topology,layout,kv", GRID, ids=[g[0] for g in GRID])
def test_strict_causality(name, mixer, topology, layout, kv):
    assert_strictly_causal(_model(mixer, topology, layout, kv), random_ids(2, 17), (0, 5, 9, 16), shift=7, atol=0)


@pytest.mark.parametrize("name,mixer,topology,layout,kv", GRID, ids=[g[0] for g in GRID])
def test_cache_equivalence_token_by_token_and_chunked(name, mixer, topology, layout, kv):
    splits = [prefill_then_tokens(6, 14), [1, 5, 9, 10, 14]]  # prefill + tokens; chunks against a cache
    assert_decodes_like_full_forward(_model(mixer, topology, layout, kv), random_ids(3, 14), splits, atol=2e-5)


@pytest.mark.parametrize("name,mixer,topology,layout,kv", GRID, ids=[g[0] for g in GRID])
def test_left_padded_rows_equal_unpadded_rows_in_prefill_and_decoding(name, mixer, topology, layout, kv):
    """Rows with 0, 3 and 6 padding positions: blocks complete at different steps per row."""
    model = _model(mixer, topology, layout, kv)
    rows = [random_ids(1, 14 - p, seed=p + 1)[0] for p in (0, 3, 6)]
    batch = torch.stack([F.pad(r, (14 - len(r), 0)) for r in rows])
    mask = torch.stack([F.pad(torch.ones_like(r), (14 - len(r), 0)) for r in rows])
    more = random_ids(3, 5, seed=9)
    out = model(batch, attention_mask=mask).logits
    cache = LoopCache()
    model(batch[:, :4], attention_mask=mask[:, :4], cache=cache)  # row 2 is all padding so far
    model(batch[:, 4:10], attention_mask=mask[:, 4:10], cache=cache)
    steps = [model(batch[:, 10:14], attention_mask=mask[:, 10:14], cache=cache).logits]
    steps += [model(more[:, i : i + 1], cache=cache).logits for i in range(5)]
    decoded = torch.cat(steps, dim=1)  # positions 10 .. 18
    for b, row in enumerate(rows):
        alone = model(torch.cat([row, more[b]])[None]).logits[0]
        n = len(row)
        torch.testing.assert_close(out[b, 14 - n :], alone[:n], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(decoded[b], alone[n - 4 :], atol=2e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name,mixer,topology,layout,kv", GRID, ids=[g[0] for g in GRID])
def test_left_padded_rows_decode_alike_on_the_static_cache(name, mixer, topology, layout, kv):
    """The static cache (preallocated, written in place, no host read per token) from a
    left-padded prefill: single tokens and a chunk equal each row decoded alone. NSA's rows
    complete their compressed blocks at different steps; DSA's pick among valid columns."""
    model = _model(mixer, topology, layout, kv)
    rows = [random_ids(1, 10 - p, seed=p + 1)[0] for p in (0, 3, 6)]
    batch = torch.stack([F.pad(r, (10 - len(r), 0)) for r in rows])
    mask = torch.stack([F.pad(torch.ones_like(r), (10 - len(r), 0)) for r in rows])
    more = random_ids(3, 9, seed=9)
    cache = LoopCache(full_loop=True)
    model(batch, attention_mask=mask, cache=cache)
    static = cache.static(24)
    steps = [model(more[:, i : i + 1], cache=static).logits for i in range(5)]
    steps.append(model(more[:, 5:9], cache=static).logits)  # a chunk: eager against the static cache
    decoded = torch.cat(steps, dim=1)
    for b, row in enumerate(rows):
        alone = model(torch.cat([row, more[b]])[None]).logits[0]
        torch.testing.assert_close(decoded[b], alone[len(row):], atol=2e-5, rtol=1e-5)


def test_dsa_static_step_under_top_k_folds_grouped_heads():
    """While the static buffer holds at most top_k rows a DSA step is plain attention over
    it: each kv head's G query heads folded into the query axis, one MHA-shaped call under
    the buffer's mask (no H-head call over grouped keys, which CUDA runs in its math kernel
    with copies), equal to the whole sequence's forward, padded rows included."""
    from tests.ops.test_dsa import Shapes

    model = _model({**DSA, "top_k": 64}, "anchor", kv=2)  # 4 query heads over 2 kv heads
    ids = random_ids(2, 9)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    cache = LoopCache(full_loop=True)
    model(ids[:, :8], attention_mask=mask, cache=cache)
    static = cache.static(16)
    with torch.no_grad(), Shapes() as made:
        step = model(ids[:, 8:], cache=static).logits[:, 0]
    calls = [shape for op, shape in made.shapes if "scaled_dot_product" in op and len(shape) == 4]  # the outputs
    assert calls and all(shape[1:3] == (2, 2) for shape in calls), calls  # [B, H_kv, G, D]
    torch.testing.assert_close(step[0], model(ids[:1]).logits[0, 8], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(step[1], model(ids[1:, 3:]).logits[0, 5], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mixer", [NSA_MEAN, NSA_MLP], ids=["nsa-mean", "nsa-mlp"])
def test_nsa_static_decoding_step_reads_nothing_back(mixer):
    """A captured decoding step must not depend on the data's shapes: NSA's step on the
    static cache dispatches no host sync (the growing cache's step reads block counts)."""
    from looplm.accounting.dispatch import count_dispatch

    model = _model(mixer)
    cache = LoopCache(full_loop=True)
    model(random_ids(2, 9), cache=cache)
    static = cache.static(32)
    counts, _ = count_dispatch(lambda: model(random_ids(2, 1, seed=4), cache=static))
    assert counts.syncs == 0, counts.by_op
    growing, _ = count_dispatch(lambda: model(random_ids(2, 1, seed=4), cache=cache))
    assert growing.syncs > 0  # the eager path's shapes follow the data


@pytest.mark.parametrize("mixer", [NSA_MLP, DSA], ids=["nsa", "dsa"])
def test_cache_crop_and_select_batch(mixer):
    model = _model(mixer, "anchor", kv=2)
    x = random_ids(3, 15)
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    full = model(x, attention_mask=mask).logits
    cache = LoopCache()
    model(x[:, :12], attention_mask=mask[:, :12], cache=cache)
    cache.crop(9)
    for i in (9, 10):
        torch.testing.assert_close(model(x[:, i : i + 1], cache=cache).logits[:, 0], full[:, i], atol=2e-5, rtol=1e-5)
    cache.select_batch(torch.tensor([2, 1]))
    torch.testing.assert_close(model(x[[2, 1], 11:12], cache=cache).logits[:, 0], full[[2, 1], 11], atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- NSA
def _nsa_layer(kv=2, **kwargs) -> NativeSparseAttention:
    options = dict(block_size=4, block_stride=4, select_block_size=4, select_blocks=5, window=3, compression="mean")
    options.update(kwargs)
    return NativeSparseAttention(32, 4, kv, bias=False, **options)


def test_nsa_matches_fla_naive_reference():
    """l = d = l', mean compression: fla's compression, top-k and selection references (its
    window branch needs flash-attn, so the window reference is a masked SDPA here)."""
    naive = pytest.importorskip("fla.ops.nsa.naive")
    B, T, H, Hkv, D, BS = 2, 37, 4, 2, 8, 4
    layer = _nsa_layer()
    layer.o_proj = torch.nn.Identity()
    x = torch.randn(B, T, 32)
    ctx = _context(B, T, D)
    out, _ = layer(x, ctx)

    q = apply_rotary(layer.q_proj(x).view(B, T, H, D).transpose(1, 2), *ctx.rope).transpose(1, 2)  # [B, T, H, D]
    k = apply_rotary(layer.k_proj(x).view(B, T, Hkv, D).transpose(1, 2), *ctx.rope).transpose(1, 2)
    v = layer.v_proj(x).view(B, T, Hkv, D)
    g_cmp, g_slc, g_swa = torch.sigmoid(layer.g_proj(x)).view(B, T, H, 3).unbind(-1)
    pad = -T % BS  # fla mean-pools the last, partial block over its own length
    k_cmp = torch.cat([k, k[:, -1:].expand(B, pad, Hkv, D)], 1).view(B, -1, BS, Hkv, D).mean(2)
    v_cmp = torch.cat([v, v[:, -1:].expand(B, pad, Hkv, D)], 1).view(B, -1, BS, Hkv, D).mean(2)
    k_cmp[:, -1], v_cmp[:, -1] = k[:, T - T % BS :].mean(1), v[:, T - T % BS :].mean(1)
    scale = D**-0.5
    o_cmp, _ = naive.naive_nsa_compression(q, k_cmp, v_cmp, BS, scale)
    indices = naive.naive_nsa_topk(q, k_cmp, 5, BS, scale)  # [B, T, H_kv, 5]
    o_slc = naive.naive_nsa_selection(q, k, v, indices, BS, scale)
    i = torch.arange(T)
    window = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3)
    kr, vr = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    o_swa = F.scaled_dot_product_attention(q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), attn_mask=window)
    reference = g_cmp[..., None] * o_cmp + g_slc[..., None] * o_slc + g_swa[..., None] * o_swa.transpose(1, 2)
    torch.testing.assert_close(out, reference.reshape(B, T, H * D), atol=1e-5, rtol=1e-5)


def test_nsa_selects_initial_local_and_most_important_visible_blocks():
    # 6 selection blocks of l' = 2; query positions 0, 5, 11 and a padding query (-1)
    importance = torch.tensor([0.0, 0.1, 0.5, 0.2, 0.9, 0.3]).expand(1, 1, 4, 6)
    positions = torch.tensor([[0, 5, 11, -1]])
    chosen = select_blocks(importance, positions, select_size=2, n_select=4)[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],  # t=0: only block 0 exists
        [1, 1, 1, 0, 0, 0],  # t=5: own block 2, previous 1, initial 0; 3+ not yet started
        [1, 0, 1, 0, 1, 1],  # t=11: initial 0, local 5 and 4, then the most important: 2 (0.5)
        [0, 0, 0, 0, 0, 0],  # padding query
    ], dtype=torch.bool)
    torch.testing.assert_close(chosen, expected)


def test_nsa_selection_follows_compressed_scores_on_a_constructed_input():
    """Keys of block 3 point along the query, all others against it: block 3 is chosen
    for queries far enough to see it, and the output there equals attention over
    blocks {0, 3, own, previous}."""
    D, T = 4, 24
    direction = torch.tensor([1.0, 0.0, 0.0, 0.0])
    k = -direction.repeat(T, 1) + 0.01 * torch.randn(T, D)
    k[6:8] = 3 * direction  # block 3 of l = 2
    v = torch.randn(T, D)
    q = 2 * direction.repeat(T, 1)
    k_cmp, v_cmp = k.view(-1, 2, D).mean(1), v.view(-1, 2, D).mean(1)
    gates = torch.tensor([0.0, 1.0, 0.0]).expand(1, 1, 1, T, 3)
    o, selected = nsa_attention(
        q[None, None, None], k[None, None], v[None, None], k_cmp[None, None], v_cmp[None, None], gates,
        torch.arange(T)[None], block_size=2, stride=2, select_size=2, n_select=4, window=0, scale=1.0,
    )
    for t in range(14, T):
        own = t // 2
        assert selected[0, 0, t].nonzero().flatten().tolist() == sorted({0, 3, own - 1, own})
        keys = torch.tensor([i for i in range(t + 1) if i // 2 in {0, 3, own - 1, own}])
        p = torch.softmax(k[keys] @ q[t], dim=0)
        torch.testing.assert_close(o[0, 0, 0, t], p @ v[keys])


def test_nsa_compressed_block_is_invisible_until_complete():
    """Compressed branch only, l = 4, d = 2: changing key 9 changes blocks [6, 10) and
    [8, 12), which query t sees only once j·d + l − 1 <= t, i.e. from t = 9 on."""
    T, D = 14, 4
    q, k, v = torch.randn(3, 1, 1, T, D).unbind(0)  # [1, 1, T, D] each
    gates = torch.tensor([1.0, 0.0, 0.0]).expand(1, 1, 1, T, 3)

    def run(keys):
        blocks = keys.unfold(2, 4, 2).transpose(-1, -2).mean(-2)  # [1, 1, 6, D]: block j = [2j, 2j + 4)
        values = v.unfold(2, 4, 2).transpose(-1, -2).mean(-2)
        o, _ = nsa_attention(q[:, :, None], keys, v, blocks, values, gates, torch.arange(T)[None], block_size=4,
                             stride=2, select_size=4, n_select=3, window=0, scale=1.0)
        return o[0, 0, 0]

    base = run(k)
    changed_keys = k.clone()
    changed_keys[0, 0, 9] += 1.0
    changed = run(changed_keys)
    torch.testing.assert_close(changed[:9], base[:9], atol=0, rtol=0)
    assert (changed[9] - base[9]).abs().max() > 1e-4
    torch.testing.assert_close(base[:3], torch.zeros(3, D))  # no block is complete before t = 3


def test_nsa_decoding_state_keeps_compressed_blocks_of_the_full_forward():
    model = _model(NSA_MLP, "base", "2", kv=2)
    x = random_ids(2, 13)
    full_cache, cache = LoopCache(), LoopCache()
    model(x, cache=full_cache)
    model(x[:, :3], cache=cache)
    for i in range(3, 13):
        model(x[:, i : i + 1], cache=cache)
    full, stepped = full_cache.get("prelude.0", 0), cache.get("prelude.0", 0)
    assert stepped.k_cmp.shape[2] == (13 - 4) // 2 + 1
    torch.testing.assert_close(stepped.k_cmp, full.k_cmp, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(stepped.v_cmp, full.v_cmp, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- DSA
def _dsa_layer(kv=2, top_k=5, output_gate=False) -> DeepSeekSparseAttention:
    return DeepSeekSparseAttention(32, 4, kv, bias=True, top_k=top_k, index_heads=8, index_head_dim=8,
                                   output_gate=output_gate)


@pytest.mark.parametrize("kv,gate", [(4, False), (2, True)])
def test_dsa_with_top_k_at_least_the_length_is_dense_softmax_attention(kv, gate):
    dsa = _dsa_layer(kv, top_k=11, output_gate=gate).eval()
    dense = SoftmaxAttention(32, 4, kv, bias=True, output_gate=gate)
    dense.load_state_dict({k: v for k, v in dsa.state_dict().items() if not k.startswith("indexer.")})
    x = torch.randn(2, 11, 32)
    ctx = _context(2, 11, 8)
    torch.testing.assert_close(dsa(x, ctx)[0], dense(x, ctx)[0], atol=1e-6, rtol=1e-5)


def test_rotating_tensors_together_equals_rotating_each():
    from looplm.mixers.dsa import rotate_together

    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(2, n, 5, d, generator=g) for n, d in ((4, 8), (2, 8), (3, 12), (1, 12))]
    for rotary_dim in (0, 4, 8):
        rope = Rotary(rotary_dim, 10000.0)(torch.arange(5).expand(2, 5), torch.float32)
        together = rotate_together(tensors, *rope)
        for x, y in zip(together, tensors):
            assert torch.equal(x, apply_rotary(y, *rope))  # the same arithmetic, bit for bit


def test_dsa_matches_fla_naive_reference():
    naive = pytest.importorskip("fla.ops.dsa.naive")
    B, T, H, Hkv, D = 2, 23, 4, 2, 8
    layer = _dsa_layer().eval()
    with torch.no_grad():
        layer.indexer.w_proj.weight.abs_()  # positive weights: ties of the ReLU scores stay rare
    layer.o_proj = torch.nn.Identity()
    x = torch.randn(B, T, 32)
    ctx = _context(B, T, D)
    out, _ = layer(x, ctx)
    q, k, v = layer.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = apply_rotary(q.view(B, T, H, D).transpose(1, 2), *ctx.rope).transpose(1, 2)
    k = apply_rotary(k.view(B, T, Hkv, D).transpose(1, 2), *ctx.rope).transpose(1, 2)
    q_idx, k_idx, w_idx = layer.indexer(x, ctx.rope)
    reference = naive.naive_dsa(q, k, v.view(B, T, Hkv, D), q_idx, k_idx, w_idx, topk=5)
    torch.testing.assert_close(out, reference.reshape(B, T, H * D), atol=1e-5, rtol=1e-5)


def test_topk_ties_go_to_the_later_position_and_skip_masked_entries():
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, float("-inf"), 1.0]])
    torch.testing.assert_close(topk_mask(scores, 3), torch.tensor([[False, True, False, True, False, True]]))
    assert topk_mask(scores, 6).sum() == 5


def test_dsa_index_loss_is_finite_and_trains_only_the_indexer():
    model = LoopLM(tiny_config("mesh", layout="1+1R2+1", mixer=DSA)).train()
    x = random_ids(2, 12)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    out = model(x, random_ids(2, 12, seed=1), attention_mask=mask)
    index_loss = out.aux_losses["dsa_index"]  # summed over 4 DSA calls (prelude, core x 2, coda)
    assert torch.isfinite(index_loss) and index_loss >= 0
    torch.testing.assert_close(out.loss, out.lm_loss + index_loss)
    index_loss.backward()
    for name, p in model.named_parameters():  # the indexers only: their input is detached, their target too
        has_grad = p.grad is not None and p.grad.abs().sum() > 0
        assert has_grad == (".indexer." in name), name
    assert model.eval()(x).aux_losses == {}  # no indexer loss outside training


def test_dsa_training_path_equals_inference_path():
    layer = _dsa_layer(top_k=4)
    x = torch.randn(2, 13, 32)
    ctx = _context(2, 13, 8)
    trained, _ = layer.train()(x, ctx)
    assert "dsa_index" in ctx.losses
    ctx.losses.clear()
    inferred, _ = layer.eval()(x, ctx)
    torch.testing.assert_close(trained, inferred, atol=1e-5, rtol=1e-5)
    assert ctx.losses == {}


def _dsa_inputs(B=2, T=29, S=37, Hkv=2, G=2, D=8, HI=3, DI=8, seed=5):
    """Random DSA inputs for the last T of S positions, row 0 left-padded by 6; every input
    that carries a gradient requires one."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(*shape, generator=g).requires_grad_(True) for shape in
               ((B, Hkv, G, T, D), (B, Hkv, S, D), (B, Hkv, S, D), (B, T, HI, DI), (B, S, DI), (B, T, HI))]
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[0, :6] = False
    return tensors, valid


def test_dsa_query_blocks_equal_one_block_forward_backward_and_loss():
    """Blocks of 4 queries (checkpointed) give the outputs, index loss and gradients of one
    block with every query."""
    results = []
    for block in (4, 1000):
        tensors, valid = _dsa_inputs()
        o, loss = dsa_attention(*tensors, valid, top_k=5, scale=8**-0.5, index_loss=True, block=block)
        (o * torch.linspace(-1, 1, o.shape[-1])).sum().add(loss).backward()
        results.append((o.detach(), loss.detach(), [t.grad for t in tensors]))
    (o_blocks, loss_blocks, grads_blocks), (o_one, loss_one, grads_one) = results
    torch.testing.assert_close(o_blocks, o_one, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loss_blocks, loss_one, atol=1e-6, rtol=1e-5)
    for name, a, b in zip(["q", "k", "v", "q_index", "k_index", "w_index"], grads_blocks, grads_one):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_dsa_gradcheck_through_checkpointed_blocks():
    """float64 gradcheck with blocks of 3 queries (the checkpointed path): the output against
    q, k, v, and the index loss against the indexer's inputs (its attention target is
    detached by design, Eq. (3)). The selection is fixed under the check's perturbations."""
    tensors, valid = _dsa_inputs(B=1, T=7, S=9, HI=2, DI=4, D=4)
    q, k, v, q_index, k_index, w_index = (t.detach().double() for t in tensors)

    def output(q, k, v):
        return dsa_attention(q, k, v, q_index, k_index, w_index, valid, top_k=4, scale=0.5, block=3)[0]

    def index_loss(q_index, k_index, w_index):
        return dsa_attention(q, k, v, q_index, k_index, w_index, valid, top_k=4, scale=0.5, index_loss=True,
                             block=3)[1]

    assert torch.autograd.gradcheck(output, tuple(t.requires_grad_(True) for t in (q, k, v)))
    q, k, v = (t.detach() for t in (q, k, v))
    assert torch.autograd.gradcheck(index_loss, tuple(t.requires_grad_(True) for t in (q_index, k_index, w_index)))


def test_dsa_training_keeps_no_scores_of_all_queries_for_the_backward():
    """What the forward saves for the backward grows like T·D, not T·S: the block's scores and
    probabilities are recomputed in the backward."""
    largest = []
    for length in (128, 256):
        tensors, valid = _dsa_inputs(T=length, S=length, D=16, DI=16)
        saved = [0]

        def pack(t, saved=saved):
            saved[0] = max(saved[0], t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            dsa_attention(*tensors, valid, top_k=8, scale=0.25, index_loss=True, block=32)
        largest.append(saved[0])
    assert largest[1] <= 2 * largest[0] and largest[1] < 256 * 256, largest


def test_dsa_index_loss_is_zero_when_the_indexer_matches_attention():
    attention = torch.softmax(torch.randn(1, 2, 3, 4), -1)
    target = attention.sum(1) / 2
    selected = torch.ones(1, 3, 4, dtype=torch.bool)
    loss = index_kl_loss(target.log(), attention, selected, torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(loss, torch.tensor(0.0), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- configs
@pytest.mark.parametrize(
    "mixer,field",
    [({"kind": "nsa", "select_blocks": 2}, "select_blocks"),
     ({"kind": "nsa", "block_size": 4, "block_stride": 5}, "block_stride"),
     ({"kind": "nsa", "compression": "max"}, "compression"), ({"kind": "nsa", "window": -1}, "window"),
     ({"kind": "dsa", "top_k": 0}, "top_k"), ({"kind": "dsa", "topk": 3}, "topk"),
     ({"kind": "dsa", "kernel": "cuda"}, "kernel")],
)
def test_sparse_config_errors_name_the_field(mixer, field):
    with pytest.raises(ConfigError, match=f"model.mixer.{field}"):
        ModelConfig.from_dict({"mixer": mixer}, prefix="model")


def test_sparse_configs_round_trip_and_build():
    for mixer in (NSA_MLP, DSA):
        cfg = ModelConfig.from_dict({"mixer": mixer, "d_model": 32, "n_heads": 4}, prefix="model")
        assert cfg.mixer.to_dict() == {**type(cfg.mixer)().to_dict(), **mixer}
        assert cfg.mixer.is_softmax
    assert isinstance(NSAConfig(block_size=8).build(tiny_config().block_shape), NativeSparseAttention)
    with pytest.raises(ConfigError, match="model.mixer.index_head_dim"):
        DSAConfig(index_head_dim=4).build(tiny_config().block_shape)  # rotary dim 8


@pytest.mark.parametrize(
    "T,S,G,block,stride,select,n,window,padded",
    [(37, 37, 2, 4, 4, 4, 5, 3, False), (301, 301, 2, 8, 4, 16, 4, 64, True), (5, 300, 3, 16, 16, 16, 4, 130, False),
     (260, 260, 1, 16, 8, 32, 3, 0, True), (1, 50, 2, 4, 4, 4, 3, 7, True), (400, 400, 1, 16, 16, 16, 3, 200, False)],
)
def test_nsa_attention_equals_the_dense_reference(T, S, G, block, stride, select, n, window, padded):
    """The gathered selected branch and the blocked window branch against the dense masked
    reference, forward and backward: odd lengths, decoding-like T < S, padding queries,
    no window and windows larger than the query block."""
    torch.manual_seed(0)
    B, Hkv, D = 2, 2, 8
    q = torch.randn(B, Hkv, G, T, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hkv, S, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    N = max((S - block) // stride + 1, 0)
    k_cmp, v_cmp = (torch.randn(B, Hkv, N, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    gates = torch.rand(B, Hkv, G, T, 3, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(S - T, S).expand(B, T).clone()
    if padded:  # row 0 left-padded by 7: its first queries are padding (-1)
        positions[0] = (positions[0] - 7).clamp(min=-1)
    args = (q, k, v, k_cmp, v_cmp, gates, positions)
    options = dict(block_size=block, stride=stride, select_size=select, n_select=n, window=window, scale=D**-0.5)
    o, selected = nsa_attention(*args, **options)
    o_ref, selected_ref = naive_nsa_attention(*args, **options)
    assert torch.equal(selected, selected_ref)
    tol = dict(atol=1e-6, rtol=1e-6)  # both take their softmax in float32
    torch.testing.assert_close(o, o_ref, **tol)
    grad = torch.randn_like(o)
    inputs = (q, k, v, k_cmp, v_cmp, gates)
    for a, b in zip(torch.autograd.grad(o, inputs, grad), torch.autograd.grad(o_ref, inputs, grad)):
        torch.testing.assert_close(a, b, **tol)


def test_gathered_attention_equals_the_dense_mask_and_reads_only_allowed_keys():
    from looplm.ops.sparse.common import gathered_attention, grouped_attention

    g = torch.Generator().manual_seed(3)
    B, Hkv, G, T, S, D, width = 2, 2, 3, 5, 40, 8, 6
    q = torch.randn(B, Hkv, G, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    scores = torch.randn(B, T, S, generator=g)
    scores[0, 1] = float("-inf")  # a row with nothing allowed: zeros
    scores[1, 2, :] = float("-inf")
    scores[1, 2, 7] = 0.5  # a row with fewer keys than width
    index, keep = topk_indices(scores, width)
    allowed = topk_mask(scores, width)
    assert keep.sum() == allowed.sum() == (B * T - 2) * width + 1
    dense, _ = grouped_attention(q, k, v, allowed[:, None, None], 0.3)
    torch.testing.assert_close(gathered_attention(q, k, v, index, keep, 0.3), dense, atol=1e-12, rtol=1e-12)
    # keys and values nobody selected are never read: poison them
    unused = ~allowed.any(dim=1)  # [B, S]
    k_bad = k.masked_fill(unused[:, None, :, None], float("nan"))
    v_bad = v.masked_fill(unused[:, None, :, None], float("nan"))
    out = gathered_attention(q, k_bad, v_bad, index.masked_fill(~keep, 7), keep, 0.3)  # fillers point at key 7
    torch.testing.assert_close(out, dense, atol=1e-12, rtol=1e-12)


def test_dsa_decoding_step_reads_only_its_top_k_rows_and_equals_the_masked_path():
    """A decoding step (one query, no padding) selects by one top-k over the whole row and
    gathers those rows: the same output as the candidate-mask path and as dense attention
    over the selected keys, and blind to every key and value it did not select."""
    (q, k, v, q_index, k_index, w_index), _ = _dsa_inputs(T=1, S=40, seed=9)
    q, k, v, q_index, k_index, w_index = (x.detach() for x in (q, k, v, q_index, k_index, w_index))
    valid = torch.ones(2, 40, dtype=torch.bool)
    fast, _ = dsa_attention(q, k, v, q_index, k_index, w_index, None, top_k=6, scale=0.3)
    masked, _ = dsa_attention(q, k, v, q_index, k_index, w_index, valid, top_k=6, scale=0.3)
    torch.testing.assert_close(fast, masked)
    scores = index_scores(q_index, k_index, w_index)  # [B, 1, S]
    selected = topk_mask(scores, 6)
    from looplm.ops.sparse.common import grouped_attention

    dense, _ = grouped_attention(q, k, v, selected[:, None, None], 0.3)
    torch.testing.assert_close(fast, dense)
    unused = ~selected[:, 0]  # [B, S]
    k_bad = k.masked_fill(unused[:, None, :, None], float("nan"))
    v_bad = v.masked_fill(unused[:, None, :, None], float("nan"))
    blind, _ = dsa_attention(q, k_bad, v_bad, q_index, k_index, w_index, None, top_k=6, scale=0.3)
    torch.testing.assert_close(blind, fast)


@pytest.mark.parametrize("batch,kv,padded", [(1, 4, False), (2, 2, False), (2, 2, True)])
def test_dsa_decoding_step_dispatches_few_operators(batch, kv, padded):
    """One decoded token of a DSA layer past top_k (issue 30): projections, one rotation of
    q, k and the indexer's q and k together, three in-place cache writes, the index scores,
    one top-k over a 5-op int64 key (its positions reused from the state, not a new arange),
    two gathers and the attention over the k picks; no zeros for a loss it does not
    compute. Was 74 operators, then 37, now 27 (one SDPA call over the picks, no
    concatenation back for the wholly rotated q and k); with left padding (candidate mask,
    -inf flags, the fillers' attention mask) was 102, then 44, now 35."""
    from looplm.accounting.dispatch import count_dispatch

    layer = _dsa_layer(kv=kv, top_k=6).eval()
    S = 30
    x = torch.randn(batch, S + 3, 32)
    rope = Rotary(8, 10000.0)(torch.arange(S + 3).expand(batch, S + 3), torch.float32)
    real = torch.ones(batch, S + 3, dtype=torch.bool)
    real[0, :4 if padded else 0] = False

    def context(past: int, length: int) -> MixerContext:
        return MixerContext(rope=tuple(r[:, past:past + length] for r in rope), valid=real[:, :past + length],
                            past=past, padded=padded)

    with torch.no_grad():
        _, state = layer(x[:, :S], context(0, S))
        _, state = layer(x[:, S:S + 1], context(S, 1), state)  # moves the cache into a reserve with spare rows
        token = x[:, S + 1:S + 2].contiguous()  # as the model's hidden state (a slice would cost each bias an add)
        step = context(S + 1, 1)
        count, (out, _) = count_dispatch(lambda: layer(token, step, state))
        full, _ = layer(x[:, :S + 2], context(0, S + 2))
    torch.testing.assert_close(out, full[:, -1:], atol=1e-6, rtol=1e-5)
    assert count.syncs == 0, count.by_op
    assert count.ops <= (35 if padded else 27), str(sorted(count.by_op.items()))
    assert "aten.arange" not in count.by_op and "aten.zeros" not in count.by_op, count.by_op


@pytest.mark.parametrize("S", [9, 40])
def test_dsa_padded_decoding_step_equals_the_full_forward_last_query(S):
    """A decoding step with left padding (row 0: 6 padding keys, so at S = 9 it has fewer
    real keys than top_k and the top-k carries fillers) and a padding query (row 1's last
    position: it attends to itself only) equals the last query of a full forward."""
    (q, k, v, q_index, k_index, w_index), _ = _dsa_inputs(T=S, S=S, seed=11)
    q, k, v, q_index, k_index, w_index = (x.detach() for x in (q, k, v, q_index, k_index, w_index))
    valid = torch.ones(2, S, dtype=torch.bool)
    valid[0, :6] = False
    valid[1, -1] = False
    full, _ = dsa_attention(q, k, v, q_index, k_index, w_index, valid, top_k=6, scale=0.3)
    step, _ = dsa_attention(q[:, :, :, -1:], k, v, q_index[:, -1:], k_index, w_index[:, -1:], valid, top_k=6,
                            scale=0.3)
    torch.testing.assert_close(step, full[:, :, :, -1:], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(step[1, :, :, 0], v[1, :, None, -1].expand(-1, 2, -1), atol=1e-6, rtol=1e-5)


#: LT2 0.6B's DSA options (lt2-0.6b-hybrid-gdn-dsa) on a narrow one-block model
LT2_DSA = ["model.d_model=128", "model.n_heads=2", "model.layout=1R1", "model.mixer.top_k=2048",
           "model.mixer.index_heads=64", "model.mixer.index_head_dim=128", "model.max_seq_len=2200"]
#: operators of one DSA decoding pass (its projections, rotation, cache writes, attention and
#: output projection) by cache and history; the static cache's include its attention bias,
#: made once per forward for every layer (8 operators). Before issue 30's DSA split: 46, 34,
#: 44, 44 (below top_k: index scores and dense masked attention over a candidate mask; past
#: it: bmm, scale, softmax, bmm over the picks and masked fills for a static cache's candidates)
DSA_DECODE_OPS = {("growing", 1000): 13, ("growing", 2100): 29, ("static", 1000): 21, ("static", 2100): 39}


@pytest.mark.parametrize("cache,context", sorted(DSA_DECODE_OPS))
def test_dsa_decoding_pass_at_lt2_size_dispatches_few_operators(cache, context):
    """One decoded token's DSA pass at the LT2 0.6B mixer options (top-k 2048, a 64 × 128
    indexer): with at most top_k keys (a history below top_k, or a static buffer of at most
    top_k rows) it is plain attention over the cache — no index queries, scores or top-k —
    and past top_k one top-k, two gathers and one SDPA call; equal to the full forward."""
    from looplm import load_config
    from looplm.accounting.dispatch import count_dispatch
    from looplm.cache import LoopCache

    torch.manual_seed(0)
    model = LoopLM(load_config("tiny-lt2-dsa", LT2_DSA).model).eval()
    layer = next(m for m in model.modules() if isinstance(m, DeepSeekSparseAttention))
    ids = torch.randint(0, model.cfg.vocab_size, (2, context + 2))
    counts = []

    def counted(x, ctx, state=None):
        count, out = count_dispatch(lambda: type(layer).forward(layer, x, ctx, state))
        counts.append(count)
        return out

    with torch.no_grad():
        kv = LoopCache(full_loop=cache == "static")
        model(ids[:, :context], cache=kv, logits_to_keep=1)
        if cache == "static":
            kv = kv.static(context + 2)
        model(ids[:, context:context + 1], cache=kv, logits_to_keep=1)  # the growing cache moves into spare rows
        layer.forward = counted
        try:
            logits = model(ids[:, context + 1:], cache=kv, logits_to_keep=1).logits
        finally:
            del layer.forward
        full = model(ids, logits_to_keep=1).logits
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-4)
    (count,) = counts
    assert count.syncs == 0, count.by_op
    assert count.ops <= DSA_DECODE_OPS[cache, context], str(sorted(count.by_op.items()))
    assert ("aten.topk" in count.by_op) == (context > 2048), count.by_op
