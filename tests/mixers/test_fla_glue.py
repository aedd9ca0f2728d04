"""The glue to flash-linear-attention, checked on CPU: every linear mixer, told to take the
fla backend, calls fla's entry points with arguments their signatures accept and with the
meaning fla gives them (layout, gate convention, scale, states).

fla's Triton kernels cannot run without a GPU, so each entry point is replaced by fla's own
PyTorch reference for the same op (``fla.ops.*.naive``), called with the kernel's
arguments; the layer must then give what looplm's PyTorch path gives, forward, backward and
decoding. On a GPU, ``tests/gpu`` compares against the kernels themselves.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from looplm.mixers import MixerConfig, MixerContext
from looplm.model_config import ModelConfig
from looplm.modules.rotary import Rotary
from tests.invariants import prefill_then_tokens

pytest.importorskip("fla", reason="flash-linear-attention not installed")

KINDS = ["linear_attention", "retnet", "gla", "hgrn2", "mamba2", "deltanet", "gated_deltanet", "kda"]
CFG = ModelConfig(d_model=32, n_heads=2, layout="1", max_seq_len=256, bias=False)


def _naive(module: str, name: str):
    return getattr(importlib.import_module(f"fla.ops.{module}.naive"), name)


def _scaled(q: torch.Tensor, scale: float) -> torch.Tensor:
    """q for a reference whose scale is fixed at K^-1/2, so that it applies ``scale``."""
    return q * (scale * q.shape[-1] ** 0.5)


def _linear_attn(a: dict):
    assert a["normalize"] is False, "looplm's linear attention has no denominator (fla layers' default)"
    return _naive("linear_attn", "naive_recurrent_linear_attn")(
        a["q"], a["k"], a["v"], a["scale"], a["initial_state"], a["output_final_state"], normalize=False)


def _simple_gla(a: dict):
    assert a["g_gamma"] is None
    return _naive("simple_gla", "naive_recurrent_simple_gla")(
        a["q"], a["k"], a["v"], a["g"], a["scale"], a["initial_state"], a["output_final_state"])


def _gla(gate: str):
    def run(a: dict):
        assert a.get("gv") is None
        return _naive("gla", "naive_recurrent_gla")(
            _scaled(a["q"], a["scale"]), a["k"], a["v"], a[gate], a["initial_state"], a["output_final_state"])
    return run


def _delta_rule(a: dict):
    scale = a["scale"] if a["scale"] is not None else a["q"].shape[-1] ** -0.5
    heads_first = [x.transpose(1, 2) for x in (_scaled(a["q"], scale), a["k"], a["v"], a["beta"])]
    o, state = _naive("delta_rule", "delta_rule_recurrence")(*heads_first, a["initial_state"], a["output_final_state"])
    return o.transpose(1, 2), state


def _gated_delta_rule(a: dict):
    assert a.get("gk") is None and a.get("gv") is None
    q, k, g, beta = a["q"], a["k"], a["g"], a["beta"]
    if a.get("use_qk_l2norm_in_kernel"):  # the kernel's: x / sqrt(Σ x² + 1e-6)
        q, k = (x / (x.float().pow(2).sum(-1, keepdim=True) + 1e-6).sqrt().to(x.dtype) for x in (q, k))
    if a.get("use_gate_in_kernel"):
        z = g if a["dt_bias"] is None else g + a["dt_bias"]
        g = -a["A_log"].float().exp() * torch.nn.functional.softplus(z.float())
    if a.get("use_beta_sigmoid_in_kernel"):
        beta = torch.sigmoid(beta.float()) * (2 if a["allow_neg_eigval"] else 1)
    return _naive("gated_delta_rule", "naive_recurrent_gated_delta_rule")(
        q, k, a["v"], beta, g, a["scale"], a["initial_state"], a["output_final_state"])


def _kda(a: dict):
    return _naive("kda", "naive_recurrent_kda")(
        a["q"], a["k"], a["v"], a["g"], a["beta"], a["scale"], a["initial_state"], a["output_final_state"])


#: (module, entry point) -> fla's reference for the same op, given the entry point's arguments
REFERENCES = {
    ("linear_attn", "chunk_linear_attn"): _linear_attn,
    ("linear_attn", "fused_recurrent_linear_attn"): _linear_attn,
    ("simple_gla", "chunk_simple_gla"): _simple_gla,
    ("simple_gla", "fused_recurrent_simple_gla"): _simple_gla,
    ("gla", "chunk_gla"): _gla("g"),
    ("gla", "fused_recurrent_gla"): _gla("gk"),
    ("delta_rule", "chunk_delta_rule"): _delta_rule,
    ("delta_rule", "fused_recurrent_delta_rule"): _delta_rule,
    ("gated_delta_rule", "chunk_gated_delta_rule"): _gated_delta_rule,
    ("gated_delta_rule", "fused_recurrent_gated_delta_rule"): _gated_delta_rule,
    ("kda", "chunk_kda"): _kda,
    ("kda", "fused_recurrent_kda"): _kda,
}
#: arguments that must keep their defaults: looplm never uses varlen, reversal, v-first states
#: or the in-kernel normalisation / gating (it does those itself, as fla's layers do outside),
#: except in GDN's decoding step (``IN_KERNEL``)
MUST_BE_DEFAULT = ("cu_seqlens", "cu_seqlens_cpu", "reverse", "state_v_first", "use_qk_l2norm_in_kernel",
                   "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "A_log", "dt_bias")
#: entry point -> the in-kernel options looplm's decoding step sets
IN_KERNEL = {"fused_recurrent_gated_delta_rule": ("use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                                  "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "A_log")}


@pytest.fixture
def fla_on_cpu(monkeypatch):
    """Send the mixers to the fla backend on CPU, with each entry point replaced by its
    reference; returns the list of entry points called."""
    called: list[str] = []
    for (module, name), reference in REFERENCES.items():
        package = importlib.import_module(f"fla.ops.{module}")
        kernel = getattr(package, name)

        def fake(*args, _kernel=kernel, _name=name, _reference=reference, **kwargs):
            bound = inspect.signature(_kernel).bind(*args, **kwargs)  # TypeError on an argument fla lacks
            bound.apply_defaults()
            a = dict(bound.arguments)
            a.update(a.pop("kwargs", {}))
            in_kernel = [o for o in IN_KERNEL.get(_name, ()) if a[o] is not None and a[o] is not False]
            for option in MUST_BE_DEFAULT:
                if option in a and option not in IN_KERNEL.get(_name, ()):
                    default = inspect.signature(_kernel).parameters[option].default
                    assert a[option] is default or a[option] == default, f"{_name}: {option}={a[option]!r}"
            assert a["output_final_state"] is True, f"{_name}: looplm needs the final state"
            called.append(_name + ("+in_kernel" if in_kernel else ""))
            o, state = _reference(a)
            return o.to(a["v"].dtype), state  # the kernels return o in the inputs' dtype; some references float32

        monkeypatch.setattr(package, name, fake)
    for module in FLA_USERS:
        monkeypatch.setattr(importlib.import_module(module), "use_fla", lambda x, gated=False: True)
    monkeypatch.setattr(importlib.import_module("fla.modules.fused_norm_gate"), "rms_norm_gated", _rms_norm_gated)
    return called


#: the modules that ask ``use_fla``
FLA_USERS = ("looplm.mixers.linear_attention", "looplm.mixers.deltanet", "looplm.modules.norm")


def _rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                    eps=1e-6):
    """fla's fused gated RMSNorm as its docstring defines it: rms(x) · w · act(g)."""
    assert bias is None and residual is None and not prenorm and activation in ("swish", "sigmoid")
    gate = torch.nn.functional.silu(g) if activation == "swish" else torch.sigmoid(g)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight * gate


