"""fla's gated backward where fla refuses it (looplm.ops.fla_hopper): the check against the
PyTorch ops, the verdicts and what they decide, and fla's kernel launched at wide tiles.

On CPU, fla's kernels cannot run (its autotuner needs a GPU driver, even under
TRITON_INTERPRET): the check runs with looplm's own ops standing in for fla's (exact, and
with one gradient broken), and the wide-tile launch against a stub of fla's modules that
records it. tests/gpu/test_fla_backend.py runs both on a device with fla's real kernels."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from looplm.ops import backend, fla_hopper
from looplm.ops.fla_hopper import DQKWG_PARAMETERS, WIDE, GatedOp

OPS = [GatedOp("delta", False, 2, 16, 8), GatedOp("delta", True, 3, 16, 16), GatedOp("decay", False, 2, 8, 16),
       GatedOp("decay", True, 1, 16, 8)]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(fla_hopper, "_VERDICTS", {})
    monkeypatch.setattr(backend, "_GUARD", {})


LINEAR_KINDS = ["linear_attention", "retnet", "gla", "hgrn2", "mamba2", "deltanet", "gated_deltanet", "kda"]


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_each_layer_names_the_gated_op_it_runs(kind, monkeypatch):
    """``gated_op()`` (what use_fla is asked about, and what is checked before compiling)
    describes the op the layer's forward really runs: no gate exactly when log α is None,
    per channel exactly when log α is [B, T, H, K], and the head widths of q and v."""
    from looplm.mixers import MixerConfig, MixerContext
    from looplm.mixers import deltanet, linear_attention
    from looplm.model_config import ModelConfig
    from looplm.modules.rotary import Rotary

    cfg = ModelConfig(d_model=64, n_heads=4, layout="1", max_seq_len=64, bias=False)
    layer = MixerConfig.from_dict({"kind": kind}).build(cfg.block_shape)
    seen = []

    def spy(reference, gate_at):
        def op(q, k, v, *args, **kwargs):
            log_alpha = args[gate_at] if len(args) > gate_at else kwargs.get("log_alpha")
            seen.append((*q.shape[-2:], v.shape[-1], None if log_alpha is None else log_alpha.dim()))
            return reference(q, k, v, *args, **kwargs)

        return op

    monkeypatch.setattr(deltanet, "chunk_delta_rule", spy(deltanet.chunk_delta_rule, 1))  # (q, k, v, beta, log_alpha)
    monkeypatch.setattr(linear_attention, "chunk_decay", spy(linear_attention.chunk_decay, 0))  # (q, k, v, log_alpha)
    positions = torch.arange(8).expand(2, 8)
    ctx = MixerContext(rope=Rotary(cfg.rotary_dim, cfg.rope_theta)(positions, torch.float32),
                       valid=torch.ones(2, 8, dtype=torch.bool), past=0, padded=False)
    layer(torch.randn(2, 8, 64), ctx)
    (H, K, V, gate_dims), = seen
    op = layer.gated_op()
    if gate_dims is None:
        assert op is None
    else:
        family = "delta" if isinstance(layer, deltanet.DeltaRuleMixer) else "decay"
        assert op == GatedOp(family, gate_dims == 4, H, K, V)


def test_check_before_compile_asks_only_where_fla_refuses(monkeypatch):
    from looplm import LoopLM
    from tests.conftest import tiny_config

    model = LoopLM(tiny_config("base", layout="1R2", mixer={"kind": "gated_deltanet"}))
    asked = []
    monkeypatch.setattr(backend, "verified_backward", lambda op, device, dtype: asked.append(op) or True)
    monkeypatch.setattr(backend, "fla_installed", lambda: True)
    cuda = torch.device("cuda", 0)
    backend._GUARD[str(cuda)] = True
    assert backend.check_before_compile(model, cuda, torch.bfloat16) == {} and asked == []
    assert backend.check_before_compile(model, torch.device("cpu"), torch.bfloat16) == {}
    backend._GUARD[str(cuda)] = False
    op = model.core[0][0].attn.gated_op()
    assert op.family == "delta" and not op.channels
    assert backend.check_before_compile(model, cuda, torch.bfloat16) == {op: True} and asked == [op]


def fla_standins(monkeypatch, broken: str | None = None):
    """looplm's PyTorch ops in fla's place (in the op's dtype), the gradient of input
    ``broken`` halved on the way back (what a miscompiled kernel does)."""
    from looplm.ops import decay, delta

    class Halve(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 0.5

    def wrap(reference):
        def fla_op(q, k, v, *args, **kwargs):
            named = dict(zip(("q", "k", "v"), (q, k, v)))
            if broken in named:
                named[broken] = Halve.apply(named[broken])
            return reference(named["q"], named["k"], named["v"], *args, **kwargs)

        return fla_op

    def fla_delta_rule(q, k, v, beta, log_alpha, initial_state, step):
        return wrap(delta.chunk_delta_rule)(q, k, v, beta, log_alpha, initial_state=initial_state,
                                             output_final_state=True)

    monkeypatch.setattr(delta, "fla_delta_rule", fla_delta_rule)
    monkeypatch.setattr(decay, "fla_decay", wrap(decay.chunk_decay))


@pytest.mark.parametrize("op", OPS, ids=str)
def test_the_check_passes_a_correct_kernel_and_fails_a_wrong_gradient(op, monkeypatch):
    fla_standins(monkeypatch)
    errors = fla_hopper.backward_errors(op, torch.device("cpu"), torch.float32)
    expected = {"o", "dq", "dk", "dv", "dlog_alpha"} | ({"dbeta"} if op.family == "delta" else set())
    assert set(errors) == expected
    assert max(errors.values()) < 1e-5
    low = fla_hopper.backward_errors(op, torch.device("cpu"), torch.bfloat16)  # bf16 inputs, float32 reference
    assert max(low.values()) < fla_hopper.TOLERANCE
    fla_standins(monkeypatch, broken="k")
    errors = fla_hopper.backward_errors(op, torch.device("cpu"), torch.float32)
    assert errors["dk"] > 5 * fla_hopper.TOLERANCE and errors["o"] < 1e-5 and errors["dv"] < 1e-5


def test_a_verdict_is_reached_once_logged_and_decides_the_backend(monkeypatch, caplog):
    calls = []

    def errors(op, device, dtype):
        calls.append((op, dtype))
        return {"o": 0.01, "dq": 0.02, "dk": 0.5 if op.channels else 0.03}

    monkeypatch.setattr(fla_hopper, "backward_errors", errors)
    monkeypatch.setattr(fla_hopper, "use_wide_tiles", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    cpu = torch.device("cpu")
    scalar, channels = GatedOp("delta", False, 4, 64, 64), GatedOp("delta", True, 4, 64, 64)
    with caplog.at_level(logging.INFO, logger="looplm"):
        assert fla_hopper.verified_backward(scalar, cpu, torch.bfloat16)
        assert not fla_hopper.verified_backward(channels, cpu, torch.bfloat16)
        assert fla_hopper.verified_backward(scalar, cpu, torch.bfloat16)  # remembered
    assert calls == [(scalar, torch.bfloat16), (channels, torch.bfloat16)]
    lines = [r.getMessage() for r in caplog.records]
    assert any("passes" in line and "0.03 (dk)" in line and "H100" in line for line in lines), lines
    assert any("fails" in line and "0.5 (dk)" in line and "PyTorch kernels" in line for line in lines), lines
    # where fla's own guard refuses the gated backward, the verdict decides; elsewhere fla runs
    backend._GUARD[str(cpu)] = False
    assert backend.fla_gated_backward_ok(cpu, scalar, torch.bfloat16)
    assert not backend.fla_gated_backward_ok(cpu, channels, torch.bfloat16)
    assert not backend.fla_gated_backward_ok(cpu)  # no op: not every gated backward is safe here
    backend._GUARD[str(cpu)] = True
    assert backend.fla_gated_backward_ok(cpu, channels, torch.bfloat16) and backend.fla_gated_backward_ok(cpu)
    assert len(calls) == 2


def test_the_check_runs_in_float32_when_asked_under_autocast(monkeypatch):
    """A layer asks from inside a bf16-autocast forward: the reference op must still run in
    float32 (else it would be no reference), and with gradients on."""
    seen = []

    def errors(op, device, dtype):
        seen.append((torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()))
        return {"o": 0.0}

    monkeypatch.setattr(fla_hopper, "backward_errors", errors)
    monkeypatch.setattr(fla_hopper, "use_wide_tiles", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert fla_hopper.verified_backward(OPS[0], torch.device("cpu"), torch.bfloat16)
    assert seen == [(False, True)]


def test_a_kernel_that_raises_fails_the_check(monkeypatch, caplog):
    """fla raising inside the check (its own guard, a compile error) makes the op train on
    PyTorch with the reason logged; the model's forward goes on."""
    def errors(op, device, dtype):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results\nmore")

    monkeypatch.setattr(fla_hopper, "backward_errors", errors)
    monkeypatch.setattr(fla_hopper, "use_wide_tiles", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    with caplog.at_level(logging.INFO, logger="looplm"):
        assert not fla_hopper.verified_backward(OPS[0], torch.device("cpu"), torch.bfloat16)
    assert any("fails" in r.getMessage() and "RuntimeError: Triton >= 3.4.0" in r.getMessage() for r in caplog.records)


def test_no_check_runs_inside_a_trace(monkeypatch):
    monkeypatch.setattr(fla_hopper, "backward_errors", lambda *a: pytest.fail("checked while tracing"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fla_hopper.verified_backward(OPS[0], torch.device("cpu"), torch.bfloat16)
    assert fla_hopper._VERDICTS == {}  # an eager call decides later


class Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](**kwargs)`` records the launch and fills
    dq, dk with ones and dg with its key-tile index + 1."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.launches.append((grid, kwargs))
            kwargs["dq"].fill_(1.0)
            kwargs["dk"].fill_(1.0)
            if kwargs["dg"] is not None:
                for tile in range(kwargs["dg"].shape[0]):
                    kwargs["dg"][tile].fill_(tile + 1.0)

        return launch


@pytest.fixture
def stub_fla(monkeypatch):
    """fla's modules as far as the wide-tile launch touches them."""
    kernel = Recorder()

    def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                        state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")

    def prepare_chunk_indices(cu_seqlens, chunk_size):
        pairs = [(n, i) for n in range(len(cu_seqlens) - 1)
                 for i in range(-(-int(cu_seqlens[n + 1] - cu_seqlens[n]) // chunk_size))]
        return torch.tensor(pairs)

    modules = {
        "fla": {}, "fla.ops": {}, "fla.ops.common": {},
        "fla.ops.common.chunk_o": {"chunk_bwd_dqkwg": chunk_bwd_dqkwg, "chunk_bwd_kernel_dqkwg": kernel},
        "fla.ops.utils": {"prepare_chunk_indices": prepare_chunk_indices},
        "fla.ops.gated_delta_rule": {}, "fla.ops.gated_delta_rule.chunk": {"chunk_bwd_dqkwg": chunk_bwd_dqkwg},
        "fla.ops.simple_gla": {}, "fla.ops.simple_gla.chunk": {"chunk_bwd_dqkwg": chunk_bwd_dqkwg},
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    for name in modules:  # submodules as attributes of their parents, as an import leaves them
        parent, _, child = name.rpartition(".")
        if parent:
            monkeypatch.setattr(sys.modules[parent], child, sys.modules[name], raising=False)
    return kernel


def test_wide_tiles_replace_the_refusing_host_function(stub_fla):
    assert fla_hopper.use_wide_tiles()
    for name in fla_hopper.PATCHED_MODULES:
        assert sys.modules[name].chunk_bwd_dqkwg is fla_hopper.wide_tile_dqkwg
    assert fla_hopper.use_wide_tiles()  # idempotent


def test_wide_tiles_leave_another_fla_version_alone(stub_fla, monkeypatch):
    def chunk_bwd_dqkwg(q, k, v, do, h, dh, g=None):  # another signature: another version
        raise RuntimeError

    original = sys.modules["fla.ops.gated_delta_rule.chunk"].chunk_bwd_dqkwg
    monkeypatch.setattr(sys.modules["fla.ops.common.chunk_o"], "chunk_bwd_dqkwg", chunk_bwd_dqkwg)
    assert not fla_hopper.use_wide_tiles()
    assert sys.modules["fla.ops.gated_delta_rule.chunk"].chunk_bwd_dqkwg is original


@pytest.mark.parametrize("K, V, H, HV, varlen", [(64, 64, 2, 2, False), (200, 96, 2, 4, False), (32, 16, 1, 1, True)])
def test_wide_tile_launch(stub_fla, K, V, H, HV, varlen):
    """One program per (key tile, chunk) × (batch, value head), tiles WIDE wide whatever the
    head width; dg summed over key tiles, dq and dk over the value heads of a key head."""
    B, T, chunk = (1, 100, 64) if varlen else (2, 130, 64)
    q, k = torch.zeros(B, T, H, K), torch.zeros(B, T, H, K)
    v, do, dv = (torch.zeros(B, T, HV, V) for _ in range(3))
    h = dh = torch.zeros(B, 3, HV, K, V)
    g, w = torch.zeros(B, T, HV), torch.zeros(B, T, HV, K)
    cu_seqlens = torch.tensor([0, 40, 100]) if varlen else None
    dq, dk, dw, dg = fla_hopper.wide_tile_dqkwg(q, k, v, do, h, dh, w=w, g=g, dv=dv, scale=0.125,
                                                cu_seqlens=cu_seqlens, chunk_size=chunk)
    (grid, kwargs), = stub_fla.launches
    tiles = -(-K // WIDE)
    chunks = 3 if varlen else -(-T // chunk)  # varlen: 40 -> 1 chunk, 60 -> 1 ... as prepare_chunk_indices lists
    if varlen:
        chunks = len(kwargs["chunk_indices"])
    assert grid == (tiles * chunks, B * HV)
    assert kwargs["BK"] == kwargs["BV"] == WIDE and kwargs["BT"] == chunk
    assert (kwargs["K"], kwargs["V"], kwargs["H"], kwargs["HV"], kwargs["T"], kwargs["B"]) == (K, V, H, HV, T, B)
    assert kwargs["scale"] == 0.125 and kwargs["STATE_V_FIRST"] is False and kwargs["g_gamma"] is None
    assert kwargs["dq"].shape == kwargs["dk"].shape == (B, T, HV, K)
    assert kwargs["dg"].shape == (tiles, B, T, HV) and kwargs["dg"].dtype == torch.float32
    assert set(kwargs) == {"q", "k", "v", "g", "g_gamma", "h", "do", "dh", "dq", "dk", "dw", "dv", "dg",
                           "cu_seqlens", "chunk_indices", "scale", "B", "T", "H", "HV", "K", "V", "BT", "BK",
                           "BV", "STATE_V_FIRST"}
    assert dq.shape == dk.shape == (B, T, H, K)
    assert torch.equal(dq, torch.full_like(dq, HV // H)) and torch.equal(dk, dq)
    assert torch.equal(dg, torch.full_like(dg, tiles * (tiles + 1) / 2))
    assert dw.shape == w.shape


def test_the_stand_in_matches_the_installed_fla():
    """Where fla is installed (GPU machines; not CI): its host function has the parameters
    the wide-tile launch stands in for, and its kernel the arguments it is launched with."""
    chunk_o = pytest.importorskip("fla.ops.common.chunk_o", reason="flash-linear-attention not installed")
    import inspect

    assert tuple(inspect.signature(chunk_o.chunk_bwd_dqkwg).parameters) == DQKWG_PARAMETERS
    kernel = chunk_o.chunk_bwd_kernel_dqkwg
    while not hasattr(kernel, "arg_names"):  # autotuner / heuristics wrappers
        kernel = kernel.fn
    launched = {"q", "k", "v", "g", "g_gamma", "h", "do", "dh", "dq", "dk", "dw", "dv", "dg", "cu_seqlens",
                "chunk_indices", "scale", "B", "T", "H", "HV", "K", "V", "BT", "BK", "BV", "STATE_V_FIRST"}
    heuristics = {"USE_G", "USE_G_GAMMA", "USE_DW", "IS_VARLEN"}
    assert set(kernel.arg_names) == launched | heuristics
