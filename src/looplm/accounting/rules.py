"""FLOP rules for looplm's modules, registered by type (see :mod:`looplm.accounting.cost`).

A mixer's rule is its projections (the children, each applied once per position) plus its
core: the score/value products of softmax attention, or the linear mixers' state
recurrence. A new module type adds a rule here (or beside its module) with
:func:`register_flop_rule`; the counter is unchanged.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from looplm.accounting.cost import Call, Cost, causal_pairs, children_cost, module_cost, register_flop_rule
from looplm.accounting.plan import BlockCall, PositionCall, ResolutionCall
from looplm.halting import ACTHalting, ExitGateHalting, QHalting
from looplm.head_loop.block import BlockLoopBlock, HeadLoopBlock
from looplm.mixers.attention import SoftmaxAttention
from looplm.mixers.deltanet import DeltaRuleMixer
from looplm.mixers.dsa import DeepSeekSparseAttention
from looplm.mixers.hgrn2 import HGRN2Attention
from looplm.mixers.linear_attention import DecayMixer, HadamardFeatureMap
from looplm.mixers.mamba2 import Mamba2
from looplm.mixers.nsa import BlockCompressor, NativeSparseAttention
from looplm.modules.block import Block
from looplm.modules.norm import GatedRMSNorm, RMSNorm
from looplm.modules.step import StepEmbedding
from looplm.resolution.downscale import MeanPool, SelfAggregation
from looplm.resolution.upscale import AllocationRouter, UniformBroadcast
from looplm.streams import TwoStream
from looplm.topology.additive import AdditiveTopology
from looplm.topology.combination import DynamicCombinationTopology, StaticCombinationTopology
from looplm.topology.gated import GatedResidualTopology
from looplm.topology.mesh import MeshTopology


# ------------------------------------------------------------------ torch modules


@register_flop_rule(nn.Linear)
def _linear(m: nn.Linear, call: Call) -> Cost:
    return Cost(mac=call.rows * m.in_features * m.out_features, bias=call.rows * m.out_features if m.bias is not None else 0)


@register_flop_rule(nn.Embedding)
def _embedding(m: nn.Embedding, call: Call) -> Cost:
    return Cost(embed=call.rows * m.num_embeddings * m.embedding_dim)  # a lookup; as a one-hot matmul, V·d MACs


@register_flop_rule(nn.Dropout, nn.Identity)
def _free(m: nn.Module, call: Call) -> Cost:
    return Cost()  # nothing


@register_flop_rule(nn.LayerNorm)
def _layernorm(m: nn.LayerNorm, call: Call) -> Cost:
    return Cost(norm=call.rows * m.normalized_shape[-1] * (5 if m.weight is not None else 4))  # fvcore's rule


@register_flop_rule(nn.Conv1d)
def _conv1d(m: nn.Conv1d, call: Call) -> Cost:
    """A causal (depthwise) convolution over the sequence: K·C_in/groups MACs per output."""
    per = m.kernel_size[0] * m.in_channels // m.groups
    return Cost(mac=call.rows * m.out_channels * per, bias=call.rows * m.out_channels if m.bias is not None else 0)


# ------------------------------------------------------------------ norms, block


@register_flop_rule(RMSNorm)
def _rmsnorm(m: RMSNorm, call: Call) -> Cost:
    return Cost(norm=call.rows * m.weight.shape[0] * 4)  # square, mean, scale, weight


@register_flop_rule(GatedRMSNorm)
def _gated_rmsnorm(m: GatedRMSNorm, call: Call) -> Cost:
    return Cost(norm=call.rows * m.weight.shape[0] * 5)  # RMSNorm + gate multiply


@register_flop_rule(BlockCall)
def _block_call(m: BlockCall, call: Call) -> Cost:
    """The block's rule (by its type: plain or grown) at the iteration it runs."""
    return module_cost(m.block, dataclasses.replace(call, iteration=m.iteration))


