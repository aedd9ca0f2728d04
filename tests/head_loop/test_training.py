"""Growth inside the trainer: decisions logged to metrics.jsonl, structure and schedule in
every checkpoint, a run resumed mid-growth continues exactly, ``looplm info`` shows it."""

from __future__ import annotations

import torch

from looplm.accounting import count_flops
from looplm.info import describe_source, format_description
from looplm.train import Trainer
from looplm.train.metrics import read_metrics
from tests.train.helpers import assert_same_weights, checkpoint_weights, run_config

HEAD_LOOP = {"kind": "heads", "heads": 2, "max_depth": 2, "layers": 2, "start": 2, "interval": 2}
KW = dict(model={"layout": "4", "head_loop": HEAD_LOOP}, max_steps=8, save_every=3)


def _events(path, name):
    return [{k: v for k, v in e.items() if k != "time"} for e in read_metrics(path / "metrics.jsonl")
            if e["event"] == name]


def test_growth_resumed_mid_growth_continues_exactly(tmp_path):
    whole = Trainer(run_config(tmp_path / "whole", **KW), progress=False)
    whole.fit()
    growth = _events(tmp_path / "whole", "growth")
    acts = [(e["step"], e["action"], e["block"]) for e in growth if e["action"] != "hold"]
    assert acts[0] == (2, "activate", "prelude.3") and (4, "drop", "prelude.3") in acts  # deepest first
    assert ("freeze" in {a for _, a, _ in acts}) and whole.growth.schedule.frozen
    assert all(0 not in e["candidates"] for e in growth if e["action"] != "drop")  # layer 0 excluded
    assert whole.growth.meter is None  # frozen: no more measurement hooks

    Trainer(run_config(tmp_path / "split", **KW), progress=False).fit(stop_after=3)  # mid-fade at step 3
    saved = torch.load(tmp_path / "split" / "checkpoints" / "step_0000003" / "trainer.pt", weights_only=True)
    assert saved["growth"]["active"] == [3] and not saved["growth"]["frozen"]
    resumed = Trainer(run_config(tmp_path / "split", **KW), resume=True, progress=False)
    assert sorted(resumed.model.blocks()[3].head_loop.weights) == [0.5, 0.5, 1.0, 1.0]  # mid-fade
    resumed.fit()

    def losses(path):
        return [(e["step"], e["loss"]) for e in _events(path, "train")]

    assert losses(tmp_path / "split") == losses(tmp_path / "whole")  # bit-exact
    assert _events(tmp_path / "split", "growth") == growth
    assert_same_weights(checkpoint_weights(tmp_path / "whole", 8), checkpoint_weights(tmp_path / "split", 8))
    assert resumed.growth.state_dict() == whole.growth.state_dict()
    # activated layers store S in consecutive slots (S not consecutive was moved), saved and resumed alike
    orders = [b.head_loop.order for b in whole.model.blocks()]
    assert [b.head_loop.order for b in resumed.model.blocks()] == orders
    assert all(b.head_loop.narrow for b in whole.model.blocks() if b.head_loop.depth > 0)
    assert any(order != tuple(sorted(order)) for order in orders)

    info = describe_source(str(tmp_path / "whole"))
    assert set(info["grown"]) == {a[2] for a in acts if a[1] == "activate"}
    assert "depth 2" in format_description(info)


def test_model_flops_follow_the_grown_structure(tmp_path):
    """The trainer's FLOPs/token (and so MFU) count the loops growth added, not the config."""
    trainer = Trainer(run_config(tmp_path / "run", **KW), progress=False)
    seq_len = trainer.cfg.data.seq_len
    before = trainer.throughput.per_token
    assert before == count_flops(trainer.cfg.model, seq_len).training_per_token
    trainer.fit(stop_after=3)  # block 3 grown (mid-fade): its heads loop
    after = trainer.throughput.per_token
    assert after == count_flops(trainer.model, seq_len).training_per_token
    assert after > before


def test_the_device_ema_matches_the_host_schedule_and_reads_back_only_at_decisions(tmp_path):
    """Growth keeps the entropy EMA on the device: after every step it equals, number for
    number, GrowthSchedule.observe on the host-read means, and a step reads the device back
    (a host sync) only when the growth operator decides."""
    from looplm.accounting.dispatch import count_dispatch
    from looplm.head_loop.schedule import GrowthSchedule

    trainer = Trainer(run_config(tmp_path / "run", **KW), progress=False)
    growth = trainer.growth
    meter = growth.meter
    host = GrowthSchedule(growth.schedule.cfg, growth.schedule.n_heads, growth.schedule.eligible)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 8):
        sums = torch.rand(meter.sums.shape, generator=gen) * 3
        counts = torch.randint(0, 3, meter.counts.shape, generator=gen).float()  # some layers unmeasured
        meter.sums.copy_(sums)
        meter.counts.copy_(counts)
        growth._observe(False)
        meter.sums.copy_(sums)
        meter.counts.copy_(counts)
        host.observe(meter.read())
        growth._sync()
        assert growth.schedule.ema == host.ema  # exact: the same float64 arithmetic

    growth.schedule.frozen = False
    off = next(s for s in range(1, 40) if not growth.schedule.reads_entropies_at(s))
    on = next(s for s in range(1, 40) if growth.schedule.reads_entropies_at(s))
    quiet, _ = count_dispatch(lambda: (growth._observe(False), growth.schedule.reads_entropies_at(off)))
    assert quiet.syncs == 0, quiet.by_op
    read, _ = count_dispatch(growth._sync)
    assert read.syncs >= 1 and growth.schedule.reads_entropies_at(on)
