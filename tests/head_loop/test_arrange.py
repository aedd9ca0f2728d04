"""Arranged heads (HeadLoopBlock.arrange_heads): permuting a grown block's heads so the
looping ones come first is a re-parameterisation. The model computes the same logits and
gradients (to float rounding), AdamW continues exactly, heads are reported in the original
numbering, the order is saved with the weights, and the arranged passes read narrow views:
no gathers, no index building, no host syncs."""

from __future__ import annotations

import copy

import pytest
import torch

from looplm import LoopLM
from looplm.accounting.dispatch import count_dispatch
from looplm.head_loop.attention import permute_heads
from looplm.head_loop.block import grown_structure
from looplm.head_loop.entropy import EntropyMeter
from looplm.model_config import ModelConfig
from looplm.probes.capture import capture_forward

VARIANTS = {
    "mha": {},
    "mha_no_bias_rms": {"norm": "rmsnorm", "bias": False, "mlp": "swiglu"},
    "gqa_gate_bias": {"n_kv_heads": 2, "mixer": {"kind": "attention", "output_gate": True}},
    "gqa_4_groups": {"n_heads": 8, "n_kv_heads": 4},
    "window": {"mixer": {"kind": "sliding_window", "window": 3}, "norm": "rmsnorm", "bias": False},
    "loop_level_hybrid": {"layout": "1+1R2+1", "loop_mixers": [{"kind": "attention"}, {"kind": "sliding_window",
                                                                                       "window": 4}]},
}
#: {block: (K_l, S in the original numbering, the other heads' weight)} as growth leaves
#: them: S not the first heads; block 1 mid-fade (every head loops), block 2 after the drop
GROWN = {1: (2, [0, 3], 0.5), 2: (1, [1, 3], 0.0)}


def _model(variant: str) -> LoopLM:
    kw = {"n_heads": 4, "layout": "1+2R2+1", **VARIANTS[variant]}
    torch.manual_seed(0)
    model = LoopLM(ModelConfig(vocab_size=40, d_model=32, head_loop={"kind": "heads"}, **kw))
    n = model.cfg.n_heads
    for layer, (depth, first, rest) in GROWN.items():
        model.blocks()[layer].head_loop.set(depth, [1.0 if h in first else rest for h in range(n)])
    return model


def _arranged(model: LoopLM, optimizer=None) -> LoopLM:
    for layer, (_, first, _) in GROWN.items():
        assert model.blocks()[layer].arrange_heads(first, optimizer)
    return model


def _restore(block, optimizer=None) -> None:
    """Put an arranged block's heads back in the original order."""
    slot = {h: p for p, h in enumerate(block.head_loop.order)}
    for layer in block.softmax_layers():
        permute_heads(layer, [slot[h] for h in range(len(slot))], optimizer)
    block.head_loop.set_order(range(len(slot)))


def _original_grads(model: LoopLM) -> dict[str, torch.Tensor]:
    """Parameter gradients with every arranged block's heads put back in the original order."""
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    for layer, block in enumerate(model.blocks()):
        loop = getattr(block, "head_loop", None)
        if loop is None or loop.order == tuple(sorted(loop.order)):
            continue
        prefix = next(name for name, b in model.named_modules() if b is block)
        back = copy.deepcopy(block)
        for name, p in back.named_parameters():
            p.grad = grads.get(f"{prefix}.{name}")
        _restore(back)
        for name, p in back.named_parameters():
            if p.grad is not None:
                grads[f"{prefix}.{name}"] = p.grad
    return grads


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_arranged_model_computes_the_same_logits_and_gradients(variant):
    plain, arranged = _model(variant), _arranged(_model(variant))
    assert all(arranged.blocks()[l].head_loop.narrow for l in GROWN)
    assert not all(plain.blocks()[l].head_loop.narrow for l in GROWN)  # the unarranged passes gather
    x = torch.randint(0, 40, (2, 11))
    out = [m(x[:, :-1], x[:, 1:]) for m in (plain, arranged)]
    torch.testing.assert_close(out[1].logits, out[0].logits, atol=1e-5, rtol=1e-5)
    for o in out:
        o.loss.backward()
    expected = {name: p.grad for name, p in plain.named_parameters() if p.grad is not None}
    got = _original_grads(arranged)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)
    assert grown_structure(arranged) == grown_structure(plain)  # reported in the original numbering


