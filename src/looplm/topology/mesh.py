"""MeSH: Memory-as-State-Highways (mesh.txt §3.2, Algorithm 2).

A buffer of B slots, each shaped like the hidden state, replaces the fixed supplement of
Eq. (1). Slot 0 starts as the embeddings, the others as zeros (Eq. 2). Per iteration
t = -1 .. K-1, write and read routers (Linear d -> B with bias, softmax over slots, Eq. 3)
are computed from the state h^(t) entering the core; the core output is written with
the write weights (Eq. 5) and the next state is read with the read weights (Eq. after 5).
t = -1 is the transitional write-read of the prelude output (Alg. 2 lines 8-13); the
state after the last read goes to the coda (line 25). Routers add
(K + 1) · 2 · (d · B + B) parameters (Appendix E.4, Table 6).
"""

from __future__ import annotations

import torch
from torch import nn

from looplm.topology.base import LoopState, Topology


class MeshTopology(Topology):
    def __init__(self, dim: int, iterations: int, slots: int):
        super().__init__()
        self.trained_iterations = iterations
        self.slots = slots
        # index i holds the routers of iteration t = i - 1 (i = 0 is the transitional t = -1)
        self.write = nn.ModuleList(nn.Linear(dim, slots) for _ in range(iterations + 1))
        self.read = nn.ModuleList(nn.Linear(dim, slots) for _ in range(iterations + 1))

    def extra_repr(self) -> str:
        return f"slots={self.slots}"

    def _write_read(self, state_h: torch.Tensor, h_m: torch.Tensor, memory: torch.Tensor, index: int, record: dict):
        w_write = torch.softmax(self.write[index](state_h), dim=-1)  # Eq. (3): [B, T, S]
        w_read = torch.softmax(self.read[index](state_h), dim=-1)
        record.setdefault("write", []).append(w_write.detach())
        record.setdefault("read", []).append(w_read.detach())
        memory = memory + w_write.permute(2, 0, 1).unsqueeze(-1) * h_m  # Eq. (5): [S, B, T, d]
        h = torch.einsum("sbtd,bts->btd", memory, w_read)  # read: h^(t+1) = Σ_b m_b ⊙ w_read,b
        return h, memory

    def start(self, h_emb: torch.Tensor, h_pre: torch.Tensor) -> LoopState:
        memory = torch.zeros((self.slots, *h_emb.shape), dtype=h_emb.dtype, device=h_emb.device)
        memory[0] = h_emb  # Eq. (2): m_0 = h_emb, m_{b>0} = 0
        record: dict[str, list[torch.Tensor]] = {}
        # Alg. 2 lines 8-13: routers of t = -1 read the prelude output h_m^(-1)
        h0, memory = self._write_read(h_pre, h_pre, memory, 0, record)
        return LoopState(h=h0, carrier={"h0": h0, "h_emb": h_emb, "memory": memory}, record=record)

    def step(self, state: LoopState, update: torch.Tensor, t: int) -> LoopState:
        # Alg. 2 lines 16-22: routers of iteration t read h^(t), the core's input
        h, memory = self._write_read(state.h, update, state.carrier["memory"], t + 1, state.record)
        return LoopState(h=h, carrier={**state.carrier, "memory": memory}, record=state.record)

    def reset_parameters(self, init_std: float) -> None:
        for layer in [*self.write, *self.read]:
            nn.init.normal_(layer.weight, std=init_std)
            nn.init.zeros_(layer.bias)
