"""``generate(compile="cuda-graph")``: the eager decoding step on the static cache recorded as
CUDA graphs and replayed (``looplm.generation._GraphedStep``).

A CPU has no CUDA graphs, so the bookkeeping is tested against a stand-in runtime with
their semantics: recording runs the step's Python and keeps the operators it dispatches
(a tape) while leaving every tensor it wrote in place as it was (a real recording runs no
kernel), a host sync while recording raises as CUDA does, and a replay runs the tape again
on the same tensors — the recorded outputs are rewritten in place, the token buffer is
read, nothing on the host moves. The CUDA run itself is tests/gpu's.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from looplm import LoopLM, generation
from looplm.accounting.dispatch import count_dispatch
from looplm.config import load_config

PRESETS = ["tiny-lt2-transformer", "tiny-lt2-gdn", "tiny-lt2-hybrid-full-gdn", "tiny-lt2-hybrid-gdn-dsa",
           "tiny-lt2-nsa", "tiny-lt2-hybrid-full-window", "tiny-mesh", "tiny-dense", "ladder-ut-act",
           "mor-tiny-shared"]
#: SpiralFormer: a graph per host-side phase (a chunk completes at the new position or not)
SPIRAL = ["spiralformer-b-tiny"]

SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.item.default}


def _written(func) -> list[int]:
    """Positions of the arguments ``func`` writes in place."""
    return [i for i, arg in enumerate(func._schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]


class _Tape(TorchDispatchMode):
    """Records every operator; undoes every in-place write when recording ends."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCS:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        for i in _written(func):
            if i < len(args) and isinstance(args[i], torch.Tensor) and id(args[i]) not in self.saved:
                self.saved[id(args[i])] = (args[i], args[i].clone())
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def undo(self) -> None:
        for tensor, before in self.saved.values():
            tensor.copy_(before)

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and new is not out:
                out.copy_(new)
            elif isinstance(out, (tuple, list)):
                for o, n in zip(out, new):
                    if isinstance(o, torch.Tensor) and n is not o:
                        o.copy_(n)


class _Graph:
    def __init__(self) -> None:
        self.tape = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.tape.replay()


class _Stream:
    def wait_stream(self, other) -> None:
        pass