def _sublayers(block: Block, call: Call) -> tuple[Cost, Cost]:
    """norm -> mixer (this iteration's view) -> output norm -> residual, and norm -> FFN ->
    output norm -> residual (the output norms cost nothing under ``norm_placement: pre``)."""
    d = block.attn_norm.weight.shape[0]
    mixer = block.mixer_at(max(call.iteration, 0))
    attention = (module_cost(block.attn_norm, call) + module_cost(mixer, call) + module_cost(block.attn_out_norm, call)
                 + Cost(residual=call.rows * d))
    ffn = (module_cost(block.ffn_norm, call) + module_cost(block.ffn, call) + module_cost(block.ffn_out_norm, call)
           + Cost(residual=call.rows * d))
    return attention, ffn


@register_flop_rule(Block)
def _block(m: Block, call: Call) -> Cost:
    attention, ffn = _sublayers(m, call)
    return attention + ffn


@register_flop_rule(BlockLoopBlock)
def _block_loop(m: BlockLoopBlock, call: Call) -> Cost:
    """Block Loop: 1 + K_l applications of the whole block (K_l from ``m.head_loop``)."""
    attention, ffn = _sublayers(m, call)
    return (attention + ffn).scale(1 + m.extra_passes(max(call.iteration, 0)))


@register_flop_rule(HeadLoopBlock)
def _head_loop(m: HeadLoopBlock, call: Call) -> Cost:
    """The block plus K_l passes of norm -> S's slice of the attention -> residual (Eq. 6)
    before the FFN (K_l and the heads S with w_i > 0 from ``m.head_loop``)."""
    attention, ffn = _sublayers(m, call)
    iteration = max(call.iteration, 0)
    depth = m.extra_passes(iteration)
    if depth == 0:  # not grown, or this iteration's mixer does not loop
        return attention + ffn
    d = m.attn_norm.weight.shape[0]
    head_pass = head_pass_cost(m.mixer_at(iteration), call, len(m.head_loop.heads))
    passes = module_cost(m.attn_norm, call) + head_pass + Cost(residual=call.rows * d)
    return attention + passes.scale(depth) + ffn


def head_pass_cost(m: SoftmaxAttention, call: Call, heads: int) -> Cost:
    """One SGT head pass over ``heads`` = |S| query heads (``head_subset_attention``, Eq. 6): the
    rows of ``qkv`` for S and the kv heads S reads (all |S| of them under MHA; with GQA at
    most min(|S|, H_kv), counted as that bound), the gate's rows, the score/value products
    of |S| heads and S's columns of ``o_proj`` (no output bias)."""
    d, D = m.o_proj.out_features, m.head_dim
    kv = min(heads, m.n_kv_heads)
    rows = (heads + 2 * kv) * D + (heads * D if m.gate is not None else 0)
    cost = Cost(mac=call.rows * d * rows + call.rows * heads * D * d,
                bias=call.rows * rows if m.qkv.bias is not None else 0)
    per_pair = heads * 2 * D
    full = call.batch * call.tokens * call.keys
    causal = call.batch * causal_pairs(call.tokens, call.keys, m.window)
    return cost + Cost(attn_full=full * per_pair, attn_causal=causal * per_pair)


# ------------------------------------------------------------------ multi-resolution (SpiralFormer)


@register_flop_rule(ResolutionCall)
def _resolution_call(m: ResolutionCall, call: Call) -> Cost:
    """S↓ of iteration t on the tokens of its complete chunks; S↑ on the chunk latents (the
    causal shift, Eq. 22, is a pad: no arithmetic)."""
    key = str(m.iteration)
    if call.phase == "down":
        return module_cost(m.resolution.down_ops[key], call)
    return module_cost(m.resolution.up_ops[key], call)


@register_flop_rule(MeanPool)
def _mean_pool(m: MeanPool, call: Call) -> Cost:
    return Cost(state=call.rows * call.width)  # Eq. (16): one add (and the 1/g scale) per token and channel


