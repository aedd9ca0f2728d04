"""Every looplm Triton kernel compiles for the GPU the project measures on (Hopper, sm_90),
with float32 and bfloat16 storage, on this CPU machine: each op is called as a model calls
it, its kernel launches are recorded instead of run, and Triton's own compiler takes each
launch's arguments to PTX and a cubin (through the ptxas Triton ships). The interpreter
tests run a kernel's arithmetic, not its compilation: a construct the GPU backend cannot
lower, or a type that does not unify, fails only here (or on a device). Skipped where the
installed Triton has no NVIDIA backend or ptxas."""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter replaces the compiler", allow_module_level=True)
try:
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, mangle_type
except ImportError:  # a Triton whose ahead-of-time entry points moved
    pytest.skip("this Triton has no triton.compiler.ASTSource / runtime.jit.mangle_type", allow_module_level=True)

HOPPER = (90, 32)  # compute capability, warp size


def _compiler_available() -> bool:
    try:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        return False
    nvidia = backends.get("nvidia")
    if nvidia is None:
        return False
    ptxas = os.path.join(os.path.dirname(inspect.getfile(nvidia.compiler)), "bin", "ptxas")
    return os.path.exists(ptxas) or bool(os.environ.get("TRITON_PTXAS_PATH"))


pytestmark = pytest.mark.skipif(not _compiler_available(), reason="Triton without its NVIDIA backend and ptxas")


def recorded_launches(call: Callable[[], Any], kernels: list[JITFunction], monkeypatch) -> list[tuple]:
    """(kernel, positional args, keyword args) of every launch of ``kernels`` while ``call``
    runs; the kernels themselves do not run (their outputs stay uninitialised)."""
    launches = []
    for kernel in kernels:
        monkeypatch.setattr(kernel, "run", lambda *args, grid, warmup, kernel=kernel, **kwargs:
                            launches.append((kernel, args, kwargs)))
    call()
    return launches


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict, capability: tuple[int, int] = HOPPER):
    """Compile ``kernel`` for an NVIDIA GPU of ``capability`` with one launch's arguments:
    tensors and scalars typed as Triton types them, constexprs bound to their values, launch
    options (``num_warps``…) passed as options."""
    from triton.backends.compiler import GPUTarget

    values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
    signature, constexprs = {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values[name]
        if param.is_constexpr or value is None:
            signature[name], constexprs[(i,)] = "constexpr", value
        else:
            signature[name] = mangle_type(value)
    source = ASTSource(kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", capability[0], capability[1]), options=options)


def _resolution_calls(dtype: torch.dtype):
    """SpiralFormer's down- and up-scaling, learned and fixed, at the GPU benchmark's width, g = 8."""
    from looplm.ops import resolution_triton as rt

    B, T, d, g, n = 2, 64, 1024, 8, 8
    tokens, grad_z = torch.randn(B, T, d, dtype=dtype), torch.randn(B, n, d, dtype=dtype)
    scorer_w, scorer_b = torch.randn(1, d, dtype=dtype), torch.randn(1, dtype=dtype)
    router_w, router_b = torch.randn(g, d, dtype=dtype), torch.randn(g, dtype=dtype)
    alpha, beta = torch.rand(B, n, g), torch.rand(B, n, g)

    def run():
        for scorer, router in (((scorer_w, scorer_b), (router_w, router_b)), ((None, None), (None, None))):
            rt.aggregate(tokens, *scorer, 4, n, g)  # self-aggregation; the mean
            rt.aggregate_backward(grad_z, tokens, scorer[0], alpha, 4)
            rt.allocate(grad_z, *router, g, g**0.5, 7, 4, T)  # the allocation router; uniform
            rt.allocate_backward(tokens, grad_z, router[0], beta, g**0.5, 7, 4)

    kernels = [rt._aggregate_forward_kernel, rt._aggregate_backward_kernel, rt._allocate_forward_kernel,
               rt._allocate_backward_kernel]
    return run, kernels


def _mesh_calls(dtype: torch.dtype):
    """MeSH's write-read, its update written and the state itself written (t = -1), and the
    backward with every incoming gradient and with none but h's."""
    from looplm.ops import write_read_triton as wr

    B, T, d, J, S = 2, 16, 1024, 3, 5
    state, update = torch.randn(B, T, d, dtype=dtype), torch.randn(B, T, d, dtype=dtype)
    values, weights = torch.randn(B, T, J, d, dtype=dtype), torch.rand(B, T, J, S, dtype=dtype)
    routers = [torch.randn(S, d, dtype=dtype), torch.randn(S, dtype=dtype)] * 2

    def run():
        wr.write_read(state, update, values, weights, *routers)
        wr.write_read(state, None, values, weights, *routers)
        probs, coef = torch.rand(B, T, 2, S, dtype=dtype), torch.rand(B, T, J + 1, dtype=dtype)
        out_values, out_weights = torch.randn(B, T, J + 1, d, dtype=dtype), torch.rand(B, T, J + 1, S, dtype=dtype)
        args = (state, routers[0], routers[2], probs, out_weights, out_values, coef, dtype)
        wr.write_read_backward(state, out_values, out_weights, *args, False)
        wr.write_read_backward(state, None, None, *args, True)

    return run, [wr._forward_kernel, wr._backward_kernel]


def _selected_calls(dtype: torch.dtype):
    """DSA's attention over selected keys, forward (with the mass record) and backward."""
    from looplm.ops.sparse import topk_indices
    from looplm.ops.sparse import selected_triton as st

    B, Hkv, G, T, S, D, W = 1, 2, 4, 8, 64, 64, 16
    q, k, v = (torch.randn(B, Hkv, *shape, dtype=dtype) for shape in ((G, T, D), (S, D), (S, D)))
    index, keep = topk_indices(torch.randn(B, T, S), W)

    def run():
        o, lse, _ = st._forward(q, k, v, index, keep, 0.125, True)
        st._backward(q, k, v, index, keep, o, torch.rand(B, Hkv, G, T), torch.randn_like(o), 0.125)

    return run, [st._forward_kernel, st._backward_kernel]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ops", [_resolution_calls, _mesh_calls, _selected_calls],
                         ids=["resolution", "mesh-write-read", "dsa-selected"])
def test_every_launch_compiles_for_hopper(ops, dtype, monkeypatch):
    run, kernels = ops(dtype)
    launches = recorded_launches(run, kernels, monkeypatch)
    assert {kernel for kernel, _, _ in launches} == set(kernels)  # every kernel of the op was launched
    for kernel, args, kwargs in launches:
        compiled = compile_launch(kernel, args, kwargs)
        assert compiled.asm["cubin"], kernel.fn.__name__


def test_a_kernel_the_backend_cannot_lower_fails_here():
    """Not vacuous: a kernel the GPU compiler rejects (a matrix product of 4 × 4 blocks,
    an inner dimension below what ``tl.dot`` lowers) fails to compile here."""
    with pytest.raises(Exception, match=r"K >= \d+"):
        compile_launch(_small_dot, (torch.zeros(16),), {"N": 4})


@triton.jit
def _small_dot(X, N: triton.language.constexpr):
    rows = triton.language.arange(0, N)
    block = triton.language.load(X + rows[:, None] * N + rows[None, :])
    triton.language.store(X + rows[:, None] * N + rows[None, :], triton.language.dot(block, block))