class StandIn:
    """``torch.cuda``'s graph and stream calls, on a CPU."""

    def __init__(self) -> None:
        self.graphs: list[_Graph] = []

    CUDAGraph = _Graph
    Stream = _Stream

    @staticmethod
    def current_stream() -> _Stream:
        return _Stream()

    @staticmethod
    def stream(stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def graph_pool_handle():
        return object()

    @contextlib.contextmanager
    def graph(self, graph: _Graph, pool=None):
        tape = _Tape()
        try:
            with tape:
                yield
        finally:
            tape.undo()  # a recording runs no kernel
        graph.tape = tape
        self.graphs.append(graph)


@pytest.fixture
def stand_in(monkeypatch) -> StandIn:
    runtime = StandIn()
    monkeypatch.setattr(generation, "_graph_runtime", lambda device: runtime)
    return runtime


def _model(preset: str) -> LoopLM:
    torch.manual_seed(0)
    return LoopLM(load_config(preset).model).eval()


def _prompts(vocab: int, lengths=(7, 3, 5)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("preset", PRESETS)
def test_graphed_generate_equals_eager_and_replays_one_graph(preset, stand_in):
    model = _model(preset)
    prompts = _prompts(model.cfg.vocab_size)
    eager = model.generate(prompts, max_new_tokens=20, temperature=0)
    graphed = model.generate(prompts, max_new_tokens=20, temperature=0, compile="cuda-graph")
    assert torch.equal(graphed.sequences, eager.sequences)
    assert graphed.block_passes_per_token == eager.block_passes_per_token
    # 19 decoding steps: the first eager (warm-up), the second recorded and replayed, then replays
    assert len(stand_in.graphs) == 1 and stand_in.graphs[0].replays == 18


@pytest.mark.parametrize("preset", SPIRAL)
@pytest.mark.parametrize("prompt", [9, 3])  # 3: before the coarsest iteration's first chunk (eager until then)
def test_graphed_spiralformer_records_a_graph_per_phase(preset, prompt, stand_in):
    model = _model(preset)
    prompts = _prompts(model.cfg.vocab_size, lengths=(prompt, prompt))  # multi-resolution refuses padding
    eager = model.generate(prompts, max_new_tokens=40, temperature=0)
    graphed = model.generate(prompts, max_new_tokens=40, temperature=0, compile="cuda-graph")
    assert torch.equal(graphed.sequences, eager.sequences)
    assert len(stand_in.graphs) >= 2  # several phases, each recorded once
    assert sum(g.replays for g in stand_in.graphs) >= 39 - 2 * len(stand_in.graphs)


def test_graphed_sampling_with_stop_tokens_equals_eager(stand_in):
    model = _model("tiny-lt2-hybrid-full-gdn")
    prompts = _prompts(model.cfg.vocab_size)
    options = dict(max_new_tokens=40, temperature=0.9, top_k=20, stop_tokens=[5, 7, 11])
    eager = model.generate(prompts, generator=torch.Generator().manual_seed(1), **options)
    graphed = model.generate(prompts, generator=torch.Generator().manual_seed(1), compile="cuda-graph", **options)
    assert torch.equal(graphed.sequences, eager.sequences) and graphed.new_tokens == eager.new_tokens


def test_a_step_that_syncs_decodes_eagerly_with_the_reason_logged(stand_in, monkeypatch, caplog):
    model = _model("tiny-lt2-transformer")
    prompts = _prompts(model.cfg.vocab_size)
    eager = model.generate(prompts, max_new_tokens=12, temperature=0)
    step = generation._decode_step

    def syncing(model, token, cache, iterations):
        int(token.sum())  # a host read: not permitted while recording
        return step(model, token, cache, iterations)

    monkeypatch.setattr(generation, "_decode_step", syncing)
    with caplog.at_level(logging.WARNING, logger="looplm.generation"):
        graphed = model.generate(prompts, max_new_tokens=12, temperature=0, compile="cuda-graph")
    assert torch.equal(graphed.sequences, eager.sequences)
    assert "could not record the decoding step" in caplog.text and "not permitted" in caplog.text
    assert stand_in.graphs == []


def test_the_recorded_step_has_no_host_sync():
    """What ``compile="cuda-graph"`` records: the eager step on the static cache, no host sync
    per token (a CPU decodes it eagerly, logged)."""
    model = _model("tiny-lt2-hybrid-gdn-dsa")
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    one, _ = count_dispatch(lambda: model.generate(ids, max_new_tokens=1, temperature=0, compile="cuda-graph"))
    many, _ = count_dispatch(lambda: model.generate(ids, max_new_tokens=17, temperature=0, compile="cuda-graph"))
    assert many.syncs == one.syncs, many.by_op


def test_on_a_cpu_cuda_graph_decodes_eagerly_on_the_static_cache(caplog):
    model = _model("tiny-lt2-gdn")
    prompts = _prompts(model.cfg.vocab_size)
    eager = model.generate(prompts, max_new_tokens=10, temperature=0)
    with caplog.at_level(logging.WARNING, logger="looplm.generation"):
        static = model.generate(prompts, max_new_tokens=10, temperature=0, compile="cuda-graph")
    assert torch.equal(static.sequences, eager.sequences)
    assert "CUDA graphs need a CUDA device" in caplog.text


def test_compile_refuses_other_strings():
    model = _model("tiny-dense")
    with pytest.raises(ValueError, match="compile.*'graph'.*'cuda-graph'"):
        model.generate([[1, 2]], max_new_tokens=2, compile="graph")
