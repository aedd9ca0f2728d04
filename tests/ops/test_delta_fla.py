"""The delta-rule ops against flash-linear-attention's own CPU references
(``fla.ops.{delta_rule,gated_delta_rule,kda}.naive``), forward, final state and gradients."""

from __future__ import annotations

import pytest
import torch

from looplm.ops.delta import chunk_delta_rule
from tests.ops.test_delta import make_inputs, outputs_and_grads

fla_delta = pytest.importorskip("fla.ops.delta_rule.naive", reason="flash-linear-attention not installed")
from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-5)



def test_deltanet_matches_fla_delta_rule_recurrence():
    q, k, v, beta, _, h0 = make_inputs(2, 29, 3, 8, 6, "none", dtype=torch.float32)
    o_ref, S_ref = fla_delta.delta_rule_recurrence(  # fla's layout: [B, H, T, ...]
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), beta.transpose(1, 2), initial_state=h0.clone()
    )
    o, S = chunk_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    torch.testing.assert_close(o, o_ref.transpose(1, 2), **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)


@pytest.mark.parametrize("fla_ref", ["recurrent", "chunk"])
def test_gated_deltanet_matches_fla(fla_ref):
    q, k, v, beta, log_alpha, h0 = make_inputs(2, 45, 3, 8, 6, "scalar", dtype=torch.float32)
    if fla_ref == "recurrent":
        o_ref, S_ref = naive_recurrent_gated_delta_rule(q, k, v, beta, log_alpha, initial_state=h0,
                                                        output_final_state=True)
    else:
        o_ref, S_ref = naive_chunk_gated_delta_rule(q, k, v, log_alpha, beta, chunk_size=16, initial_state=h0,
                                                    output_final_state=True)
    o, S = chunk_delta_rule(q, k, v, beta, log_alpha, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)


@pytest.mark.parametrize("fla_ref", ["recurrent", "chunk"])
def test_kda_matches_fla(fla_ref):
    # fla's naive chunk needs T % chunk_size == 0
    q, k, v, beta, log_alpha, h0 = make_inputs(2, 48, 3, 8, 6, "channel", dtype=torch.float32)
    ref = naive_recurrent_kda if fla_ref == "recurrent" else lambda *a, **kw: naive_chunk_kda(*a, chunk_size=16, **kw)
    o_ref, S_ref = ref(q, k, v, log_alpha, beta, initial_state=h0, output_final_state=True)
    o, S = chunk_delta_rule(q, k, v, beta, log_alpha, initial_state=h0, output_final_state=True, chunk_size=32)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)


def test_gated_deltanet_gradients_match_fla_naive_chunk():
    q, k, v, beta, log_alpha, h0 = make_inputs(1, 40, 2, 8, 4, "scalar", dtype=torch.float32)
    o_ref, S_ref, g_ref = outputs_and_grads(
        lambda q, k, v, b, g, **kw: naive_chunk_gated_delta_rule(q, k, v, g, b, chunk_size=16, **kw),
        q, k, v, beta, log_alpha, h0,
    )
    o, S, g = outputs_and_grads(chunk_delta_rule, q, k, v, beta, log_alpha, h0)
    for got, want in zip(g, g_ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
