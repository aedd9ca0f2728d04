"""The operator / host-sync counter (looplm.accounting.dispatch) that the speed tests use."""

import torch
import torch.nn.functional as F

from looplm.accounting.dispatch import count_dispatch


def test_views_and_allocations_are_free_compute_is_counted():
    x = torch.randn(4, 6)
    counts, y = count_dispatch(lambda: (x.view(6, 4).t().transpose(0, 1) + 1).sum())
    assert counts.ops == 2 and counts.syncs == 0
    assert counts.by_op["aten.add"] == 1 and counts.by_op["aten.sum"] == 1
    assert torch.equal(y, (x + 1).sum())


def test_host_reads_are_syncs():
    x = torch.randn(5)
    counts, _ = count_dispatch(lambda: (bool((x > 0).any()), x.sum().item(), (x > 0).nonzero()))
    assert counts.syncs == 3  # bool(), .item(), nonzero's data-dependent shape
    assert counts.by_op["aten._local_scalar_dense"] == 2 and counts.by_op["aten.nonzero"] == 1


def test_whole_tensor_reads_count_as_host_syncs() -> None:
    """Tensor.tolist / Tensor.numpy read a tensor to the host (a sync on a GPU) but reach no
    ATen operator on CPU: the counter still sees them."""
    x = torch.arange(6.0)
    counts, values = count_dispatch(lambda: (x.tolist(), x.numpy()))
    assert values[0] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert counts.syncs == 2 and counts.by_op["Tensor.tolist"] == 1 and counts.by_op["Tensor.numpy"] == 1
    free, _ = count_dispatch(lambda: x.shape[0] + len(x))  # metadata: no read
    assert free.syncs == 0 and free.ops == 0


def test_an_rms_norm_is_one_cuda_kernel_only_in_one_dtype() -> None:
    """F.rms_norm is six CPU operators and one fused CUDA kernel when input and weight
    share a dtype (``kernels``); with mixed dtypes torch runs the operators on CUDA too."""
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    fused, y = count_dispatch(lambda: F.rms_norm(x, (8,), w, 1e-5) + 1)
    assert fused.ops == 7 and fused.kernels == 2  # the norm's six as one, and the add
    assert torch.equal(y, F.rms_norm(x, (8,), w, 1e-5) + 1)
    alone, _ = count_dispatch(lambda: F.rms_norm(x, (8,)))
    assert alone.kernels == 1
    xb = x.bfloat16()
    mixed, _ = count_dispatch(lambda: F.rms_norm(xb, (8,), w, 1e-5))
    assert mixed.kernels == mixed.ops > 1
