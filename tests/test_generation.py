"""generate(): cache decoding equals naive full forwards; left-padded batches equal single
prompts; stop tokens; sampling filters; test-time iterations; argument validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from looplm import LoopCache, LoopLM
from looplm.generation import GenerationOutput, generate, left_pad, next_token, top_k_filter, top_p_filter
from tests.conftest import random_ids, tiny_config

V = 50
# (layout, topology kind): looped models with several topologies, and a dense stack.
MODELS = [
    ("1+2R2+1", "base"),
    ("1+2R2+1", "residual"),
    ("1+2R2+1", "anchor"),
    ("1+2R2+1", "gated_residual"),
    ("1+2R2+1", "mesh"),
    ("3", "base"),
]
PROMPTS = [[3, 14, 15, 9, 26, 5, 35], [8, 9], [7, 9, 32, 38, 4], [46]]


def make_model(layout: str = "1+2R2+1", kind: str = "base", seed: int = 0) -> LoopLM:
    torch.manual_seed(seed)
    # init_std 0.2 (not 0.02) so random-init logits are far from ties and greedy paths vary.
    return LoopLM(tiny_config(kind, layout=layout, vocab_size=V, max_seq_len=64, init_std=0.2)).eval()


def naive_greedy(model: LoopLM, prompt: list[int], n: int, iterations=None) -> list[int]:
    """Re-run the whole sequence without a cache each step; argmax of the last logits."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq]), iterations=iterations).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("layout,kind", MODELS)
def test_greedy_equals_naive_full_forward_loop(layout, kind):
    model = make_model(layout, kind)
    prompt = PROMPTS[0]
    out = generate(model, torch.tensor([prompt]), max_new_tokens=12, temperature=0)
    expected = naive_greedy(model, prompt, 12)
    assert out.new_tokens == [expected]
    assert out.sequences.tolist() == [prompt + expected]
    assert out.finished.tolist() == [False]
    assert len(set(expected)) > 1  # the check would be weak if the model repeated one token


@pytest.mark.parametrize("layout,kind", MODELS)
def test_left_padded_batch_equals_each_prompt_alone(layout, kind):
    model = make_model(layout, kind, seed=1)
    out = generate(model, PROMPTS, max_new_tokens=9, do_sample=False)
    width = max(map(len, PROMPTS))
    assert out.sequences.shape == (len(PROMPTS), width + 9)
    for row, prompt in enumerate(PROMPTS):
        alone = generate(model, torch.tensor([prompt]), max_new_tokens=9, do_sample=False)
        assert out.new_tokens[row] == alone.new_tokens[0]
        pad = width - len(prompt)
        assert out.sequences[row, :pad].tolist() == [0] * pad
        assert out.sequences[row, pad:width].tolist() == prompt


@pytest.mark.parametrize("layout,kind", MODELS)
def test_padded_prefill_logits_equal_unpadded(layout, kind):
    model = make_model(layout, kind, seed=2)
    ids, mask = left_pad(PROMPTS, pad_token_id=5)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, cache=LoopCache()).logits
        for row, prompt in enumerate(PROMPTS):
            alone = model(torch.tensor([prompt]), cache=LoopCache()).logits[0]
            torch.testing.assert_close(batch[row, ids.shape[1] - len(prompt):], alone, atol=1e-5, rtol=1e-5)


def test_tensor_with_mask_equals_list_input():
    model = make_model()
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    from_lists = generate(model, PROMPTS, max_new_tokens=6, temperature=0)
    from_tensor = generate(model, ids, attention_mask=mask.bool(), max_new_tokens=6, temperature=0)
    assert torch.equal(from_lists.sequences, from_tensor.sequences)
    assert from_lists.new_tokens == from_tensor.new_tokens


def test_stop_token_ends_row_and_pads_after():
    model = make_model(seed=3)
    free = generate(model, PROMPTS, max_new_tokens=8, temperature=0)
    stop = free.new_tokens[1][0]  # row 1's first greedy token
    out = generate(model, PROMPTS, max_new_tokens=8, temperature=0, stop_tokens=[stop], pad_token_id=49)
    width = max(map(len, PROMPTS))
    assert out.new_tokens[1] == [stop]
    assert out.finished[1]
    assert out.sequences[1, width:].tolist() == [stop] + [49] * (out.sequences.shape[1] - width - 1)
    for row in range(len(PROMPTS)):
        tokens = free.new_tokens[row]
        cut = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert out.new_tokens[row] == tokens[:cut]  # up to and including the stop token
        assert bool(out.finished[row]) == (stop in tokens)