def context(length: int, past: int = 0, batch: int = 2) -> MixerContext:
    positions = torch.arange(past, past + length).expand(batch, length)
    rope = Rotary(CFG.rotary_dim, CFG.rope_theta)(positions, torch.float64)
    valid = torch.ones(batch, past + length, dtype=torch.bool)
    return MixerContext(rope=rope, valid=valid, past=past, padded=False)


def run_layer(layer, x: torch.Tensor, ends: list[int]):
    """Outputs of x fed in pieces ending at ``ends`` (one piece: a training forward with
    backward), the final recurrent state, and the gradients."""
    layer.zero_grad(set_to_none=True)
    pieces, state, start = [], None, 0
    xi = x.clone().requires_grad_(len(ends) == 1)
    with torch.set_grad_enabled(len(ends) == 1):
        for end in ends:
            out, state = layer(xi[:, start:end], context(end - start, past=start), state)
            pieces.append(out)
            start = end
    out = torch.cat(pieces, dim=1)
    if len(ends) == 1:
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        grads = {"x": xi.grad, **{n: p.grad for n, p in layer.named_parameters() if p.grad is not None}}
    else:
        grads = {}
    return out.detach(), state.recurrent.detach().double(), grads


@pytest.mark.parametrize("kind", KINDS)
def test_fla_backend_glue_matches_pytorch_path(kind, fla_on_cpu, monkeypatch):
    """Training forward + backward and prefill + steps through the glue (float64, so that
    float32 DeltaNet also takes fla's chunk path) equal looplm's own ops."""
    torch.manual_seed(0)
    layer = MixerConfig.from_dict({"kind": kind}).build(CFG.block_shape).double()
    x = torch.randn(2, 24, CFG.d_model, dtype=torch.float64)
    for ends in ([24], prefill_then_tokens(20, 24)):
        via_fla = run_layer(layer, x, ends)
        with monkeypatch.context() as torch_only:
            for module in FLA_USERS:
                torch_only.setattr(importlib.import_module(module), "use_fla", lambda x, gated=False: False)
            reference = run_layer(layer, x, ends)
        # fla's references compute in float32
        torch.testing.assert_close(via_fla[0], reference[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(via_fla[1], reference[1], atol=1e-5, rtol=1e-4)
        assert via_fla[2].keys() == reference[2].keys()
        for name in reference[2]:
            torch.testing.assert_close(via_fla[2][name], reference[2][name], atol=1e-4, rtol=1e-3, msg=name)
    chunked = {name for name in fla_on_cpu if name.startswith("chunk")}
    stepped = {name for name in fla_on_cpu if name.startswith("fused_recurrent")}
    assert len(chunked) == 1 and len(stepped) == 1, fla_on_cpu  # training took the chunk kernel, decoding the recurrent one
    if kind == "gated_deltanet":  # the step hands fla the raw q, k and gates
        assert stepped == {"fused_recurrent_gated_delta_rule+in_kernel"}, fla_on_cpu
