"""train.activation_checkpointing: recomputation is exact (losses, auxiliary losses and every
gradient as without it), side effects happen once per forward (DSA index loss, SGT's
entropy meter), the forward keeps fewer saved tensors, and the state dict is unchanged."""

from __future__ import annotations

import gc
import os
import socket
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from looplm.cache import LoopCache
from looplm.config_base import ConfigError
from looplm.head_loop.entropy import EntropyMeter
from looplm.model import LoopLM
from looplm.model_config import ModelConfig
from looplm.train import Trainer, TrainConfig
from looplm.train.activation_checkpointing import apply_activation_checkpointing
from looplm.train.metrics import read_metrics, train_losses
from tests.train.helpers import checkpoint_weights, run_config

VOCAB = 48
MODELS = {
    "mesh": dict(layout="1+1R3+1", topology={"kind": "mesh"}),
    "gdn": dict(layout="1+1R3+1", mixer={"kind": "gated_deltanet"}),
    "act": dict(layout="1R3", step_embeddings=True, halting={"kind": "act", "ponder_cost": 0.1}),
    "dsa": dict(layout="1+1R3+1", mixer={"kind": "dsa", "top_k": 3, "index_heads": 2, "index_head_dim": 8}),
    "sgt": dict(layout="1+1R3+1", head_loop={"kind": "heads"}),
    "spiral": dict(layout="1+1x{1/8,1/4,1/2,1}+1", topology={"kind": "mesh"}, resolution={"shifts": [8, 4, 2, 1]}),
    "unshared": dict(layout="1+2R3+1", share_core=False),
    "two-streams": dict(layout="1+1R3+1", streams={"kind": "two"}),  # two core passes per macro step
}
MODES = ("block", "iteration")


def _model(name: str, mode: str) -> LoopLM:
    torch.manual_seed(0)
    model = LoopLM(ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=4, max_seq_len=64, **MODELS[name]))
    if name == "sgt":  # mid-growth: the core block and the coda loop, with a fading head
        model.blocks()[1].head_loop.set(2, [1.0, 0.0, 0.5, 1.0])
        model.blocks()[2].head_loop.set(1, [0.0, 1.0, 0.0, 0.0])
    apply_activation_checkpointing(model, mode)
    return model.train()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (2, 24), generator=g), torch.randint(0, VOCAB, (2, 24), generator=g)


def _step(model: LoopLM) -> dict:
    """Loss, auxiliary losses (read after the backward, when a recomputation could have
    changed them), every gradient, and the bytes of the tensors the forward saved."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    inputs, targets = _batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(inputs, targets)
    out.loss.backward()
    return dict(loss=out.loss.detach(), aux={k: v.detach() for k, v in out.aux_losses.items()},
                grads={n: p.grad for n, p in model.named_parameters()}, saved=saved[0],
                keys=list(model.state_dict()))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_losses_and_gradients_unchanged(name, mode):
    ref, got = _step(_model(name, "none")), _step(_model(name, mode))
    exact = dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got["loss"], ref["loss"], **exact)
    assert got["aux"].keys() == ref["aux"].keys()
    for key in ref["aux"]:  # the DSA index loss, ACT's ponder cost: counted once
        torch.testing.assert_close(got["aux"][key], ref["aux"][key], **exact)
    assert ("dsa_index" in ref["aux"]) == (name == "dsa")
    for param, grad in ref["grads"].items():
        if grad is None:
            assert got["grads"][param] is None, param
        else:
            torch.testing.assert_close(got["grads"][param], grad, **exact, msg=lambda m: f"{param}: {m}")
    assert got["keys"] == ref["keys"]
    assert got["saved"] < ref["saved"]


class _LiveTensors(TorchDispatchMode):
    """Every tensor the forward creates, weakly: after it, the bytes of those still alive are
    what the forward holds for the backward (saved tensors and checkpointed regions' inputs,
    which saved_tensors_hooks do not see)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs.extend(weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out

    def live_bytes(self) -> int:
        gc.collect()
        storages = {}
        for tensor in (ref() for ref in self.refs):
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def test_iteration_holds_one_state_per_loop_step():
    """A long loop of a 2-block core: block holds every block's input (2 per step),
    iteration one state per step; both far less than without checkpointing."""
    held = {}
    for mode in ("none", "block", "iteration"):
        torch.manual_seed(0)
        model = LoopLM(ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=4, max_seq_len=64, layout="1+2R8+1"))
        apply_activation_checkpointing(model, mode)
        live = _LiveTensors()
        with live:
            out = model(*_batch())
        held[mode] = live.live_bytes()
        del out
        assert live.live_bytes() == 0
    assert held["iteration"] < 0.8 * held["block"] and held["block"] < held["none"] / 10, held


@pytest.mark.parametrize("mode", MODES)
def test_entropy_meter_records_once_per_forward(mode):
    def measured(m: str) -> tuple[torch.Tensor, torch.Tensor]:
        model = _model("sgt", m)
        blocks = model.blocks()
        meter = EntropyMeter(blocks, range(len(blocks)), 4, torch.device("cpu"))
        inputs, targets = _batch()
        model(inputs, targets).loss.backward()
        return meter.sums.clone(), meter.counts.clone()

    (ref_sums, ref_counts), (sums, counts) = measured("none"), measured(mode)
    assert torch.equal(counts, ref_counts) and ref_counts.sum() > 0
    torch.testing.assert_close(sums, ref_sums)


