"""MeSH: Memory-as-State-Highways (mesh.txt §3.2, Algorithm 2), computed without its buffer.

A buffer of B slots, each shaped like the hidden state, replaces the fixed supplement of
Eq. (1). Slot 0 starts as the embeddings, the others as zeros (Eq. 2). Per iteration
t = -1 .. K-1, write and read routers (Linear d -> B with bias, softmax over slots, Eq. 3)
are computed from the state h^(t) entering the core; the core output is written with
the write weights (Eq. 5) and the next state is read with the read weights (Eq. after 5).
t = -1 is the transitional write-read of the prelude output (Alg. 2 lines 8-13); the
state after the last read goes to the coda (line 25). Routers add
(K + 1) · 2 · (d · B + B) parameters (Appendix E.4, Table 6).

The buffer is linear in what was written, so it never needs to exist: after the writes of
iterations -1 .. t slot b holds m_b = [b = 0]·h_emb + Σ_{t' <= t} w_write(t')_b · h_m(t'),
and the read is the unrolled recurrence of Eq. (7),

    h^(t+1) = Σ_b w_read(t)_b m_b = w_read(t)_0 · h_emb + Σ_{t'} ⟨w_read(t), w_write(t')⟩ · h_m(t').

The carrier keeps the written values V = [h_emb, h_m(-1), .., h_m(t)] [B, T, t+3, d] and
their write weights A = [e_0, w_write(-1), .., w_write(t)] [B, T, t+3, S] (S slots, the
paper's B; e_0 the one-hot of slot 0, h_emb's "write"); a write-read appends to both and
reads h = (A·w_read)ᵀ V: two batched matmuls over t + 3 rows instead of a [S, B, T, d]
buffer rebuilt, multiplied and contracted each time. One :class:`torch.autograd.Function`
runs a write-read with one fused router matmul (d -> 2S: write and read logits together)
and a hand-written backward, so a training step launches a fixed handful of kernels per
iteration (DESIGN.md invariant 6); on CUDA (``model.topology.kernel``) the whole write-read
is one Triton kernel forward and one backward (:mod:`looplm.ops.write_read_triton`). Saved
for the backward: each write-read's t + 3 values, Σ_t (t + 3)·d per position over the loop
(the buffer form saved S·d per write-read).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from looplm.accounting.cost import Call, Cost, module_cost
from looplm.ops.autocast import no_autocast
from looplm.ops.backend import use_triton
from looplm.topology.base import LoopState, Topology


class _WriteRead(torch.autograd.Function):
    """One MeSH write-read (Alg. 2 lines 9-13 / 17-22) on the unrolled form of Eq. (7).

    state [B, T, d]: h^(t), what the routers read. update [B, T, d]: h_m^(t), the value
    written; None writes the state itself (t = -1 writes the prelude output its routers
    read). values [B, T, J, d] / weights [B, T, J, S]: the values written so far and
    their write weights (row 0: h_emb and e_0). Router parameters: Linear_write^(t) and
    Linear_read^(t) (weight [S, d], bias [S]), used as one d -> 2S matmul.
    Returns h^(t+1) [B, T, d], the values and weights with this write appended
    ([B, T, J+1, ·]) and the router probabilities [B, T, 2, S] (write, read; no gradient:
    they are the record). Autocast is off inside: the router and the read run in the
    state's dtype (fp32 under mixed precision), one cast of the weights at most.
    ``fused``: run as one Triton kernel forward and one backward
    (:mod:`looplm.ops.write_read_triton`) instead of the PyTorch operators below.
    """

    @staticmethod
    def forward(ctx, state, update, values, weights, write_weight, write_bias, read_weight, read_bias, fused):
        ctx.writes_state, ctx.fused = update is None, fused
        if fused:  # one Triton kernel (looplm.ops.write_read_triton)
            from looplm.ops.write_read_triton import write_read

            h, values, weights, probs, coef = write_read(state, update, values, weights, write_weight, write_bias,
                                                         read_weight, read_bias)
            ctx.update_dtype = state.dtype if update is None else update.dtype
            ctx.save_for_backward(state, write_weight, read_weight, probs, weights, values, coef)
        else:
            h, values, weights, probs, saved = _reference_forward(state, update, values, weights, write_weight,
                                                                  write_bias, read_weight, read_bias)
            ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(probs)
        ctx.set_materialize_grads(False)
        return h, values, weights, probs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h, grad_values, grad_weights, _grad_probs):
        if ctx.fused:
            state, write_weight, read_weight, probs, weights, values, coef = ctx.saved_tensors
            g_state, g_update, g_values, g_weights, g_logits = torch.ops.looplm.mesh_write_read_backward(
                grad_h, grad_values, grad_weights, state, write_weight, read_weight, probs, weights, values, coef,
                ctx.update_dtype, ctx.writes_state)
            with no_autocast(state.device):
                g_router_weight = torch.mm(g_logits.t(), state.reshape(-1, state.shape[-1]))  # [2S, d]
                g_router_bias = g_logits.sum(dim=0)
            g_update = None if ctx.writes_state else g_update
        else:
            g_state, g_update, g_values, g_weights, g_router_weight, g_router_bias = _reference_backward(
                ctx, grad_h, grad_values, grad_weights)
        S = g_router_bias.shape[0] // 2
        return (g_state, g_update, g_values, g_weights if ctx.needs_input_grad[3] else None,
                g_router_weight[:S], g_router_bias[:S], g_router_weight[S:], g_router_bias[S:], None)


def _reference_forward(state, update, values, weights, write_weight, write_bias, read_weight, read_bias):
    """:class:`_WriteRead`'s forward in PyTorch operators: (h, values, weights, probs, what
    the backward reads)."""
    B, T, d = state.shape
    N, J, S = B * T, values.shape[-2], write_weight.shape[0]
    with no_autocast(state.device):
        router_weight = torch.cat([write_weight, read_weight]).to(state.dtype)  # [2S, d]
        router_bias = torch.cat([write_bias, read_bias]).to(state.dtype)
        s = state.reshape(N, d)
        logits = torch.addmm(router_bias, s, router_weight.t())  # Eq. (3), both routers: [N, 2S]
        probs = torch.softmax(logits.view(B, T, 2, S), dim=-1)
        write, read = probs.unbind(dim=-2)  # [B, T, S] each
        weights = torch.cat([weights.to(probs.dtype), write.unsqueeze(-2)], dim=-2)  # [B, T, J+1, S]
        update = state if update is None else update
        values = torch.cat([values, update.unsqueeze(-2).to(values.dtype)], dim=-2)  # [B, T, J+1, d]
        coef = torch.bmm(weights.view(N, J + 1, S), read.reshape(N, S, 1))  # Eq. (7) α: [N, J+1, 1]
        h = torch.bmm(coef.transpose(1, 2).to(values.dtype), values.view(N, J + 1, d))  # [N, 1, d]
    return h.view(B, T, d), values, weights, probs, (s, router_weight, probs, weights, values, coef)


def _reference_backward(ctx, grad_h, grad_values, grad_weights):
    """:class:`_WriteRead`'s backward in PyTorch operators: the gradients of the state, the
    update (None when the state was written), the earlier values and weights, and the fused
    router's weight [2S, d] and bias [2S]."""
    s, router_weight, probs, weights, values, coef = ctx.saved_tensors
    B, T, J1, d = values.shape
    N, S = B * T, probs.shape[-1]
    with no_autocast(s.device):
        g_h = (torch.zeros_like(s) if grad_h is None else grad_h).reshape(N, 1, d)  # None: h unused
        g_coef = torch.bmm(values.view(N, J1, d), g_h.transpose(1, 2)).to(coef.dtype)  # [N, J+1, 1]
        g_values = _outer(grad_values, coef.to(values.dtype), g_h, (N, J1, d))  # [N, J+1, d]
        read = probs.view(N, 2, S)[:, 1:]  # [N, 1, S]
        g_read = torch.bmm(weights.view(N, J1, S).transpose(1, 2), g_coef)  # [N, S, 1]
        g_weights = _outer(grad_weights, g_coef, read, (N, J1, S))  # [N, J+1, S]
        g_probs = torch.stack([g_weights[:, -1], g_read.view(N, S)], dim=1)  # [N, 2, S]
        g_logits = torch._softmax_backward_data(g_probs, probs.view(N, 2, S), -1, probs.dtype).view(N, 2 * S)
        g_update = g_values[:, -1]
        if ctx.writes_state:  # the state was also the update: one gradient for both
            g_state = torch.addmm(g_update.to(g_logits.dtype), g_logits, router_weight).view(B, T, d)
            g_update = None
        else:
            g_state = torch.mm(g_logits, router_weight).view(B, T, d)
        g_router_weight = torch.mm(g_logits.t(), s)  # [2S, d]
        g_router_bias = g_logits.sum(dim=0)
    g_update = None if g_update is None else g_update.view(B, T, d)
    return (g_state, g_update, g_values[:, :-1].view(B, T, J1 - 1, d), g_weights[:, :-1].view(B, T, J1 - 1, S),
            g_router_weight, g_router_bias)


