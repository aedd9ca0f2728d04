"""The language-model loss of a linear head without its logits, in blocks of rows.

``F.cross_entropy(x @ W.T, targets)`` materialises the logits [N, V], their log-softmax
[N, V] and, in the backward, a zero-filled [N, V] gradient and the log-softmax's: at a
vocabulary of 8192 and 4096 tokens, five tensors of 128 MB per step, each written and read
through memory. Here each block of ``rows`` rows computes its logits, their logsumexp, the
loss and, when a gradient is wanted, the gradient of the logits (softmax − one-hot, over the
number of counted targets) and from it the block's gradients of x and W, all while the
block is in cache; the backward only scales the stored gradients by the incoming one. The
value is the mean over targets != ``ignore_index`` (NaN when none counts), as
``F.cross_entropy``'s; equal to it to float rounding (the sums run in another order).

Under autocast the products run in the autocast dtype and the softmax in fp32, as the
logits' ``.float()`` upcast does on the default path; W's gradient is accumulated in fp32.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from looplm.ops.autocast import autocast_dtype, no_autocast
from looplm.targets import IGNORE_INDEX


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy of the logits ``x @ weight.T`` against ``targets``, ``rows`` rows
    at a time. x: [N, d], weight: [V, d], targets: [N] -> a 0-d fp32 tensor."""
    if rows < 1:
        raise ValueError(f"rows={rows}: a block of at least one row")
    grad = torch.is_grad_enabled()  # no gradient work under no_grad (evaluation)
    return _LinearCrossEntropy.apply(x, weight, targets, rows, ignore_index,
                                     grad and x.requires_grad, grad and weight.requires_grad)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, rows, ignore_index, wants_x, wants_w):
        dtype = autocast_dtype(x)
        with no_autocast(x.device):
            xs, w = x.to(dtype), weight.to(dtype)
            counted = targets != ignore_index
            picks = torch.where(counted, targets, 0)
            scale = 1.0 / counted.sum().to(torch.float32)  # a tensor: no host sync; 1/0 = inf -> NaN loss
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            grad_x = torch.empty_like(x) if wants_x else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_w else None
            for start in range(0, x.shape[0], rows):
                block = slice(start, start + rows)
                logits = (xs[block] @ w.t()).float()  # [n, V]
                target_logit = logits.gather(1, picks[block, None]).squeeze(1)
                peak = logits.amax(dim=-1, keepdim=True)
                grad = logits.sub_(peak).exp_()  # the softmax's numerators, in place: one exp per logit
                norm = grad.sum(dim=-1)
                lse = peak.squeeze(1) + norm.log()  # logsumexp
                total += torch.where(counted[block], lse - target_logit, 0.0).sum()
                if wants_x or wants_w:  # d loss / d logits = (softmax - one-hot) / counted, on counted rows
                    share = counted[block].to(torch.float32) * scale
                    grad.mul_((share / norm)[:, None])
                    grad.scatter_add_(1, picks[block, None], -share[:, None])
                    grad = grad.to(dtype)
                    if wants_x and grad_x.dtype == dtype:
                        torch.mm(grad, w, out=grad_x[block])
                    elif wants_x:
                        grad_x[block] = grad @ w
                    if wants_w and dtype == torch.float32:
                        grad_w.addmm_(grad.t(), xs[block])
                    elif wants_w:
                        grad_w += grad.t() @ xs[block]
            loss = total * scale
        ctx.save_for_backward(grad_x, grad_w.to(weight.dtype) if grad_w is not None else None)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return (None if grad_x is None else grad_x * grad_loss.to(grad_x.dtype),
                None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype), None, None, None, None, None)
