"""MeSH without its buffer (issue 25): the unrolled Eq. (7) form equals the buffer form of
Alg. 2 — states, logits, gradients and the router record — on every MeSH configuration,
and a training step costs few operators more than the base loop's."""

from __future__ import annotations

import copy

import pytest
import torch

from looplm import LoopLM, load_config
from looplm.accounting.dispatch import count_dispatch
from looplm.model_config import ModelConfig
from looplm.topology import MeshTopology
from looplm.topology.base import LoopState
from tests.conftest import random_ids, tiny_config
from tests.invariants import assert_decodes_like_full_forward, prefill_then_tokens


class BufferMesh(MeshTopology):
    """The buffer form this module replaced, kept as the reference: a [S, B, T, d] buffer
    written with Eq. (5) and read with Σ_b m_b ⊙ w_read,b after every write (Alg. 2)."""

    def _buffer_write_read(self, h, h_m, memory, index, record):
        w_write = torch.softmax(self.write[index](h), dim=-1)  # Eq. (3): [B, T, S]
        w_read = torch.softmax(self.read[index](h), dim=-1)
        record.setdefault("write", []).append(w_write.detach())
        record.setdefault("read", []).append(w_read.detach())
        memory = memory + w_write.permute(2, 0, 1).unsqueeze(-1) * h_m  # Eq. (5): [S, B, T, d]
        return torch.einsum("sbtd,bts->btd", memory, w_read), memory

    def start(self, h_emb, h_pre):
        memory = torch.zeros((self.slots, *h_emb.shape), dtype=h_emb.dtype, device=h_emb.device)
        memory[0] = h_emb  # Eq. (2)
        record: dict = {}
        h0, memory = self._buffer_write_read(h_pre, h_pre, memory, 0, record)
        return LoopState(h=h0, carrier={"h0": h0, "h_emb": h_emb, "memory": memory}, record=record)

    def step(self, state, update, t):
        h, memory = self._buffer_write_read(state.h, update, state.carrier["memory"], t + 1, state.record)
        return LoopState(h=h, carrier={**state.carrier, "memory": memory}, record=state.record)


def _buffer_twin(model: LoopLM) -> LoopLM:
    """The same model, weights and all, with the buffer-form MeSH."""
    twin = copy.deepcopy(model)
    twin.topology.__class__ = BufferMesh
    return twin


