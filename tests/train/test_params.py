"""parameter_counts: stored tensors once each; components partition the total."""

from __future__ import annotations

import pytest

from looplm import LoopLM
from looplm.train import parameter_counts
from tests.conftest import all_configs, tiny_config

COMPONENTS = ("embedding", "prelude", "core", "coda", "topology", "final_norm", "head")


@pytest.mark.parametrize("name,cfg", all_configs(), ids=[n for n, _ in all_configs()])
def test_total_is_unique_numel_and_components_partition_it(name, cfg):
    model = LoopLM(cfg)
    counts = parameter_counts(model)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert counts["total"] == sum(unique.values())
    assert set(COMPONENTS) <= set(counts)
    assert sum(counts[c] for c in counts if c not in ("total", "non_embedding")) == counts["total"]
    assert counts["non_embedding"] == counts["total"] - counts["embedding"] - counts["head"]
    positions = cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0
    assert counts["embedding"] == cfg.vocab_size * cfg.d_model + positions
    assert counts["core"] == sum(p.numel() for p in model.core.parameters())
    assert counts["topology"] == (sum(p.numel() for p in model.topology.parameters()) if model.topology else 0)


def test_tied_head_is_counted_once_under_embedding():
    untied = parameter_counts(LoopLM(tiny_config("residual")))
    tied = parameter_counts(LoopLM(tiny_config("residual", tie_embeddings=True)))
    shared = 61 * 32
    assert tied["head"] == 0 and untied["head"] == shared
    assert tied["total"] == untied["total"] - shared
    assert tied["non_embedding"] == untied["non_embedding"]


def test_core_is_counted_once_however_many_iterations():
    two = parameter_counts(LoopLM(tiny_config("base", layout="1+2R2+1")))
    four = parameter_counts(LoopLM(tiny_config("base", layout="1+2R4+1")))
    unshared = parameter_counts(LoopLM(tiny_config("base", layout="1+2R4+1", share_core=False)))
    assert two["core"] == four["core"] and unshared["core"] == 4 * four["core"]