@register_flop_rule(SelfAggregation)
def _self_aggregation(m: SelfAggregation, call: Call) -> Cost:
    """Eq. (17-18): the scorer A^(t) (d -> 1) on every token, softmax over the chunk (left
    out like activations), then Σ_i α_i h_i: d MACs per token."""
    return module_cost(m.scorer, call) + Cost(mac=call.rows * call.width)


@register_flop_rule(UniformBroadcast)
def _uniform(m: UniformBroadcast, call: Call) -> Cost:
    """Eq. (20): (λ/g) ẑ once per chunk latent (none at g = 1), then broadcast to its g slots."""
    return Cost(state=call.rows * call.width if m.chunk > 1 else 0)


@register_flop_rule(AllocationRouter)
def _router(m: AllocationRouter, call: Call) -> Cost:
    """Eq. (21): the router B^(t) (d -> g) once per chunk latent (``call.rows`` of them), then
    λ·β (g per chunk) and β_ρ·ẑ for every slot (g·d per chunk), Eq. (19)."""
    return module_cost(m.router, call) + Cost(state=call.rows * m.chunk * (1 + call.width))


# ------------------------------------------------------------------ softmax attention


@register_flop_rule(SoftmaxAttention)
def _softmax_attention(m: SoftmaxAttention, call: Call) -> Cost:
    """Projections (and the output gate's multiply) plus q·kᵀ and p·v over the pairs."""
    cost = children_cost(m, call)
    per_pair = m.n_heads * 2 * m.head_dim  # scores and values, every query head
    full = call.batch * call.tokens * call.keys
    causal = call.batch * causal_pairs(call.tokens, call.keys, m.window)
    cost = cost + Cost(attn_full=full * per_pair, attn_causal=causal * per_pair)
    return cost  # the output gate's sigmoid and multiply are elementwise, left out like activations


# ------------------------------------------------------------------ linear mixers


def _recurrence(call: Call, heads: int, dk: int, dv: int, chunk: int, delta: bool) -> Cost:
    """Core of a linear mixer, per head and position.

    Recurrence: S_t = α_t S_{t-1} + k_t v_tᵀ (dk·dv MACs) and o_t = S_tᵀ q_t (dk·dv); the
    delta rule adds the prediction S_{t-1}ᵀ k_t (dk·dv).
    Chunkwise (what trains, chunk C): intra-chunk q kᵀ (C·dk) and scores·v (C·dv) over
    the full C × C block, the inter-chunk read q S (dk·dv) and the state update kᵀ v
    (dk·dv); the delta rule (WY form) adds k kᵀ (C·dk), applying the C × C transform
    to k and v (C·(dk + dv)) and w S (dk·dv)."""
    C = min(chunk, call.tokens)
    n = call.rows * heads
    if delta:
        recurrent = 3 * dk * dv
        chunked = C * dk + C * (dk + dv) + C * (dk + dv) + 3 * dk * dv
    else:
        recurrent = 2 * dk * dv
        chunked = C * (dk + dv) + 2 * dk * dv
    return Cost(mixer_chunk=n * chunked, mixer_recurrent=n * recurrent)


@register_flop_rule(HadamardFeatureMap)
def _hadamard_map(m: HadamardFeatureMap, call: Call) -> Cost:
    raise AssertionError("counted by the LinearAttention rule (applied per head)")


def _mixer_children(m: nn.Module, call: Call, heads: int, head_width: int) -> Cost:
    """Children once per position, except what runs per head: feature maps and output
    norms whose width is one head's (``head_width``)."""
    cost = Cost()
    per_head = Call(call.batch, call.tokens * heads, call.keys * heads, width=call.width)
    for child in m.children():
        if isinstance(child, HadamardFeatureMap):
            cost = cost + children_cost(child, per_head)
        elif isinstance(child, (RMSNorm, GatedRMSNorm)) and child.weight.shape[0] == head_width and heads > 1:
            cost = cost + module_cost(child, per_head)
        else:
            cost = cost + module_cost(child, call)
    return cost


