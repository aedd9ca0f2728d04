"""Algorithm 1 on scripted entropies: deep-to-shallow order, K_max, L, freezing, exclusions,
the shallow-to-deep ablation, Block Loop, fade-out and the state round trip."""

from __future__ import annotations

from looplm.head_loop.config import HeadLoopConfig
from looplm.head_loop.schedule import GrowthSchedule

N_LAYERS, N_HEADS = 8, 4


def entropies(order: list[int]) -> dict[int, list[float]]:
    """Layer ``order[0]`` has the highest mean entropy, then order[1], ...; head i of every
    layer has entropy base + 0.01·i except head 1, the highest."""
    values = {}
    for layer in range(N_LAYERS):
        base = 0.9 - 0.1 * order.index(layer) if layer in order else 0.05
        values[layer] = [base + 0.01 * i for i in range(N_HEADS)]
        values[layer][1] = base + 0.05
    return values


def run(cfg: HeadLoopConfig, script, steps: int, eligible=None):
    sched = GrowthSchedule(cfg, N_HEADS, range(N_LAYERS) if eligible is None else eligible)
    events = []
    for t in range(1, steps + 1):
        sched.observe(script(t))
        events += sched.advance(t)
    return sched, [e for e in events if e["action"] != "hold"]


def test_deep_to_shallow_growth_to_k_max_then_freeze():
    cfg = HeadLoopConfig(heads=2, max_depth=2, layers=3, start=5, interval=5, ema_decay=0.0, exclude=(0,))
    sched, events = run(cfg, lambda t: entropies([6, 3, 5, 0, 1]), 60, eligible=range(1, N_LAYERS))
    acts = [(e["step"], e["action"], e["layer"], e["depth"]) for e in events if e["action"] != "drop"]
    # pool = {6, 3, 5}: deepest first (6), deepened to K_max = 2, then 5, then 3; then frozen
    assert acts == [(5, "activate", 6, 1), (10, "deepen", 6, 2), (15, "activate", 5, 1), (20, "deepen", 5, 2),
                    (25, "activate", 3, 1), (30, "deepen", 3, 2), (30, "freeze", 3, 2)]
    assert sched.frozen and sched.active == [6, 5, 3] and sched.depth == {6: 2, 5: 2, 3: 2}
    assert sched.heads[6] == [1, 3]  # top-h = 2 by head entropy (Eq. 7)
    assert sched.structure(60) == {l: (2, [0.0, 1.0, 0.0, 1.0]) for l in (6, 5, 3)}


def test_excluded_first_layer_never_grows_and_growth_stops_at_the_front():
    cfg = HeadLoopConfig(heads=1, max_depth=1, layers=3, start=2, interval=2, ema_decay=0.0)
    # layer 0 has the highest entropy (App. C.4) but is excluded: the pool is {4, 2, 7}
    sched, events = run(cfg, lambda t: entropies([0, 4, 2, 7]), 20, eligible=range(1, N_LAYERS))
    assert 0 not in sched.active
    # 7 first (deepest), then 4, then 2: always the deepest candidate shallower than all active
    assert sched.active == [7, 4, 2] and sched.frozen


def test_growing_layer_leaving_the_pool_stops_deepening_and_shallower_only():
    cfg = HeadLoopConfig(heads=2, max_depth=3, layers=2, start=1, interval=1, ema_decay=0.0)
    script = lambda t: entropies([5, 2]) if t < 2 else entropies([2, 6])  # noqa: E731
    sched, events = run(cfg, script, 6)
    # t=1 activates 5; t=2: 5 left the pool, 6 is deeper than 5 so not eligible, 2 is
    assert [(e["action"], e["layer"]) for e in events if e["action"] != "drop"][:2] == [("activate", 5), ("activate", 2)]
    assert sched.depth[5] == 1 and sched.depth[2] == 3 and sched.frozen


def test_shallow_to_deep_variant():
    cfg = HeadLoopConfig(heads=2, max_depth=1, layers=3, start=1, interval=1, ema_decay=0.0,
                         direction="shallow_to_deep", exclude=())
    sched, _ = run(cfg, lambda t: entropies([6, 3, 5]), 10)
    assert sched.active == [3, 5, 6]


def test_block_loop_takes_top_l_at_t_start_and_freezes():
    cfg = HeadLoopConfig(kind="block", max_depth=1, layers=3, start=4, interval=4, ema_decay=0.0)
    sched, events = run(cfg, lambda t: entropies([6, 3, 5, 1]), 12)
    assert sorted(sched.active) == [3, 5, 6] and sched.frozen
    assert {e["step"] for e in events} == {4}
    assert sched.structure(12)[3] == (1, [1.0] * N_HEADS)


def test_fade_out_then_drop_and_low_entropy_selection():
    cfg = HeadLoopConfig(heads=1, select="low", max_depth=1, layers=1, start=2, interval=2, fade=4, ema_decay=0.0)
    sched, events = run(cfg, lambda t: entropies([3]), 10)
    assert sched.heads[3] == [0]  # the lowest-entropy head
    assert sched.weights(3, 2) == [1.0, 1.0, 1.0, 1.0]  # every head loops on activation
    assert sched.weights(3, 4) == [1.0, 0.5, 0.5, 0.5]
    assert sched.weights(3, 6) == [1.0, 0.0, 0.0, 0.0]  # dropped
    assert [(e["step"], e["action"]) for e in events] == [(2, "activate"), (2, "freeze"), (6, "drop")]


def test_ema_and_state_round_trip():
    cfg = HeadLoopConfig(heads=2, max_depth=2, layers=3, start=3, interval=3, ema_decay=0.5)
    a = GrowthSchedule(cfg, N_HEADS, range(1, N_LAYERS))
    a.observe({1: [1.0, 0, 0, 0]})
    a.observe({1: [0.0, 0, 0, 0]})
    assert a.ema[1][0] == 0.5
    for t in range(1, 8):
        a.observe(entropies([4, 2, 6]))
        a.advance(t)
    b = GrowthSchedule(cfg, N_HEADS, range(1, N_LAYERS))
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    for t in range(8, 30):
        for s in (a, b):
            s.observe(entropies([4, 6, 2]))
        assert a.advance(t) == b.advance(t)
    assert a.state_dict() == b.state_dict()
