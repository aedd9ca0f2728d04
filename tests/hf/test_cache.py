"""LoopLMCache: the transformers ``Cache`` operations generate() and assisted decoding use
(crop, row selection, row repetition) leave the looplm cache as decoding from scratch would."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from looplm.hf.export import LoopLMCache, LoopLMConfig, LoopLMForCausalLM  # noqa: E402
from tests.conftest import random_ids, tiny_config  # noqa: E402


@pytest.fixture(scope="module", params=["anchor", "gdn-hybrid", "act"])
def model(request) -> LoopLMForCausalLM:
    torch.manual_seed(0)
    cfg = {
        "anchor": tiny_config("anchor"),
        "gdn-hybrid": tiny_config("residual", layout="4R2", mixer={"kind": "gated_deltanet"},
                                  hybrid={"mixer": {"kind": "attention"}, "ratio": "1:1"}),
        "act": tiny_config("anchor", layout="1+1R3", halting={"kind": "act"}),
    }[request.param]
    return LoopLMForCausalLM(LoopLMConfig(looplm=cfg.to_dict())).eval()


def _next_logits(model, ids, cache) -> torch.Tensor:
    return model(ids, past_key_values=cache).logits[:, -1]


@torch.no_grad()
def test_crop_removes_the_last_positions(model, request):
    ids = random_ids(2, 9)
    cache = model(ids[:, :7]).past_key_values
    if "gdn" in request.node.callspec.id:  # a recurrent state summarises every position: looplm refuses
        with pytest.raises(ValueError, match="cannot crop"):
            cache.crop(-3)
        return
    cache.crop(-3)  # transformers' convention: remove 3
    assert cache.get_seq_length() == 4
    torch.testing.assert_close(_next_logits(model, ids[:, 4:5], cache), model(ids[:, :5]).logits[:, -1],
                               atol=1e-5, rtol=0)


@torch.no_grad()
def test_repeat_and_select_rows(model):
    ids = random_ids(2, 6)
    cache = model(ids[:, :5]).past_key_values
    assert isinstance(cache, LoopLMCache) and cache.batch_size == 2
    cache.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
    cache.batch_select_indices(torch.tensor([3, 0, 2]))  # rows 1, 0, 1
    rows = torch.tensor([1, 0, 1])
    torch.testing.assert_close(_next_logits(model, ids[rows, 5:6], cache), model(ids[rows]).logits[:, -1],
                               atol=1e-5, rtol=0)


def test_fresh_cache_reports_nothing():
    cache = LoopLMCache()
    assert cache.get_seq_length() == 0 and cache.batch_size == -1 and not cache.is_compileable


@torch.no_grad()
def test_cache_argument_under_either_name(model):
    """transformers >= 5.24 passes the cache as ``cache``; older versions as
    ``past_key_values``: both continue the same decoding, and giving both is refused."""
    from looplm.config_base import ConfigError

    ids = random_ids(2, 6)
    full = model(ids).logits[:, -1]
    for name in ("cache", "past_key_values"):
        cache = model(ids[:, :5]).past_key_values  # a property for ``cache`` on >= 5.24
        torch.testing.assert_close(model(ids[:, 5:6], **{name: cache}).logits[:, -1], full, atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="one of cache or past_key_values"):
        model(ids[:, :1], cache=LoopLMCache(), past_key_values=LoopLMCache())


@torch.no_grad()
def test_static_cache_generates_what_the_growing_one_does(model, request, caplog):
    """LoopLMCache(max_cache_len=N): after the prefill the loop cache sits in buffers for N
    positions, written in place (or stays growing, with the reason logged)."""
    from looplm.cache import StaticLoopCache
    from looplm.hf.export.modeling import _CACHE_FIELD

    ids = random_ids(2, 5)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    grown = model.generate(ids, **kwargs)
    cache = LoopLMCache(max_cache_len=16)
    static = model.generate(ids, **{_CACHE_FIELD: cache}, **kwargs)  # the argument's name in this version
    assert torch.equal(static, grown)
    if "act" in request.node.callspec.id:  # adaptive halting stops early: no static form
        assert not cache.is_compileable and "adaptive halting" in caplog.text
        return
    assert cache.is_compileable and isinstance(cache.loop, StaticLoopCache)
    assert cache.get_max_cache_shape() == 16 and cache.get_seq_length() == 5 + 6 - 1


def test_static_capacity_is_checked():
    with pytest.raises(ValueError, match="max_cache_len=0 is invalid"):
        LoopLMCache(max_cache_len=0)