def _randomise_routers(topology: MeshTopology, seed: int) -> None:
    """Routers far from their zero-bias init, so that every slot carries weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in topology.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _run_topology(topo, emb, pre, core, K):
    state = topo.start(emb, pre)
    states = [state.h]
    for t in range(K):
        state = topo.step(state, core(state.h, t), t)
        states.append(state.h)
    return states, state.record


@pytest.mark.parametrize("slots,K", [(2, 1), (2, 3), (5, 2), (7, 4), (3, 6)])
def test_unrolled_read_equals_buffer_forward_and_backward(slots, K):
    """h^(t+1) = w_read,0·h_emb + Σ_t' ⟨w_read(t), w_write(t')⟩·h_m(t') (Eq. 7) against the
    buffer, with gradients to the inputs, the core and every router parameter."""
    torch.manual_seed(slots * 10 + K)
    B, T, D = 2, 5, 8
    topo = MeshTopology(D, K, slots)
    _randomise_routers(topo, seed=K)
    ref = copy.deepcopy(topo)
    ref.__class__ = BufferMesh
    core = torch.nn.Linear(D, D)
    emb, pre = torch.randn(B, T, D, requires_grad=True), torch.randn(B, T, D, requires_grad=True)

    def run(module):
        def f(h, t):  # a different core per iteration, as an unshared loop
            return torch.tanh(core(h) * (t + 1))

        states, record = _run_topology(module, emb, pre, f, K)
        loss = sum((s * torch.randn(s.shape, generator=torch.Generator().manual_seed(i))).sum()
                   for i, s in enumerate(states))
        params = [emb, pre, *core.parameters(), *module.parameters()]
        return states, record, torch.autograd.grad(loss, params)

    got, got_record, got_grads = run(topo)
    want, want_record, want_grads = run(ref)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for key in ("write", "read"):
        assert len(got_record[key]) == K + 1
        for a, b in zip(got_record[key], want_record[key]):
            assert not a.requires_grad and a.shape == (B, T, slots)
            # a later step's weights read states that already differ at float rounding between the
            # two orders of summation (how much depends on the CPU's kernels): the states' tolerance
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _shrunk(preset: str) -> ModelConfig:
    cfg = load_config(preset).model
    return ModelConfig.from_dict({**cfg.to_dict(), "vocab_size": 97, "d_model": 32, "n_heads": 4,
                                  "n_kv_heads": None if cfg.n_kv_heads is None else 2, "max_seq_len": 64})


def _slots(cfg: ModelConfig, slots: int) -> ModelConfig:
    return ModelConfig.from_dict({**cfg.to_dict(), "topology": {"kind": "mesh", "buffer_slots": slots}})


MESH_CONFIGS = {
    "tiny-mesh": lambda: load_config("tiny-mesh").model,
    "tiny-llama-mesh": lambda: load_config("tiny-llama-mesh").model,
    "spiralformer-b-tiny": lambda: load_config("spiralformer-b-tiny").model,
    "spiralformer-l-tiny": lambda: load_config("spiralformer-l-tiny").model,
    "pythia-160m-2+4R2+2-mesh": lambda: _shrunk("pythia-160m-2+4R2+2-mesh"),
    "pythia-410m-3+6R3+3-mesh": lambda: _shrunk("pythia-410m-3+6R3+3-mesh"),
    "mesh-unshared": lambda: tiny_config("mesh", share_core=False),
    "two-slots": lambda: _slots(tiny_config("mesh"), 2),
    "nine-slots-step-signal": lambda: _slots(tiny_config("mesh", layout="1+1R4+1", step_embeddings=True), 9),
    "loop-input-norm": lambda: tiny_config("mesh", loop_input_norm=True, norm="rmsnorm"),
}


@pytest.mark.parametrize("name", MESH_CONFIGS)
def test_model_logits_gradients_and_record_equal_the_buffer_form(name):
    torch.manual_seed(0)
    model = LoopLM(MESH_CONFIGS[name]())
    _randomise_routers(model.topology, seed=1)
    twin = _buffer_twin(model)
    ids = random_ids(2, 16, vocab=model.cfg.vocab_size)
    out, ref = model(ids, ids, output_states=True), twin(ids, ids, output_states=True)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(out.states, ref.states):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert out.record.keys() == ref.record.keys()
    for key in ref.record:
        for a, b in zip(out.record[key], ref.record[key], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", ["tiny-mesh", "spiralformer-b-tiny", "pythia-160m-2+4R2+2-mesh"])
def test_cache_decoding_equals_full_forward(name):
    torch.manual_seed(0)
    model = LoopLM(MESH_CONFIGS[name]()).eval()
    _randomise_routers(model.topology, seed=2)
    x = random_ids(2, 12, vocab=model.cfg.vocab_size)
    with torch.no_grad():
        assert_decodes_like_full_forward(model, x, [prefill_then_tokens(5, 12), [3, 7, 12]], atol=1e-5)
        torch.testing.assert_close(model(x).logits, _buffer_twin(model)(x).logits, rtol=1e-5, atol=1e-5)


def test_autocast_leaves_the_write_read_in_the_state_dtype():
    """The routers and the read run in fp32 under bf16 autocast (the buffer form cast the
    state to bf16 at every read): the states equal the fp32 run exactly."""
    torch.manual_seed(0)
    topo = MeshTopology(8, 2, 4)
    _randomise_routers(topo, seed=3)
    emb, pre = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    core = lambda h, t: torch.sin(h + t)  # noqa: E731
    want, _ = _run_topology(topo, emb, pre, core, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = _run_topology(topo, emb, pre, core, 2)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        assert torch.equal(a, b)


def test_state_dict_keeps_the_router_names_and_loads_old_checkpoints():
    model = LoopLM(tiny_config("mesh"))
    keys = [k for k in model.state_dict() if k.startswith("topology.")]
    iterations = model.cfg.iterations
    assert keys == [f"topology.{r}.{i}.{p}" for r in ("write", "read") for i in range(iterations + 1)
                    for p in ("weight", "bias")]
    twin = _buffer_twin(model)  # a buffer-form model's state dict loads strictly
    fresh = LoopLM(tiny_config("mesh"))
    fresh.load_state_dict(twin.state_dict(), strict=True)
    ids = random_ids(1, 6)
    torch.testing.assert_close(fresh(ids).logits, model(ids).logits)


def _step_counts(topology: dict, device: str = "cpu"):
    """Operators of one forward + backward through the public model at d = 64, layout 2+2R2+2
    (benchmarks/train_throughput.py's ``base`` and ``mesh`` variants)."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict({"vocab_size": 256, "d_model": 64, "n_heads": 4, "layout": "2+2R2+2",
                                 "max_seq_len": 64, "topology": topology})
    model = LoopLM(cfg).to(device)
    ids = random_ids(2, 32, vocab=256).to(device)
    counts, _ = count_dispatch(lambda: model(ids, ids).loss.backward())
    return counts


