"""MeSH's write-read as one Triton kernel forward and one backward
(:mod:`looplm.ops.write_read_triton`, issue 25) equals the PyTorch operators: states,
record and every gradient, alone and in every MeSH model of tests/topology/test_mesh.py;
decoding through it equals the full forward; it traces whole; and a training step with it
launches at most 5 % more operators than the base loop. Runs on CUDA when there is one,
else on CPU under ``TRITON_INTERPRET=1`` in a child process (the interpreter must be chosen
before triton compiles anything)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from looplm import LoopLM  # noqa: E402
from looplm.config_base import ConfigError  # noqa: E402
from looplm.model_config import ModelConfig  # noqa: E402
from looplm.topology import MeshTopology  # noqa: E402
from tests.conftest import random_ids, tiny_config  # noqa: E402
from tests.invariants import assert_decodes_like_full_forward, prefill_then_tokens  # noqa: E402
from tests.topology.test_mesh import (  # noqa: E402
    MESH_CONFIGS, _randomise_routers, _run_topology, _step_counts, assert_compiles_like_eager,
)
from tests.triton_kernels import DEVICE, reruns_interpreted, run_interpreted, runs_kernels  # noqa: E402



@reruns_interpreted
def test_kernels_equal_the_reference_under_the_triton_interpreter():
    run_interpreted(__file__, skipped=2)  # this test and the bfloat16 one


def _twins(d: int, K: int, slots: int, seed: int) -> tuple[MeshTopology, MeshTopology]:
    reference = MeshTopology(d, K, slots, kernel="torch")
    _randomise_routers(reference, seed=seed)
    fused = copy.deepcopy(reference)
    fused.kernel = "triton"
    return reference.to(DEVICE), fused.to(DEVICE)


def _loop(topo, emb, pre, K, params, only=None):
    """States, record and the gradients of a weighted sum of the states (only state ``only``
    when given, the later ones detached)."""
    core = lambda h, t: torch.tanh(h * (t + 2))  # noqa: E731
    states, record = _run_topology(topo, emb, pre, core, K)
    weights = [torch.randn(s.shape, generator=torch.Generator().manual_seed(i)).to(s) for i, s in enumerate(states)]
    picked = range(len(states)) if only is None else [only]
    loss = sum((states[i] * weights[i]).sum() for i in picked)
    return states, record, torch.autograd.grad(loss, [emb, pre, *params], allow_unused=True)


@runs_kernels
@pytest.mark.parametrize("B,T,d,K,slots", [(2, 5, 8, 2, 5), (1, 7, 20, 4, 3), (3, 3, 64, 1, 7), (2, 33, 48, 3, 2),
                                           (1, 2, 130, 2, 6), (1, 1, 16, 2, 4), (2, 3, 8, 6, 9)])
def test_write_reads_equal_the_reference_against_float64(B, T, d, K, slots):
    """Every state, router weight and gradient (inputs and all router parameters) within
    float32 rounding of a float64 run: within 4 × the PyTorch operators' own error or 1e-5
    of the tensor's largest value (their errors, sums over positions in another order, are
    ~1e-6 of it either way), with block sizes that do not divide the positions and d and S
    not powers of two."""
    reference, fused = _twins(d, K, slots, seed=K)
    exact = copy.deepcopy(reference).double()
    g = torch.Generator().manual_seed(d)
    emb, pre = torch.randn(B, T, d, generator=g).to(DEVICE), torch.randn(B, T, d, generator=g).to(DEVICE)
    runs = []
    for topo, dtype in ((reference, torch.float32), (fused, torch.float32), (exact, torch.float64)):
        e, p = emb.to(dtype).requires_grad_(), pre.to(dtype).requires_grad_()
        states, record, grads = _loop(topo, e, p, K, list(topo.parameters()))
        runs.append([x.double() for x in (*states, *record["write"], *record["read"], *grads)])
    for theirs, ours, truth in zip(*runs, strict=True):
        scale = truth.abs().max().item()
        err_ref, err = (theirs - truth).abs().max().item(), (ours - truth).abs().max().item()
        assert err <= max(4 * err_ref, 1e-5 * max(scale, 1.0)), (err, err_ref, scale)


@runs_kernels
@settings(max_examples=8, deadline=None, derandomize=True)
@given(B=st.integers(1, 3), T=st.integers(1, 9), d=st.integers(2, 70), K=st.integers(1, 5), slots=st.integers(2, 9),
       seed=st.integers(0, 2**16))
def test_any_shape_equals_the_reference_forward_and_backward(B, T, d, K, slots, seed):
    """Any batch, length, width, loop count and slot count (block sizes dividing nothing):
    states, router weights and every gradient within float32 rounding of the PyTorch operators."""
    reference, fused = _twins(d, K, slots, seed=seed)
    g = torch.Generator().manual_seed(seed)
    emb, pre = torch.randn(B, T, d, generator=g).to(DEVICE), torch.randn(B, T, d, generator=g).to(DEVICE)
    runs = []
    for topo in (reference, fused):
        e, p = emb.clone().requires_grad_(), pre.clone().requires_grad_()
        states, record, grads = _loop(topo, e, p, K, list(topo.parameters()))
        runs.append([*states, *record["write"], *record["read"], *grads])
    for want, got in zip(*runs, strict=True):
        scale = max(want.abs().max().item(), 1.0)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)


@runs_kernels
@pytest.mark.parametrize("only", [0, 1, 2])
def test_gradient_of_an_intermediate_state_alone(only):
    """A loss on one state only, the later ones detached: write-reads whose output nothing
    reads get no gradient of h (the kernel's missing-gradient branches)."""
    reference, fused = _twins(8, 3, 4, seed=5)
    emb, pre = torch.randn(2, 3, 8, device=DEVICE), torch.randn(2, 3, 8, device=DEVICE)
    grads = []
    for topo in (reference, fused):
        e, p = emb.clone().requires_grad_(), pre.clone().requires_grad_()
        grads.append(_loop(topo, e, p, 3, list(topo.parameters()), only=only)[2])
    for a, b in zip(*grads):
        if b is None:
            assert a is None or not a.abs().sum()
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@runs_kernels
def test_autocast_leaves_the_write_read_in_the_state_dtype():
    """Under bf16 autocast the kernel reads and writes the fp32 state as it is: the states
    equal the fp32 run's exactly (the router weights' gradients are taken outside autocast)."""
    _, fused = _twins(8, 2, 4, seed=3)
    emb, pre = torch.randn(2, 3, 8, device=DEVICE), torch.randn(2, 3, 8, device=DEVICE)
    core = lambda h, t: torch.sin(h + t)  # noqa: E731
    want, _ = _run_topology(fused, emb, pre, core, 2)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got, _ = _run_topology(fused, emb, pre, core, 2)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        assert torch.equal(a, b)


def _on_kernel(cfg: ModelConfig, kernel: str) -> ModelConfig:
    return ModelConfig.from_dict({**cfg.to_dict(), "topology": {**cfg.topology.to_dict(), "kernel": kernel}})


@runs_kernels
@pytest.mark.parametrize("name", MESH_CONFIGS)
def test_models_equal_the_reference_forward_and_backward(name):
    """Every MeSH configuration (SpiralFormer's included): logits, loss, the router record
    and every parameter's gradient."""
    cfg = MESH_CONFIGS[name]()
    models = []
    for kernel in ("torch", "triton"):
        torch.manual_seed(0)
        model = LoopLM(_on_kernel(cfg, kernel))
        _randomise_routers(model.topology, seed=1)
        models.append(model.to(DEVICE))
    ids = random_ids(2, 16, vocab=cfg.vocab_size).to(DEVICE)
    ref, out = (m(ids, ids, output_states=True) for m in models)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    for key in ref.record:
        for a, b in zip(out.record[key], ref.record[key], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ref.loss.backward()
    out.loss.backward()
    for (n, p), q in zip(models[1].named_parameters(), models[0].parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@runs_kernels
@pytest.mark.parametrize("name", ["tiny-mesh", "spiralformer-b-tiny"])
def test_cache_decoding_equals_full_forward(name):
    torch.manual_seed(0)
    model = LoopLM(_on_kernel(MESH_CONFIGS[name](), "triton")).eval()
    _randomise_routers(model.topology, seed=2)
    model.to(DEVICE)
    x = random_ids(2, 12, vocab=model.cfg.vocab_size).to(DEVICE)
    with torch.no_grad():
        assert_decodes_like_full_forward(model, x, [prefill_then_tokens(5, 12), [3, 7, 12]], atol=1e-5)


@runs_kernels
def test_traces_as_one_graph():
    """The kernel is a custom operator Dynamo keeps whole (no graph break); compiled forward
    and backward equal eager."""
    _, fused = _twins(8, 2, 5, seed=4)
    assert_compiles_like_eager(fused, torch.randn(2, 3, 8, device=DEVICE), torch.randn(2, 3, 8, device=DEVICE), 2)


@runs_kernels
def test_training_step_launches_at_most_five_percent_more_than_the_base_loop():
    """Issue 25's target (MeSH ≤ 1.05 × base): per write-read one kernel forward, and one
    kernel, the routers' weight-gradient ``mm`` and bias-gradient ``sum`` backward."""
    base, mesh = _step_counts({"kind": "base"}, DEVICE), _step_counts({"kind": "mesh", "kernel": "triton"}, DEVICE)
    extra = mesh.by_op.copy()
    extra.subtract(base.by_op)
    assert mesh.syncs == 0, mesh.by_op
    assert mesh.by_op["looplm.mesh_write_read"] == 3 and mesh.by_op["looplm.mesh_write_read_backward"] == 3
    assert mesh.ops <= 1.05 * base.ops, f"mesh {mesh.ops} vs base {base.ops}: extra {dict(+extra)}"


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA only: bfloat16 storage through the interpreter is not the GPU's")
def test_bfloat16_model_is_close_to_the_float32_reference():
    """A bf16 model: the kernel reads and writes bf16, computes in float32 (the PyTorch
    operators compute in bf16): both within bf16 rounding of the float32 model."""
    torch.manual_seed(0)
    cfg = tiny_config("mesh")
    exact = LoopLM(_on_kernel(cfg, "torch"))
    _randomise_routers(exact.topology, seed=1)
    exact.to(DEVICE)
    fused = copy.deepcopy(exact).bfloat16()
    for m in fused.modules():
        if isinstance(m, MeshTopology):
            m.kernel = "triton"
    ids = random_ids(2, 16, vocab=cfg.vocab_size).to(DEVICE)
    want, got = exact(ids).logits, fused(ids).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2)


def test_kernel_setting_is_checked():
    with pytest.raises(ConfigError, match=r"model\.topology\.kernel.*'cuda'.*auto, torch, triton"):
        _on_kernel(tiny_config("mesh"), "cuda")
    assert LoopLM(tiny_config("mesh")).topology.kernel == "auto"