def test_loop_ends_early_when_every_row_has_stopped():
    model = make_model(seed=3)
    free = generate(model, PROMPTS, max_new_tokens=8, temperature=0)
    stops = {tokens[0] for tokens in free.new_tokens}
    out = generate(model, PROMPTS, max_new_tokens=8, temperature=0, stop_tokens=stops)
    assert out.finished.all()
    assert out.sequences.shape[1] == max(map(len, PROMPTS)) + 1
    assert out.new_tokens == [[tokens[0]] for tokens in free.new_tokens]


def test_zero_new_tokens_returns_prompt():
    model = make_model()
    out = generate(model, PROMPTS, max_new_tokens=0)
    ids, _ = left_pad(PROMPTS, 0)
    assert isinstance(out, GenerationOutput)
    assert torch.equal(out.sequences, ids)
    assert out.new_tokens == [[] for _ in PROMPTS] and not out.finished.any()


def test_top_k_1_sampling_equals_greedy():
    model = make_model(seed=4)
    greedy = generate(model, PROMPTS, max_new_tokens=8, temperature=0)
    sampled = generate(model, PROMPTS, max_new_tokens=8, temperature=1.7, top_k=1,
                       generator=torch.Generator().manual_seed(0))
    assert sampled.new_tokens == greedy.new_tokens


def test_seeded_sampling_is_reproducible_and_actually_samples():
    model = make_model(seed=5)
    runs = [generate(model, PROMPTS, max_new_tokens=10, temperature=1.5, top_p=0.95,
                     generator=torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert not torch.equal(runs[0].sequences, runs[2].sequences)


def test_do_sample_rule():
    model = make_model(seed=6)
    greedy = generate(model, PROMPTS, max_new_tokens=8, temperature=0)
    # do_sample=False is greedy whatever the temperature; do_sample=True at temperature 0 too.
    assert generate(model, PROMPTS, max_new_tokens=8, temperature=1.3, do_sample=False).new_tokens == greedy.new_tokens
    assert generate(model, PROMPTS, max_new_tokens=8, temperature=0, do_sample=True).new_tokens == greedy.new_tokens
    # The default (do_sample=None, temperature=1) samples.
    draws = {tuple(generate(model, PROMPTS, max_new_tokens=8, generator=torch.Generator().manual_seed(s)).sequences.flatten().tolist())
             for s in range(3)}
    assert len(draws) > 1


def test_top_p_keeps_exactly_the_nucleus():
    probs = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])
    logits = probs.log()
    kept = lambda p: set(torch.isfinite(top_p_filter(logits, p))[0].nonzero().flatten().tolist())  # noqa: E731
    assert kept(0.3) == {1}  # the top token alone already covers 0.3
    assert kept(0.4) == {1}
    assert kept(0.5) == {1, 3}  # 0.4 < 0.5 <= 0.7
    assert kept(0.7) == {1, 3}
    assert kept(0.75) == {1, 3, 4}
    assert kept(0.9) == {1, 3, 4, 2}
    assert kept(0.96) == {0, 1, 2, 3, 4}
    assert kept(1.0) == {0, 1, 2, 3, 4}
    assert kept(1e-6) == {1}  # the most probable token always stays
    # Kept logits are unchanged.
    filtered = top_p_filter(logits, 0.5)
    assert torch.equal(filtered[0, [1, 3]], logits[0, [1, 3]])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-40, 40), min_size=2, max_size=12, unique=True), st.floats(0.01, 0.99))
def test_top_p_kept_set_is_smallest_prefix_reaching_p(values, p):
    logits = torch.tensor([values], dtype=torch.float64) / 8  # distinct: no ties in the ranking
    probs = logits.softmax(-1)[0]
    keep = torch.isfinite(top_p_filter(logits, p))[0]
    order = probs.argsort(descending=True, stable=True)
    n = int(keep.sum())
    assert keep[order[:n]].all()  # a prefix of the ranking
    mass = probs[keep].sum()
    assert mass >= p - 1e-12 or n == len(values)
    assert n == 1 or probs[keep].sum() - probs[keep].min() < p + 1e-12  # no smaller set reaches p


def test_top_k_filter_and_temperature_order():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    assert torch.isfinite(top_k_filter(logits, 2)).tolist() == [[False, True, True, False, False]]
    assert torch.isfinite(top_k_filter(logits, 99)).all()
    # Temperature before top-p: a high temperature flattens the distribution, so the nucleus grows.
    g = torch.Generator().manual_seed(0)
    cold = {int(next_token(logits, sample=True, temperature=0.1, top_p=0.9, generator=g)) for _ in range(50)}
    hot = {int(next_token(logits, sample=True, temperature=10.0, top_p=0.9, generator=g)) for _ in range(200)}
    assert cold == {1}
    assert len(hot) >= 4


