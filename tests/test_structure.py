"""The loop's structure object (looplm.structure) against hand-computed values, the model's
modules and the compute a forward reports."""

from __future__ import annotations

import pytest
import torch

from looplm.config_base import ConfigError
from looplm.model import LoopLM
from looplm.modules.block import Block
from looplm.structure import LoopStructure
from tests.conftest import tiny_config

TWO = {"kind": "two", "outer": 2, "inner": 1}  # H·(L + 1) = 4 core passes per macro step

#: (layout, share_core, streams, topology) -> the structure worked out by hand.
CASES = {
    "dense": (
        dict(layout="3", share_core=True, streams=None, topology="base"),
        dict(prelude=3, core=0, coda=0, iterations=0, passes_per_step=1, stacks=0, distinct=3,
             names=("prelude.0", "prelude.1", "prelude.2"),
             paths=("prelude.0", "prelude.1", "prelude.2"),
             labels=("prelude.0", "prelude.1", "prelude.2"),
             block_passes=3),
    ),
    "shared": (
        dict(layout="1+2R3+1", share_core=True, streams=None, topology="base"),
        dict(prelude=1, core=2, coda=1, iterations=3, passes_per_step=1, stacks=1, distinct=4,
             names=("prelude.0", "core.0", "core.1", "coda.0"),
             paths=("prelude.0", "core.0.0", "core.0.1", "coda.0"),
             labels=("prelude.0", "core.0", "core.1", "coda.0"),
             block_passes=1 + 1 + 2 * 3),
    ),
    "unshared": (
        dict(layout="1+2R3+1", share_core=False, streams=None, topology="mesh"),
        dict(prelude=1, core=2, coda=1, iterations=3, passes_per_step=1, stacks=3, distinct=8,
             names=("prelude.0", "core.0", "core.1", "coda.0"),
             paths=("prelude.0", "core.0.0", "core.0.1", "core.1.0", "core.1.1", "core.2.0", "core.2.1", "coda.0"),
             labels=("prelude.0", "core[0].0", "core[0].1", "core[1].0", "core[1].1", "core[2].0", "core[2].1",
                     "coda.0"),
             block_passes=1 + 1 + 2 * 3),
    ),
    "unshared-one-iteration": (
        dict(layout="3R1", share_core=False, streams=None, topology="base"),
        dict(prelude=0, core=3, coda=0, iterations=1, passes_per_step=1, stacks=1, distinct=3,
             names=("core.0", "core.1", "core.2"),
             paths=("core.0.0", "core.0.1", "core.0.2"),
             labels=("core.0", "core.1", "core.2"),
             block_passes=3),
    ),
    "two-streams": (
        dict(layout="2R2", share_core=True, streams=TWO, topology="base"),
        dict(prelude=0, core=2, coda=0, iterations=2, passes_per_step=4, stacks=1, distinct=2,
             names=("core.0", "core.1"),
             paths=("core.0.0", "core.0.1"),
             labels=("core.0", "core.1"),
             block_passes=2 * 2 * 4),
    ),
    "multi-resolution-unshared": (
        dict(layout="2+1x{1,1/2}+1", share_core=False, streams=None, topology="anchor"),
        dict(prelude=2, core=1, coda=1, iterations=2, passes_per_step=1, stacks=2, distinct=5,
             names=("prelude.0", "prelude.1", "core.0", "coda.0"),
             paths=("prelude.0", "prelude.1", "core.0.0", "core.1.0", "coda.0"),
             labels=("prelude.0", "prelude.1", "core[0].0", "core[1].0", "coda.0"),
             block_passes=2 + 1 + 1 * 2),
    ),
}


def _config(layout, share_core, streams, topology):
    extra = {} if streams is None else {"streams": streams}
    return tiny_config(topology, layout=layout, share_core=share_core, **extra)


@pytest.fixture(params=list(CASES), name="case")
def _case(request):
    return CASES[request.param]


def test_structure_matches_the_hand_count(case):
    setup, want = case
    s = _config(**setup).structure
    assert (s.prelude, s.core, s.coda) == (want["prelude"], want["core"], want["coda"])
    assert s.iterations == want["iterations"]
    assert s.shared is setup["share_core"]
    assert s.passes_per_step == want["passes_per_step"]
    assert s.stacks == want["stacks"]
    assert s.distinct_blocks == want["distinct"] == len(want["paths"])
    assert s.names == want["names"]
    assert s.block_paths == want["paths"]
    assert s.block_labels == want["labels"]
    assert s.trained_block_passes == want["block_passes"]


def test_block_passes_is_the_config_total_and_works_per_position(case):
    setup, want = case
    cfg = _config(**setup)
    s = cfg.structure
    assert cfg.block_passes == s.trained_block_passes == s.block_passes(s.iterations)
    assert cfg.passes_per_step == s.passes_per_step
    steps = torch.tensor([[0, 1, 2], [3, 1, 0]])
    per_position = s.block_passes(steps)
    assert per_position.dtype == steps.dtype
    assert per_position.tolist() == [[s.block_passes(int(k)) for k in row] for row in steps.tolist()]
    assert per_position.tolist() == [[want["prelude"] + want["coda"] + want["core"] * want["passes_per_step"] * k
                                      for k in row] for row in steps.tolist()]


