"""The loss without its logits (looplm.modules.linear_cross_entropy, ``loss_rows``): the same
value and gradients as ``F.cross_entropy`` of the logits, for the op, every model of the
configuration grid and the trainer; nothing read back to the host; no gradient work without
a gradient."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from looplm import LoopLM
from looplm.accounting.dispatch import count_dispatch
from looplm.config_base import ConfigError
from looplm.modules.linear_cross_entropy import linear_cross_entropy
from looplm.train import Trainer, read_metrics
from tests.conftest import all_configs, random_ids
from tests.train.helpers import run_config


def _inputs(n: int, d: int, vocab: int, ignored: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, requires_grad=True)
    weight = torch.randn(vocab, d, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[torch.randperm(n, generator=g)[:ignored]] = -100
    return x, weight, targets


def _loss_and_grads(fn, x, weight):
    loss = fn()
    (3 * loss).backward()  # an incoming gradient other than 1
    grads = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    return loss.detach(), grads


@pytest.mark.parametrize("n, rows, ignored", [(37, 1, 0), (37, 5, 4), (37, 37, 9), (37, 64, 2), (64, 16, 0)])
def test_equals_the_cross_entropy_of_the_logits(n, rows, ignored):
    x, weight, targets = _inputs(n, 16, 50, ignored)
    ref, (rx, rw) = _loss_and_grads(lambda: F.cross_entropy(x @ weight.t(), targets), x, weight)
    got, (gx, gw) = _loss_and_grads(lambda: linear_cross_entropy(x, weight, targets, rows), x, weight)
    assert got.dtype == torch.float32 and got.shape == ()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-7)


def test_under_bf16_autocast_the_products_run_in_bf16_and_the_softmax_in_fp32():
    x, weight, targets = _inputs(40, 16, 50, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, (rx, rw) = _loss_and_grads(lambda: F.cross_entropy((x @ weight.t()).float(), targets), x, weight)
        got, (gx, gw) = _loss_and_grads(lambda: linear_cross_entropy(x, weight, targets, 8), x, weight)
    assert gx.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)  # the same bf16 logits, fp32 from there
    for got_grad, ref_grad in ((gx, rx), (gw, rw)):  # bf16 products: equal to bf16 rounding of the largest
        torch.testing.assert_close(got_grad, ref_grad, rtol=0, atol=2 ** -7 * ref_grad.abs().max().item())


def test_every_target_ignored_gives_nan_as_cross_entropy_does():
    x, weight, targets = _inputs(12, 8, 20, 12)
    assert math.isnan(F.cross_entropy(x @ weight.t(), targets).item())
    assert math.isnan(linear_cross_entropy(x, weight, targets, 5).item())


def test_no_gradient_work_without_a_gradient_and_no_host_sync():
    x, weight, targets = _inputs(40, 8, 30, 2)
    with torch.no_grad():
        evaluating, value = count_dispatch(lambda: linear_cross_entropy(x, weight, targets, 16))
    training, loss = count_dispatch(lambda: linear_cross_entropy(x, weight, targets, 16))
    assert evaluating.syncs == training.syncs == 0
    assert evaluating.ops < training.ops / 1.5, (evaluating.by_op, training.by_op)
    assert torch.equal(value, loss.detach())


def test_rows_below_one_are_refused():
    x, weight, targets = _inputs(4, 8, 10, 0)
    with pytest.raises(ValueError, match="rows=0"):
        linear_cross_entropy(x, weight, targets, 0)


@pytest.mark.parametrize("name, cfg", all_configs(), ids=[name for name, _ in all_configs()])
def test_a_model_computes_the_same_loss_and_gradients_without_its_logits(name, cfg):
    torch.manual_seed(0)
    model = LoopLM(cfg)
    ids = random_ids(2, 11, vocab=cfg.vocab_size)
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100

    def run(**kw):
        torch.manual_seed(1)  # Huginn's random initial state draws the same noise in both runs
        out = model(ids, targets, **kw)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out, grads

    ref, ref_grads = run()
    out, grads = run(loss_rows=5)
    assert out.logits is None and ref.logits is not None
    torch.testing.assert_close(out.lm_loss, ref.lm_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-4, atol=1e-6, msg=key)


def test_a_model_refuses_loss_rows_without_targets_or_below_zero():
    model = LoopLM(all_configs()[0][1])
    ids = random_ids(1, 5, vocab=model.cfg.vocab_size)
    with pytest.raises(ConfigError, match="loss_rows"):
        model(ids, loss_rows=4)
    with pytest.raises(ConfigError, match="loss_rows"):
        model(ids, ids, loss_rows=-1)


@pytest.mark.parametrize("topology, model", [
    ("base", None), ("concat_adapter", {"depth": {"kind": "lognormal_poisson", "sigma": 0.5, "backprop_window": 1}})])
def test_training_with_loss_rows_follows_the_default_run(tmp_path, topology, model):
    """train.loss_rows: the same losses step by step as the logits' cross-entropy (to float
    rounding), with a depth sampled per step (Huginn's) too; the validation loss as well
    (computed without the logits too)."""
    kw = dict(topology=topology, model=model, max_steps=4, eval_every=2)
    Trainer(run_config(tmp_path / "whole", **kw), progress=False).fit()
    Trainer(run_config(tmp_path / "rows", **kw, loss_rows=24), progress=False).fit()
    for event, key, count in (("train", "loss", 4), ("eval", "val_loss", 2)):
        ref = [e[key] for e in read_metrics(tmp_path / "whole" / "metrics.jsonl") if e["event"] == event]
        got = [e[key] for e in read_metrics(tmp_path / "rows" / "metrics.jsonl") if e["event"] == event]
        assert len(got) == len(ref) == count
        assert got == pytest.approx(ref, rel=1e-4)


def test_validation_with_loss_rows_writes_no_logits(tmp_path, monkeypatch):
    """The validation pass with train.loss_rows runs the blocked loss (no [tokens, vocab] tensor)."""
    from looplm.train.validation import ValidationLoss

    trainer = Trainer(run_config(tmp_path, max_steps=2, loss_rows=16), progress=False)
    seen = []
    original = LoopLM.forward

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append((kwargs.get("loss_rows"), out.logits))
        return out

    monkeypatch.setattr(LoopLM, "forward", spy)
    assert ValidationLoss.mean_loss(trainer) > 0
    assert seen and all(rows == 16 and logits is None for rows, logits in seen)


def test_train_loss_rows_below_zero_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="train.loss_rows"):
        run_config(tmp_path, loss_rows=-2)