@register_flop_rule(DecayMixer)
def _decay_mixer(m: DecayMixer, call: Call) -> Cost:
    cost = _mixer_children(m, call, m.num_heads, m.head_v_dim)
    return cost + _recurrence(call, m.num_heads, m.head_k_dim, m.head_v_dim, m.chunk_size, delta=False)


@register_flop_rule(HGRN2Attention)
def _hgrn2(m: HGRN2Attention, call: Call) -> Cost:
    return _mixer_children(m, call, m.num_heads, m.head_i_dim) + _recurrence(call, m.num_heads, m.head_f_dim, m.head_i_dim, m.chunk_size, False)


@register_flop_rule(Mamba2)
def _mamba2(m: Mamba2, call: Call) -> Cost:
    return children_cost(m, call) + _recurrence(call, m.num_heads, m.ssm_state_size, m.head_dim, m.chunk_size, False)


@register_flop_rule(DeltaRuleMixer)
def _delta_mixer(m: DeltaRuleMixer, call: Call) -> Cost:
    return _mixer_children(m, call, m.num_heads, m.head_v_dim) + _recurrence(call, m.num_heads, m.head_k_dim, m.head_v_dim, m.chunk_size, True)


# ------------------------------------------------------------------ sparse attention


@register_flop_rule(BlockCompressor)
def _compressor(m: BlockCompressor, call: Call) -> Cost:
    raise AssertionError("counted by the NativeSparseAttention rule (applied per block)")