def test_paths_and_labels_name_the_model_blocks(case):
    setup, want = case
    model = LoopLM(_config(**setup))
    s = model.cfg.structure
    blocks = [name for name, module in model.named_modules() if isinstance(module, Block)]
    assert blocks == list(s.block_paths)
    assert [model.get_submodule(p) for p in s.block_paths] == model.blocks()
    assert len(s.block_labels) == len(model.blocks())
    for name in s.names:
        assert all(isinstance(model.get_submodule(p), Block) for p in s.paths_of(name))
    assert sorted(p for name in s.names for p in s.paths_of(name)) == sorted(s.block_paths)


def test_forward_reports_the_structure_block_passes_and_runs_blocks_by_their_paths(case):
    """ModelOutput.block_passes is structure.block_passes of the steps run; every block runs
    under a name of the structure, through the module structure.path names (hooks read
    ctx.location, the name the model gave the block)."""
    setup, want = case
    model = LoopLM(_config(**setup))
    s = model.cfg.structure
    ran: list[tuple[str, str, int]] = []
    handles = [model.get_submodule(p).register_forward_pre_hook(
        lambda module, args, p=p: ran.append((p, *args[1].location))) for p in s.block_paths]
    ids = torch.randint(0, 61, (2, 5))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    for handle in handles:
        handle.remove()
    passes = s.passes_per_step
    assert {name for _, name, _ in ran} == set(s.names)
    assert {path for path, _, _ in ran} == set(s.block_paths)  # every stack runs
    for path, name, slot in ran:
        assert path == s.path(name, slot // passes)  # slot t·passes + i runs iteration t
    assert {block for block, _ in out.attentions} <= set(s.names)
    if s.is_looped:
        assert torch.equal(out.block_passes, torch.full((2, 5), s.trained_block_passes))
        assert torch.equal(out.block_passes, s.block_passes(out.halt_steps))
    else:
        assert out.block_passes is None


def test_block_passes_follow_halted_steps():
    """Under adaptive halting each position's passes are structure.block_passes of its own
    halt step."""
    torch.manual_seed(0)
    model = LoopLM(tiny_config("base", layout="1+1R4+1", halting={"kind": "act", "full_compute": False}))
    with torch.no_grad():
        out = model(torch.randint(0, 61, (2, 6)))
    assert torch.equal(out.block_passes, model.cfg.structure.block_passes(out.halt_steps))
    assert torch.equal(out.block_passes, 2 + out.halt_steps)


def test_the_head_loop_excludes_distinct_blocks_of_the_structure():
    """``model.head_loop.exclude`` indexes the distinct blocks of 1+2R2+1: 6 unshared, 4 shared."""
    tiny_config("mesh", share_core=False, head_loop={"exclude": [5]})
    with pytest.raises(ConfigError, match=r"model\.head_loop\.exclude.*below 6"):
        tiny_config("mesh", share_core=False, head_loop={"exclude": [6]})
    with pytest.raises(ConfigError, match=r"model\.head_loop\.exclude.*below 4"):
        tiny_config("mesh", head_loop={"exclude": [4]})


@pytest.mark.parametrize("fields, field", [
    (dict(prelude=-1, core=1, coda=0, iterations=1, shared=True, passes_per_step=1), "structure.prelude"),
    (dict(prelude=0, core=1, coda=0, iterations=0, shared=True, passes_per_step=1), "structure.iterations"),
    (dict(prelude=1, core=0, coda=0, iterations=2, shared=True, passes_per_step=1), "structure.iterations"),
    (dict(prelude=0, core=1, coda=0, iterations=1, shared=True, passes_per_step=0), "structure.passes_per_step"),
])
def test_bad_structures_are_refused_by_field(fields, field):
    with pytest.raises(ConfigError, match=rf"^{field}="):
        LoopStructure(**fields)


def test_the_stack_of_an_iteration():
    shared, unshared = tiny_config("base").structure, tiny_config("mesh", share_core=False).structure
    assert [shared.path("core.1", t) for t in range(2)] == ["core.0.1", "core.0.1"]
    assert [unshared.path("core.1", t) for t in range(2)] == ["core.0.1", "core.1.1"]
    assert unshared.path("coda.0", 1) == unshared.path("coda.0", 0) == "coda.0"
    assert unshared.paths_of("core.0") == ("core.0.0", "core.1.0") and unshared.paths_of("prelude.0") == ("prelude.0",)


def test_unknown_parts_and_names_are_refused():
    s = tiny_config("base").structure  # 1+2R2+1
    with pytest.raises(ConfigError, match=r"part='middle'.*prelude, core, coda"):
        s.names_of("middle")
    for bad in ("core.2", "coda", "core.x", "loop.0"):
        with pytest.raises(ValueError, match="prelude.0, core.0, core.1, coda.0"):
            s.paths_of(bad)