def _outer(incoming: Optional[torch.Tensor], column: torch.Tensor, row: torch.Tensor, shape) -> torch.Tensor:
    """column ⊗ row, [N, J, 1] x [N, 1, K] -> [N, J, K], plus ``incoming`` (the gradient from
    later write-reads, None after the last) in the same elementwise kernel."""
    if incoming is None:
        return column * row
    return torch.addcmul(incoming.reshape(shape), column, row)


class MeshTopology(Topology):
    def __init__(self, dim: int, iterations: int, slots: int, kernel: str = "auto"):
        super().__init__()
        self.trained_iterations = iterations
        self.slots = slots
        self.kernel = kernel  # where the write-read runs (looplm.ops.backend.KERNELS)
        # index i holds the routers of iteration t = i - 1 (i = 0 is the transitional t = -1)
        self.write = nn.ModuleList(nn.Linear(dim, slots) for _ in range(iterations + 1))
        self.read = nn.ModuleList(nn.Linear(dim, slots) for _ in range(iterations + 1))
        # e_0: slot 0's "write weight" of h_emb (Eq. 2), the first row of the carrier's weights
        slot0 = torch.zeros(slots)
        slot0[0] = 1.0
        self.register_buffer("slot0", slot0, persistent=False)

    def extra_repr(self) -> str:
        return f"slots={self.slots}, kernel={self.kernel}"

    def _write_read(self, state: LoopState, update: Optional[torch.Tensor], index: int) -> LoopState:
        carrier = state.carrier
        h, values, weights, probs = _WriteRead.apply(
            state.h, update, carrier["values"], carrier["weights"],
            self.write[index].weight, self.write[index].bias, self.read[index].weight, self.read[index].bias,
            use_triton(state.h, self.kernel),
        )
        write, read = probs.unbind(dim=-2)
        state.record.setdefault("write", []).append(write)
        state.record.setdefault("read", []).append(read)
        return LoopState(h=h, carrier={**carrier, "values": values, "weights": weights}, record=state.record)

    def start(self, h_emb: torch.Tensor, h_pre: torch.Tensor) -> LoopState:
        B, T, _ = h_emb.shape
        # Eq. (2): m_0 = h_emb, m_{b>0} = 0, held as the written value h_emb with weight e_0
        empty = LoopState(h=h_pre, carrier={"values": h_emb.unsqueeze(-2),
                                            "weights": self.slot0.expand(B, T, 1, self.slots)})
        # Alg. 2 lines 8-13: routers of t = -1 read the prelude output h_m^(-1) and write it
        state = self._write_read(empty, None, 0)
        return LoopState(h=state.h, carrier={"h0": state.h, "h_emb": h_emb, **state.carrier}, record=state.record)

    def step(self, state: LoopState, update: torch.Tensor, t: int) -> LoopState:
        # Alg. 2 lines 16-22: routers of iteration t read h^(t), the core's input
        return self._write_read(state, update, t + 1)

    def reset_parameters(self, init_std: float) -> None:
        for layer in [*self.write, *self.read]:
            nn.init.normal_(layer.weight, std=init_std)
            nn.init.zeros_(layer.bias)

    def flop_cost(self, call: Call) -> Cost:
        """One write-read per call (t = -1 at the start, then each iteration; MeSH Alg. 2):
        write and read routers (Linear d -> B each), the write m_b += w_b ⊙ h (a multiply and
        an add per slot and channel) and the read Σ_b w_b ⊙ m_b (a contraction over slots).
        MeSH Eq. (8) totals 6·d·B per position at one FLOP per operation. Run unrolled (Eq. 7),
        the read after the write of iteration t contracts the t + 3 values written so far
        (h_emb included) with coefficients from t + 3 write weights of B slots."""
        d, B = self.write[0].in_features, self.slots
        written = call.iteration + 3  # h_emb, h_m^(-1), .., h_m^(t); the start is t = -1
        routers = module_cost(self.write[0], call) + module_cost(self.read[0], call)
        return routers + Cost(state=2 * call.rows * d * B, read_mac=call.rows * d * B,
                              read_unrolled_mac=call.rows * written * (d + B))
