"""Assisted (speculative) decoding through ``generate(assistant_model=...)``: the drafts a
small model proposes and the main model rejects are cropped from both caches, so greedy
output equals plain greedy decoding, and no forward is fed positions its cache holds."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("transformers")

from looplm.hf.export import LoopLMCache, LoopLMConfig, LoopLMForCausalLM  # noqa: E402
from looplm.hf.export.modeling import _CACHE_FIELD as CACHE_FIELD  # noqa: E402
from looplm.mixers.attention import RING_SPARE  # noqa: E402
from tests.conftest import random_ids, tiny_config  # noqa: E402

MODELS = {
    "attention": tiny_config("anchor"),
    "sliding-window": tiny_config("anchor", mixer={"kind": "sliding_window", "window": 4}),
    "act": tiny_config("anchor", layout="1+1R3", halting={"kind": "act"}),
    "gdn-hybrid": tiny_config("residual", layout="4R2", mixer={"kind": "gated_deltanet"},
                              hybrid={"mixer": {"kind": "attention"}, "ratio": "1:1"}),
}


def hf_model(cfg, seed: int) -> LoopLMForCausalLM:
    torch.manual_seed(seed)
    return LoopLMForCausalLM(LoopLMConfig(looplm=cfg.to_dict())).eval()


@pytest.fixture(scope="module")
def assistant() -> LoopLMForCausalLM:
    """Another (untrained) model: most of its drafts are rejected, so the caches are cropped."""
    model = hf_model(tiny_config("base", layout="1"), seed=1)
    model.generation_config.num_assistant_tokens = 6
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0  # always draft all six
    return model


@contextlib.contextmanager
def spied(monkeypatch, *models):
    """Record every crop (positions held, count removed) and every forward's (cached, new)
    of ``models`` while the block runs."""
    crops, feeds = [], []
    crop = LoopLMCache.crop
    monkeypatch.setattr(LoopLMCache, "crop", lambda self, n: (crops.append((self.get_seq_length(), n)), crop(self, n))[1])

    def record(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs.get("input_ids", args[0] if args else None)
        feeds.append((0 if cache is None else cache.get_seq_length(), ids.shape[1]))

    hooks = [model.register_forward_pre_hook(record, with_kwargs=True) for model in models]
    try:
        yield crops, feeds
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("name, static", [("attention", False), ("attention", True), ("sliding-window", False),
                                          ("sliding-window", True), ("act", False)])
@torch.no_grad()
def test_assisted_greedy_decoding_equals_greedy_decoding(name, static, assistant, monkeypatch):
    """The growing cache, or the static one (a window's ring rewinds RING_SPARE positions)."""
    model = hf_model(MODELS[name], seed=0)
    prompt, new = random_ids(1, 24), 24
    plain = model.generate(prompt, max_new_tokens=new, do_sample=False)
    cache = {CACHE_FIELD: LoopLMCache(max_cache_len=64)} if static else {}
    with spied(monkeypatch, model, assistant) as (crops, feeds):
        assisted = model.generate(prompt, max_new_tokens=new, do_sample=False, assistant_model=assistant, **cache)
    torch.testing.assert_close(assisted, plain, rtol=0, atol=0)
    assert any(removed < -1 for _, removed in crops)  # multi-token rejections were cropped
    assert all(cached + fed <= prompt.shape[1] + new for cached, fed in feeds)  # nothing fed twice
    assert max(-removed for _, removed in crops) <= RING_SPARE  # within what a window's cache rewinds


@torch.no_grad()
def test_assisted_decoding_of_a_recurrent_state_is_refused_with_the_reason(assistant):
    model = hf_model(MODELS["gdn-hybrid"], seed=0)
    with pytest.raises(ValueError, match="cannot crop"):
        model.generate(random_ids(1, 12), max_new_tokens=12, do_sample=False, assistant_model=assistant)