@pytest.mark.parametrize("variant", ["mha", "gqa_gate_bias"])
def test_probes_and_entropy_keep_the_original_head_numbering(variant):
    plain, arranged = _model(variant), _arranged(_model(variant))
    x = torch.randint(0, 40, (2, 9))
    probs = [m.eval()(x, output_attentions=True).attentions for m in (plain, arranged)]
    assert probs[0].keys() == probs[1].keys()
    for key in probs[0]:
        torch.testing.assert_close(probs[1][key], probs[0][key], atol=1e-6, rtol=1e-5, msg=str(key))
    captured = [capture_forward(m, x, attentions=True, values=True) for m in (plain, arranged)]
    assert captured[0].values.keys() == captured[1].values.keys()
    for key, values in captured[0].values.items():  # the attention_contribution probe's V_j
        torch.testing.assert_close(captured[1].values[key], values, atol=1e-6, rtol=1e-5, msg=str(key))
    measured = []
    for model in (plain, arranged):
        meter = EntropyMeter(model.blocks(), list(GROWN), model.cfg.n_heads, torch.device("cpu"))
        model.train()(x)
        measured.append(meter.read())
        meter.detach()
    for layer in GROWN:
        torch.testing.assert_close(torch.tensor(measured[1][layer]), torch.tensor(measured[0][layer]),
                                   atol=1e-6, rtol=1e-5)


def test_adamw_continues_exactly_across_an_arrangement():
    """Train 3 steps, arrange (moving AdamW's state), train 3 more: the losses and the
    weights (back in the original order) equal those of the run that never arranged."""
    x = torch.randint(0, 40, (4, 13))
    runs = []
    for arrange in (False, True):
        model = _model("gqa_gate_bias")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(6):
            if arrange and step == 3:
                _arranged(model, opt)
            loss = model(x[:, :-1], x[:, 1:]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # zero gradients are kept: they move with the weights too
            losses.append(loss.item())
        if arrange:
            for layer in GROWN:
                _restore(model.blocks()[layer], opt)
        runs.append((losses, model.state_dict()))
    torch.testing.assert_close(torch.tensor(runs[1][0]), torch.tensor(runs[0][0]), atol=1e-5, rtol=1e-5)
    for name, value in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_order_is_saved_with_the_weights_and_old_structures_load(tmp_path):
    model = _arranged(_model("mha"))
    model.save_pretrained(tmp_path)
    loaded = LoopLM.from_pretrained(tmp_path).eval()
    assert loaded.blocks()[2].head_loop.order == (1, 3, 0, 2) and loaded.blocks()[2].head_loop.narrow
    x = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(loaded(x).logits, model.eval()(x).logits, atol=0, rtol=0)
    old = _model("mha").blocks()[1].head_loop
    old.set_extra_state(torch.tensor([2.0, 1.0, 0.0, 0.5, 1.0]))  # [K, w]: written before the order was saved
    assert old.order == (0, 1, 2, 3) and old.describe()["weights"] == [1.0, 0.0, 0.5, 1.0]


def test_head_order_must_keep_kv_groups_together():
    loop = _model("gqa_gate_bias").blocks()[1].head_loop
    with pytest.raises(ValueError, match="key/value groups"):
        loop.set_order([0, 2, 1, 3])  # heads 0, 1 read kv head 0: they must share a slot pair
    with pytest.raises(ValueError, match="permutation"):
        loop.set_order([0, 0, 2, 3])
    loop.set_order([2, 3, 1, 0])
    block = _model("mha").blocks()[2]
    assert not block.arrange_heads([1, 2]) and block.head_loop.order == (0, 1, 2, 3)  # already consecutive


def test_arranged_passes_gather_nothing_and_sync_nothing():
    """One training forward + backward of the arranged model: no indexing operators at all
    (the unarranged one gathers its heads' rows), no host syncs."""
    gathers = {"aten.index", "aten.index_select", "aten.index_put", "aten.index_add", "aten.gather"}
    x = torch.randint(0, 40, (2, 11))
    counts = {}
    for name, model in (("plain", _model("mha")), ("arranged", _arranged(_model("mha")))):
        model(x[:, :-1], x[:, 1:]).loss.backward()  # warm: nothing built lazily is counted
        model.zero_grad(set_to_none=True)
        counts[name], _ = count_dispatch(lambda: model(x[:, :-1], x[:, 1:]).loss.backward())
    used = {op: n for op, n in counts["arranged"].by_op.items() if op in gathers}
    assert counts["arranged"].syncs == 0 and not used, f"{used}; {counts['arranged'].by_op}"
    assert counts["arranged"].by_op["aten.arange"] <= 1, counts["arranged"].by_op  # the position ids only
    assert counts["plain"].by_op["aten.index_select"] > 0
    assert counts["arranged"].ops < counts["plain"].ops


def test_setting_the_structure_writes_only_what_changed():
    """The trainer writes the structure after every step: unchanged, no device write; a
    fading head's new weight rewrites its scale only."""
    loop = _model("mha").blocks()[1].head_loop
    loop.set(2, [1.0, 0.5, 0.5, 1.0])
    unchanged, _ = count_dispatch(lambda: loop.set(2, [1.0, 0.5, 0.5, 1.0]))
    faded, _ = count_dispatch(lambda: loop.set(2, [1.0, 0.25, 0.25, 1.0]))
    assert unchanged.ops == 0 and faded.by_op["aten.copy_"] == 1, (unchanged.by_op, faded.by_op)
    assert loop.pass_scale[: 4 * 8].tolist() == [1.0] * 8 + [0.25] * 16 + [1.0] * 8