def test_training_step_costs_few_operators_more_than_the_base_loop():
    """The buffer form dispatched 598 operators against base's 522 (+76, 1.15×). Unrolled,
    three write-reads cost 54 more than base (1.10×): per write-read the fused router
    (addmm, softmax; softmax backward, input-, weight- and bias-gradient), the Eq. (7)
    coefficients and the read (two bmm forward, four backward), two appends, a stack of
    the router gradients, and the state's gradient summed over router and core. Asserted
    as operators over base, which other changes to the loop do not move."""
    base, mesh = _step_counts({"kind": "base"}), _step_counts({"kind": "mesh"})
    extra = mesh.by_op.copy()
    extra.subtract(base.by_op)
    detail = {k: v for k, v in extra.items() if v}
    assert mesh.syncs == 0, mesh.by_op
    assert mesh.ops - base.ops <= 54, f"mesh {mesh.ops} vs base {base.ops}: extra {detail}"


def test_write_reads_trace_as_one_graph():
    """Dynamo traces start and every step without a graph break (train.compile), and the
    compiled forward and backward equal eager."""
    torch.manual_seed(0)
    topo = MeshTopology(8, 2, 5)
    _randomise_routers(topo, seed=4)
    assert_compiles_like_eager(topo, torch.randn(2, 3, 8), torch.randn(2, 3, 8), 2)


def assert_compiles_like_eager(topo: MeshTopology, emb: torch.Tensor, pre: torch.Tensor, K: int) -> None:
    """K write-reads compiled whole (``fullgraph``, aot_eager) give eager's states and gradients."""
    emb, pre = emb.requires_grad_(), pre.requires_grad_()

    def loop(emb, pre):
        states, _ = _run_topology(topo, emb, pre, lambda h, t: torch.tanh(h * (t + 2)), K)
        return sum(s.square().sum() for s in states)

    compiled = torch.compile(loop, backend="aot_eager", fullgraph=True)
    want, got = loop(emb, pre), compiled(emb, pre)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, [emb, pre, *topo.parameters()]),
                    torch.autograd.grad(want, [emb, pre, *topo.parameters()])):
        torch.testing.assert_close(a, b)


def test_runs_on_the_meta_device():
    """Shapes without memory (a meta model, as looplm info builds one): the write-read's
    autocast guard must not need a device with autocast."""
    with torch.device("meta"):
        model = LoopLM(load_config("tiny-mesh").model)
        out = model(torch.zeros(2, 8, dtype=torch.long), output_states=True)
    assert out.logits.shape == (2, 8, 257) and out.logits.is_meta
    assert [r.shape for r in out.record["read"]] == [(2, 8, model.topology.slots)] * (model.cfg.iterations + 1)


def test_gradient_of_an_intermediate_state_alone():
    """A loss on h^(1) only (h^(3) detached): the write-read that makes h^(1) gets no
    gradient for the values it passes on, the later ones are out of the graph; the
    gradients are the buffer form's."""
    torch.manual_seed(0)
    topo = MeshTopology(8, 3, 4)
    _randomise_routers(topo, seed=5)
    ref = copy.deepcopy(topo)
    ref.__class__ = BufferMesh
    emb, pre = torch.randn(2, 3, 8, requires_grad=True), torch.randn(2, 3, 8, requires_grad=True)
    grads = []
    for module in (topo, ref):
        states, _ = _run_topology(module, emb, pre, lambda h, t: torch.tanh(2 * h), 3)
        grads.append(torch.autograd.grad(states[1].sum() + states[3].detach().sum(), [emb, pre, *module.parameters()],
                                         allow_unused=True))
    for a, b in zip(*grads):
        if b is None or not b.abs().sum():
            assert a is None or not a.abs().sum()
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
