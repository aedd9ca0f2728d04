"""train.compile=true: a compiled looped model trains as the eager one does.

One model carries the cases that used to break Dynamo: the base topology, a depth-level
hybrid of gated DeltaNet and softmax attention, and ACT halting (whose rule reads the
solution through a :class:`~looplm.halting.Readout` built inside the loop, and whose early
exit is data-dependent). Compiling on CPU takes ~30 s, the whole cost of this file.
"""

from __future__ import annotations

import pytest

from looplm.train import Trainer, train_losses
from tests.train.helpers import run_config

LOOPED_HYBRID = dict(layout="1+1R2+1", mixer={"kind": "gated_deltanet"}, hybrid={"mixer": {"kind": "attention"},
                     "layers": [1]}, step_embeddings=True, halting={"kind": "act", "ponder_cost": 0.1})


def test_compiled_looped_hybrid_with_halting_trains_like_eager(tmp_path):
    losses = {}
    for compiled in (False, True):
        out = tmp_path / ("compiled" if compiled else "eager")
        trainer = Trainer(run_config(out, model=LOOPED_HYBRID, max_steps=2, compile=compiled), progress=False)
        assert trainer.cfg.model.parsed_layout.is_looped and (trainer.train_model is not trainer.model) == compiled
        trainer.fit()
        losses[compiled] = train_losses(out / "metrics.jsonl")
    assert sorted(losses[True]) == [1, 2]
    for step, loss in losses[False].items():
        assert losses[True][step] == pytest.approx(loss, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", [True, "reduce-overhead", "max-autotune"])
def test_compile_modes_reach_torch_compile(tmp_path, monkeypatch, mode):
    """train.compile=reduce-overhead (CUDA graphs for the step) is passed on as the mode."""
    import torch

    seen = {}
    monkeypatch.setattr(torch, "compile", lambda module, **options: seen.update(options) or module)
    Trainer(run_config(tmp_path, max_steps=2, compile=mode), progress=False)
    assert seen == ({} if mode is True else {"mode": mode})


def test_compile_mode_errors_name_the_allowed_values():
    from looplm.config_base import ConfigError
    from looplm.train.config import TrainConfig

    with pytest.raises(ConfigError, match="train.compile='fast' is invalid.*reduce-overhead"):
        TrainConfig.from_dict({"compile": "fast"}, prefix="train")


@pytest.fixture(scope="module")
def throughput():
    from tests.test_benchmarks import benchmark

    return benchmark("train_throughput")


@pytest.mark.parametrize("name", ["dense", "base", "mesh", "spiral", "spiral-full", "block-loop", "sgt", "gdn"])
def test_each_throughput_variant_trains_in_one_graph(name, throughput, tmp_path):
    """Every variant benchmarks/train_throughput.py measures (issue 25: dense, the base loop,
    MeSH, SpiralFormer-B and its full loop, Block Loop and SGT grown, GDN) captures its
    training forward and backward as one graph with no break, and three steps on new data
    compile once: what ``train.compile=reduce-overhead`` needs to replay the step as CUDA
    graphs."""
    import argparse

    import torch
    from torch._dynamo.utils import counters

    args = argparse.Namespace(width=64, heads=4, seq=32, batch=2, device="cpu", dtype="fp32", threads=None)
    model = throughput.build(name, args, str(tmp_path), False).model
    torch._dynamo.reset()
    counters.clear()
    # GDN's backward under aot_eager trips a PyTorch stride mismatch (softplus_backward of a
    # transposed gradient, then a view): its forward is captured here, and inductor compiles
    # its forward and backward in test_compiled_looped_hybrid_with_halting_trains_like_eager
    backward = name != "gdn"
    step = torch.compile(lambda ids: model(ids, targets=ids).loss, backend="aot_eager" if backward else "eager",
                         fullgraph=True)
    for seed in range(3):
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
        loss = step(ids)
        if backward:
            loss.backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"]


@pytest.mark.parametrize("rung", ["dense", "tied", "tied_step", "ut_act", "dual_ut", "dual_nested_ut", "ar_trm"])
def test_each_ladder_rung_trains_in_one_graph(rung):
    """Every rung of the ladder (autoregressive-trm.txt App. B), adaptive regime (halted
    positions frozen: the harder case): forward and backward one graph, compiled once over
    two steps, so the paper-size ladder can run under ``train.compile=reduce-overhead``."""
    import torch
    from torch._dynamo.utils import counters

    from looplm import LoopLM
    from looplm.ladder import rung_model
    from looplm.model_config import ModelConfig

    cfg = ModelConfig(vocab_size=32, d_model=32, n_heads=2, max_seq_len=32, **rung_model(rung, 12, full_compute=False))
    model = LoopLM(cfg).train()
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda ids: model(ids, targets=ids).loss, backend="aot_eager", fullgraph=True)
    for seed in range(2):
        step(torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(seed))).backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