@register_flop_rule(NativeSparseAttention)
def _nsa(m: NativeSparseAttention, call: Call) -> Cost:
    """Projections; φ on each compressed block of keys and values; the three branches'
    score/value products over the keys each query sees (the sparse kernel's count):
    compressed blocks, ``select_blocks`` blocks of ``select_block_size``, the window."""
    cost = Cost()
    for name, child in m.named_children():
        if not isinstance(child, BlockCompressor):
            cost = cost + module_cost(child, call)
    l, d = m.block_size, m.block_stride
    blocks = max(0, (call.keys - l) // d + 1)
    if m.k_compress is not None:
        per_block = children_cost(m.k_compress.mlp, Call(call.batch * m.n_kv_heads, blocks, blocks))
        cost = cost + per_block.scale(2)  # keys and values
    compressed = sum(max(0, (i + 1 - l) // d + 1) for i in range(call.keys - call.tokens, call.keys))
    selected = sum(min(i + 1, m.select_blocks * m.select_block_size) for i in range(call.keys - call.tokens, call.keys))
    window = causal_pairs(call.tokens, call.keys, m.window) if m.window else 0
    per_pair = m.n_heads * 2 * m.head_dim
    pairs = call.batch * (compressed + selected + window)
    return cost + Cost(attn_full=pairs * per_pair, attn_causal=pairs * per_pair)


@register_flop_rule(DeepSeekSparseAttention)
def _dsa(m: DeepSeekSparseAttention, call: Call) -> Cost:
    """Projections and the indexer's projections; the indexer's scores over every causal
    key (H^I·d^I MACs per pair, plus the head weights); attention over the top-k keys."""
    cost = children_cost(m, call)
    idx = m.indexer
    causal = call.batch * causal_pairs(call.tokens, call.keys)
    full = call.batch * call.tokens * call.keys
    index_per_pair = idx.heads * (idx.head_dim + 1)
    cost = cost + Cost(attn_full=full * index_per_pair, attn_causal=causal * index_per_pair)
    kept = call.batch * sum(min(i + 1, m.top_k) for i in range(call.keys - call.tokens, call.keys))
    per_pair = m.n_heads * 2 * m.head_dim
    return cost + Cost(attn_full=kept * per_pair, attn_causal=kept * per_pair)


# ------------------------------------------------------------------ topologies


@register_flop_rule(AdditiveTopology)
def _additive(m: AdditiveTopology, call: Call) -> Cost:
    if call.phase == "start":
        return Cost()
    return Cost(state=len(m.supplements) * call.rows * call.width)  # one addition per supplement


@register_flop_rule(GatedResidualTopology)
def _gated(m: GatedResidualTopology, call: Call) -> Cost:
    if call.phase == "start":
        return Cost()
    return Cost(state=2 * call.rows * m.rho.shape[1])  # ρ ⊙ h, + f(h)


@register_flop_rule(StaticCombinationTopology)
def _static(m: StaticCombinationTopology, call: Call) -> Cost:
    if call.phase == "start":
        return Cost()
    return Cost(state=7 * call.rows * call.width)  # four scalings, three additions


@register_flop_rule(DynamicCombinationTopology)
def _dynamic(m: DynamicCombinationTopology, call: Call) -> Cost:
    if call.phase == "start":
        return Cost()
    d = m.coefficients[0].in_features
    return module_cost(m.coefficients[0], call) + Cost(state=7 * call.rows * d)


@register_flop_rule(MeshTopology)
def _mesh(m: MeshTopology, call: Call) -> Cost:
    """One write-read per call (t = -1 at the start, then each iteration; MeSH Alg. 2):
    write and read routers (Linear d -> B each), the write m_b += w_b ⊙ h (a multiply and
    an add per slot and channel) and the read Σ_b w_b ⊙ m_b (a contraction over slots).
    MeSH Eq. (8) totals 6·d·B per position at one FLOP per operation."""
    d, B = m.write[0].in_features, m.slots
    routers = module_cost(m.write[0], call) + module_cost(m.read[0], call)
    return routers + Cost(state=2 * call.rows * d * B, read_mac=call.rows * d * B)



# ------------------------------------------------------------------ positions, step signal, streams, halting
#
# A learned vector added to every position (a position row, the step embedding e_t) is a
# bias addition by construction: counted as ``bias``, where a convention counts biases.
# The streams' combination and ACT's readout accumulation combine loop states, as a
# topology does: counted as ``state``. Sigmoids, comparisons, ``torch.where`` (freezing
# halted positions) and the per-position scalar bookkeeping of halting (O(T) per step)
# are left out like activations.


@register_flop_rule(PositionCall)
def _position(m: PositionCall, call: Call) -> Cost:
    """The table's lookup (as the token embedding's: a one-hot matmul where the convention
    counts one) plus its addition to the token embeddings."""
    return module_cost(m.table, call) + Cost(bias=call.rows * m.table.embedding_dim)


@register_flop_rule(StepEmbedding)
def _step_embedding(m: StepEmbedding, call: Call) -> Cost:
    return Cost(bias=call.rows * m.weight.shape[1])  # x + e_t on one core pass's input


@register_flop_rule(TwoStream)
def _two_stream(m: TwoStream, call: Call) -> Cost:
    """One pass's input: X + Y + Z (two adds per element) for a reasoning pass
    (``phase="reason"``), Y + Z (one) for the solution pass (``phase="solve"``)."""
    adds = 2 if call.phase == "reason" else 1
    return Cost(state=adds * call.rows * m.y_init.shape[0])


@register_flop_rule(ACTHalting)
def _act(m: ACTHalting, call: Call) -> Cost:
    """One macro step: the halting unit d -> 1 (with its bias) on every position, and the
    readout accumulation readout + w·h (a multiply and an add per element)."""
    return module_cost(m.unit, call) + Cost(state=2 * call.rows * m.unit.in_features)


@register_flop_rule(QHalting)
def _qhalt(m: QHalting, call: Call) -> Cost:
    """One macro step: the q head d -> 1 (with its bias) on every position. Its training
    target (final norm + LM head on the solution) is a separate, targets-only plan step."""
    return module_cost(m.head, call)


@register_flop_rule(ExitGateHalting)
def _exit_gate(m: ExitGateHalting, call: Call) -> Cost:
    """One macro step: the gate d -> 1 (with its bias) on every position and the readout's
    selection of the exiting positions' states (one element each). The final norm it reads
    is a separate plan step."""
    return module_cost(m.gate, call) + Cost(state=call.rows * m.gate.in_features)
