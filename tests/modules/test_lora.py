"""Per-iteration LoRA on the shared core (Bae et al. 2024, Relaxed Recursive Transformers):
iteration t's linears compute W' x + B_t A_t x, the adapters start as the tied model, their
parameters, FLOPs and dispatched operators are counted, and what cannot combine is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from looplm.accounting import analytic_parameter_counts, count_flops, parameter_counts
from looplm.accounting.dispatch import count_dispatch
from looplm.config_base import ConfigError
from looplm.model import LoopLM
from looplm.modules.lora import IterationLoRA, svd_init
from tests.conftest import random_ids, relax_adapters, tiny_config


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _relaxed(rank: int = 2, **overrides) -> LoopLM:
    model = LoopLM(tiny_config("anchor", layout="1+2R3+1", lora={"rank": rank}, **overrides)).eval()
    relax_adapters(model)
    return model


def test_iteration_view_adds_that_iterations_low_rank_update():
    """h = W' x + b + B_t A_t x on every adapted linear, t picking the pair (§2.3)."""
    model = _relaxed()
    block = model.core[0][1]
    for t in range(3):
        for view, base, adapter in ((block.mixer_at(t).qkv, block.attn.qkv, block.lora.attn[0]["qkv"]),
                                    (block.mixer_at(t).o_proj, block.attn.o_proj, block.lora.attn[0]["o_proj"]),
                                    (block.ffn_at(t).up, block.ffn.up, block.lora.ffn["up"]),
                                    (block.ffn_at(t).down, block.ffn.down, block.lora.ffn["down"])):
            x_in = torch.randn(2, 5, base.in_features)
            weight = base.weight + adapter.B[t] @ adapter.A[t]
            torch.testing.assert_close(view(x_in), F.linear(x_in, weight, base.bias), atol=1e-5, rtol=1e-5)
    # the views share the stored modules: nothing is copied, the state dict holds each tensor once
    assert block.mixer_at(2).qkv.base is block.attn.qkv and block.ffn_at(1).down.base is block.ffn.down
    assert not any("per_iteration" in k for k in model.state_dict())


def test_zero_B_is_the_tied_model_bit_for_bit():
    """Trained from scratch the adapters start with B_t = 0 (Hu et al. §4.1): the tied model."""
    relaxed = LoopLM(tiny_config("anchor", layout="1+2R3+1", lora={"rank": 4})).eval()
    tied = LoopLM(tiny_config("anchor", layout="1+2R3+1")).eval()
    missing = tied.load_state_dict(relaxed.state_dict(), strict=False)
    assert missing.missing_keys == [] and all(".lora." in k for k in missing.unexpected_keys)
    assert all(torch.count_nonzero(B) == 0 and torch.count_nonzero(A) > 0
               for m in relaxed.modules() if isinstance(m, IterationLoRA) for A, B in zip(m.A, m.B))
    ids = random_ids(2, 9)
    with torch.no_grad():
        assert torch.equal(relaxed(ids).logits, tied(ids).logits)


def test_each_iteration_reads_only_its_own_adapters():
    model = _relaxed()
    ids = random_ids(2, 9)
    with torch.no_grad():
        before = model(ids).logits
        model.core[0][0].lora.ffn["up"].B[2].add_(1.0)  # the last iteration's
        after_last = model(ids).logits
        fewer = model(ids, iterations=2).logits  # iteration 2 does not run
        model.core[0][0].lora.ffn["up"].B[2].sub_(1.0)
        assert torch.equal(fewer, model(ids, iterations=2).logits)
    assert not torch.allclose(before, after_last)
    with pytest.raises(ConfigError, match="at most 3: model.lora") as err:
        model(ids, iterations=4)
    assert err.value.field == "iterations"


def test_gradients_reach_every_iterations_adapters():
    model = LoopLM(tiny_config("anchor", layout="1+2R3+1", lora={"rank": 2}))
    ids = random_ids(2, 9)
    model(ids, ids).loss.backward()
    for m in model.modules():
        if isinstance(m, IterationLoRA):
            assert all(B.grad is not None and B.grad.abs().sum() > 0 for B in m.B)  # B_t learns from A_t x