def test_test_time_iterations_match_naive_loop():
    model = make_model("1+2R2+1", "base", seed=1)
    out = generate(model, PROMPTS, max_new_tokens=10, temperature=0, iterations=3)
    assert out.new_tokens == [naive_greedy(model, prompt, 10, iterations=3) for prompt in PROMPTS]
    trained = generate(model, PROMPTS, max_new_tokens=10, temperature=0).new_tokens
    assert out.new_tokens != trained  # the loop count really changed the computation


def test_mesh_refuses_untrained_iteration_count():
    model = make_model("1+2R2+1", "mesh")
    with pytest.raises(ValueError, match=r"iterations=3 .*mesh"):
        generate(model, PROMPTS, max_new_tokens=4, iterations=3)


def test_restores_training_flag_and_builds_no_graph():
    model = make_model()
    model.train()
    out = generate(model, PROMPTS, max_new_tokens=3, temperature=0)
    assert model.training
    assert not out.sequences.requires_grad
    model.eval()
    assert generate(model, PROMPTS, max_new_tokens=3, temperature=0).new_tokens == out.new_tokens  # ran in eval
    assert not model.training
    assert model.generate(PROMPTS, max_new_tokens=3, temperature=0).new_tokens == out.new_tokens


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=-1), r"max_new_tokens=-1 .*>= 0"),
        (dict(max_new_tokens=2.5), r"max_new_tokens=2.5"),
        (dict(temperature=-0.5), r"temperature=-0.5 .*>= 0"),
        (dict(temperature=math.nan), r"temperature=nan"),
        (dict(top_k=0), r"top_k=0 .*>= 1"),
        (dict(top_p=0.0), r"top_p=0.0 .*\(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5"),
        (dict(do_sample="yes"), r"do_sample='yes'"),
        (dict(pad_token_id=V), rf"pad_token_id={V} .*\[0, {V}\)"),
        (dict(stop_tokens=[V + 3]), r"stop_tokens=\[53\]"),
        (dict(stop_tokens="x"), r"stop_tokens='x'"),
        (dict(max_new_tokens=60), r"max_new_tokens=60 .*at most 57.*longest prompt has 7.*max_seq_len=64"),
        (dict(attention_mask=torch.ones(4, 7)), r"attention_mask=.*None when input_ids is a list"),
    ],
)
def test_invalid_arguments(kwargs, match):
    model = make_model()
    with pytest.raises(ValueError, match=match):
        generate(model, PROMPTS, **kwargs)


@pytest.mark.parametrize(
    "input_ids,mask,match",
    [
        ([], None, r"input_ids=\[\] .*non-empty list"),
        ([[1, 2], []], None, r"input_ids\[1\]=\[\] .*non-empty prompt"),
        ([[1, 2], [3, "a"]], None, r"input_ids\[1\]="),
        ([[1, V]], None, rf"input_ids=.*contains {V}.*\[0, {V}\)"),
        (torch.zeros(3, dtype=torch.long), None, r"input_ids=.*shape \(3,\).*\[B, T\]"),
        (torch.zeros(2, 0, dtype=torch.long), None, r"input_ids=.*non-empty prompt"),
        (torch.zeros(2, 3), None, r"input_ids=.*integer tensor"),
        (torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]]), r"attention_mask=.*row 0.*right padding"),
        (torch.ones(2, 3, dtype=torch.long), torch.tensor([[0, 0, 0], [1, 1, 1]]), r"attention_mask=.*row 0 all zeros.*empty prompts"),
        (torch.ones(2, 3, dtype=torch.long), torch.tensor([[0, 2, 1], [1, 1, 1]]), r"attention_mask=.*0 \(left padding\) and 1"),
        (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4), r"attention_mask=.*shape \(2, 3\)"),
    ],
)
def test_invalid_inputs(input_ids, mask, match):
    model = make_model()
    with pytest.raises(ValueError, match=match):
        generate(model, input_ids, attention_mask=mask, max_new_tokens=2)


def test_logits_to_keep_computes_the_last_positions_only():
    """A generation prefill asks for the last position's logits: the same numbers."""
    from looplm.config_base import ConfigError

    model = LoopLM(tiny_config("mesh")).eval()
    x = random_ids(2, 9)
    full = model(x).logits
    torch.testing.assert_close(model(x, logits_to_keep=3).logits, full[:, -3:], atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match="logits_to_keep"):
        model(x, x, logits_to_keep=1)