def test_inert_without_a_graph_and_with_a_cache():
    """Evaluation and generation (no_grad) and cached forwards (even recording a graph) run
    no region: same logits, same tokens, the seam never called with a cache."""
    plain, checkpointed = _model("mesh", "none").eval(), _model("mesh", "iteration").eval()
    inputs, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(checkpointed(inputs).logits, plain(inputs).logits, rtol=0, atol=0)
    a = plain.generate(inputs[:1, :4], max_new_tokens=5, temperature=0.0)
    b = checkpointed.generate(inputs[:1, :4], max_new_tokens=5, temperature=0.0)
    assert torch.equal(a.sequences, b.sequences)

    def refuse(part, fn, x):
        raise AssertionError("a forward with a cache went through the checkpointing seam")

    checkpointed.recompute = refuse
    cached = checkpointed(inputs, cache=LoopCache()).logits
    torch.testing.assert_close(cached, plain(inputs).logits)


def test_config_is_validated():
    with pytest.raises(ConfigError, match="train.activation_checkpointing"):
        TrainConfig(activation_checkpointing="layer")
    dense = LoopLM(ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=4, layout="3"))
    with pytest.raises(ConfigError, match="train.activation_checkpointing.*no loop"):
        apply_activation_checkpointing(dense, "iteration")
    apply_activation_checkpointing(dense, "block")  # a dense model checkpoints its blocks


@pytest.mark.parametrize("model", [dict(topology={"kind": "mesh"}),
                                   dict(layout="4", head_loop={"kind": "heads", "heads": 2, "max_depth": 2,
                                                               "layers": 2, "start": 2, "interval": 2})],
                         ids=["mesh", "sgt-growth"])
def test_trainer_losses_and_checkpoint_keys_unchanged(tmp_path, model):
    runs = {}
    for mode in ("none", "block", "iteration"):
        if mode == "iteration" and "head_loop" in model:
            continue  # layout 4 has no loop
        out = tmp_path / mode
        Trainer(run_config(out, model=model, max_steps=4, save_every=4, activation_checkpointing=mode),
                progress=False).fit()
        losses = [e["loss"] for e in read_metrics(out / "metrics.jsonl") if e["event"] == "train"]
        growth = [e["action"] for e in read_metrics(out / "metrics.jsonl") if e["event"] == "growth"]
        runs[mode] = losses, growth, checkpoint_weights(out, 4)
    ref_losses, ref_growth, ref_weights = runs.pop("none")
    for mode, (losses, growth, weights) in runs.items():
        assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7), mode
        assert growth == ref_growth
        assert weights.keys() == ref_weights.keys()
        for key in ref_weights:
            torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-5, atol=1e-6)


def _ddp_worker(rank: int, world: int, port: int, out_dir: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:  # 2 sequences per rank in 2 micro-batches: DDP's no_sync under recomputation too
        cfg = run_config(out_dir, topology="mesh", batch_size=2, grad_accum=2, max_steps=3,
                         activation_checkpointing=mode)
        Trainer(cfg, progress=False).fit()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("mode", MODES)
def test_ddp_with_checkpointing_matches_one_process_without(tmp_path, mode):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path / "ddp"), mode), nprocs=2)
    Trainer(run_config(tmp_path / "single", topology="mesh", batch_size=4, grad_accum=2, max_steps=3),
            progress=False).fit()
    ddp, single = train_losses(tmp_path / "ddp" / "metrics.jsonl"), train_losses(tmp_path / "single" / "metrics.jsonl")
    assert sorted(ddp) == sorted(single) == [1, 2, 3]
    for step in single:  # only the reduction order differs
        assert ddp[step] == pytest.approx(single[step], rel=1e-5)


def test_compile_together_is_refused_with_a_fix():
    with pytest.raises(ConfigError, match="train.activation_checkpointing.*train.compile=false"):
        TrainConfig(activation_checkpointing="iteration", compile=True)
    TrainConfig(activation_checkpointing="none", compile=True)


def test_resume_with_another_mode_continues_exactly_and_quietly(tmp_path, caplog):
    """The option is resume-neutral: switching it on resume is no config difference."""
    whole = tmp_path / "whole"
    Trainer(run_config(whole, topology="mesh", max_steps=4), progress=False).fit()
    split = tmp_path / "split"
    Trainer(run_config(split, topology="mesh", max_steps=4, save_every=2), progress=False).fit(stop_after=2)
    with caplog.at_level("WARNING", logger="looplm"):
        Trainer(run_config(split, topology="mesh", max_steps=4, save_every=2, activation_checkpointing="iteration"),
                resume=True, progress=False).fit()
    assert "differ" not in caplog.text
    assert train_losses(split / "metrics.jsonl") == pytest.approx(train_losses(whole / "metrics.jsonl"), rel=1e-6)


def test_trainer_refuses_iteration_for_a_dense_model(tmp_path):
    with pytest.raises(ConfigError, match="train.activation_checkpointing.*no loop"):
        Trainer(run_config(tmp_path, model={"layout": "3"}, activation_checkpointing="iteration"), progress=False)