@pytest.mark.parametrize("lora,overrides", [
    ({"rank": 2}, {}),
    ({"rank": 3}, dict(norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2)),
    ({"rank": 1}, dict(mixer={"kind": "attention", "output_gate": True})),
    ({"rank": 2, "targets": ["mlp"]}, dict(mixer={"kind": "gated_deltanet"})),
    ({"rank": 2, "targets": ["attention"]}, dict(layout="1+1x{1/2,1}+1")),
    ({"rank": 2, "targets": ["qkv"]}, dict(mixer={"kind": "attention", "output_gate": True})),
    ({"rank": 3, "targets": ["o_proj", "mlp"]}, dict(n_kv_heads=2)),
])
def test_parameters_are_T_times_r_in_plus_out_per_adapted_linear(lora, overrides):
    cfg = tiny_config("anchor", **{"layout": "1+2R3+1", **overrides, "lora": lora})
    tied = dataclasses.replace(cfg, lora={"rank": 0})
    d, H, Hkv, D, F_ = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_hidden
    mixer = {"qkv": (d, (H + 2 * Hkv) * D), "o_proj": (H * D, d),
             **({"gate": (d, H * D)} if getattr(cfg.mixer, "output_gate", False) else {})}
    mlp = [(d, F_), (F_, d)] + ([(d, F_)] if cfg.mlp == "swiglu" else [])
    targets = cfg.lora.targets
    shapes = [s for n, s in mixer.items() if "attention" in targets or n in targets] + (mlp if "mlp" in targets else [])
    extra = cfg.iterations * cfg.structure.core * sum(cfg.lora.rank * (i + o) for i, o in shapes)
    counted, before = parameter_counts(LoopLM(cfg)), parameter_counts(LoopLM(tied))
    assert counted["core"] - before["core"] == extra == counted["total"] - before["total"]
    assert analytic_parameter_counts(cfg) == counted


def test_flops_add_r_in_plus_out_macs_per_adapted_linear_and_match_the_flop_counter():
    cfg = tiny_config("anchor", layout="1+2R3+1", lora={"rank": 3})
    tied = dataclasses.replace(cfg, lora={"rank": 0})
    batch, seq, d, F_ = 2, 16, cfg.d_model, cfg.ffn_hidden
    rows = batch * seq
    shapes = [(d, 3 * d), (d, d), (d, F_), (F_, d)]
    passes = cfg.iterations * cfg.structure.core
    macs = passes * rows * sum(3 * (i + o) for i, o in shapes)
    adds = passes * rows * sum(o for _, o in shapes)
    assert count_flops(cfg, seq, batch=batch).forward - count_flops(tied, seq, batch=batch).forward == 2 * macs
    assert count_flops(cfg, seq, batch=batch, convention="mesh").forward - \
        count_flops(tied, seq, batch=batch, convention="mesh").forward == macs + adds
    model = _relaxed(3)
    ids = random_ids(batch, seq)
    with FlopCounterMode(display=False) as counter:
        model(ids, output_attentions=True)  # explicit attention: FlopCounterMode sees every product
    assert counter.get_total_flops() == count_flops(model, seq, batch=batch, convention="torch").forward


def test_training_step_dispatches_eight_operators_per_adapted_linear_pass():
    """Forward: two thin products and the add onto W'x; backward: four products and the sum
    of the input's two gradients; no per-use select-backward or sum over iterations (each
    A_t, B_t is its own parameter), plus one accumulation per adapter parameter into an
    existing .grad."""
    def ops(cfg) -> tuple[int, dict]:
        model = LoopLM(cfg)
        ids = random_ids(2, 16)

        def step():
            model(ids, ids).loss.backward()

        step()
        count, _ = count_dispatch(step)
        return count.ops, count.by_op

    cfg = tiny_config("anchor", layout="1+2R3+1", lora={"rank": 2})
    (relaxed, by_op), (tied, _) = ops(cfg), ops(dataclasses.replace(cfg, lora={"rank": 0}))
    linears, params = 4, 4 * 2 * cfg.iterations
    passes = cfg.iterations * cfg.structure.core
    assert relaxed - tied <= 8 * linears * passes + params * cfg.structure.core, by_op
    assert "aten.select_backward" not in by_op, by_op


@pytest.mark.parametrize("overrides,field", [
    (dict(layout="3"), "model.lora.rank"),
    (dict(share_core=False), "model.lora.rank"),
    (dict(head_loop={"kind": "heads", "heads": 2}), "model.lora.rank"),
    (dict(mixer={"kind": "gated_deltanet"}), "model.lora.targets"),
    (dict(lora={"rank": -1}), "model.lora.rank"),
    (dict(lora={"rank": 2, "targets": ["q"]}), "model.lora.targets"),
    (dict(lora={"rank": 2, "targets": ["attention", "qkv"]}), "model.lora.targets"),
    (dict(mixer={"kind": "gated_deltanet"}, lora={"rank": 2, "targets": ["o_proj"]}), "model.lora.targets"),
    (dict(lora={"rank": 2, "targets": []}), "model.lora.targets"),
])
def test_refusals_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        tiny_config("anchor", **{"lora": {"rank": 2}, **overrides})
    assert err.value.field == field


def test_off_adds_no_parameters_and_round_trips():
    cfg = tiny_config("anchor")
    assert not any("lora" in k for k in LoopLM(cfg).state_dict())
    relaxed = tiny_config("anchor", lora={"rank": 2, "targets": ["mlp"]})
    assert type(relaxed).from_dict(relaxed.to_dict()) == relaxed


def test_svd_init_pads_past_the_matrix_rank():
    residual = torch.randn(6, 4)
    A, B = svd_init(residual, 5)
    assert A.shape == (5, 4) and B.shape == (6, 5) and torch.count_nonzero(A[4:]) == 0
    torch.testing.assert_close(B @ A, residual, atol=1e-5, rtol=1e-5)
