"""The operator / host-sync counter (looplm.accounting.dispatch) that the speed tests use."""

import torch

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
