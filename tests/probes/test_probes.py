"""Probes on real models: what they read through hooks agrees with the model, the logit
lens's last readout is the model's own loss, and every probe runs end to end through the
CLI on a tiny trained run and writes its files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from looplm.cli import main
from looplm.model import LoopLM
from looplm.probes import PROBES, ProbeError, ProbeInput, capture_forward, get_probe, run_probes
from looplm.probes.mesh import composition_coefficients
from tests.conftest import random_ids, tiny_config

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _model(topology: str = "mesh", **overrides) -> LoopLM:
    torch.manual_seed(0)
    return LoopLM(tiny_config(topology, **overrides)).eval()


def _input(model: LoopLM, tmp_path: Path, batches: int = 2) -> ProbeInput:
    ids = [random_ids(3, 17, seed=s) for s in range(batches)]
    return ProbeInput(model, None, tmp_path, [(x[:, :-1], x[:, 1:]) for x in ids])


def test_block_hooks_follow_the_unrolled_computation():
    model = _model("residual", layout="1+2R3+1")
    cap = capture_forward(model, random_ids(2, 9), states=True, blocks=True)
    order = [c.location for c in cap.blocks]
    assert order == [("prelude.0", 0), *[(f"core.{j}", t) for t in range(3) for j in range(2)], ("coda.0", 0)]
    # residual topology: h^(t+1) = f_core(h^(t)) + h^(t), f_core's output is the last core block's
    for t in range(3):
        update = cap.block_outputs(("core.1", t))
        assert torch.allclose(cap.output.states[t + 1], update + cap.output.states[t], atol=1e-6)
    assert torch.allclose(cap.blocks[0].input, cap.h_emb)  # the model's own embeddings
    assert torch.allclose(model.head(model.norm(cap.h_out)), cap.output.logits, atol=1e-6)


def test_value_hook_reproduces_the_attention_output():
    """attn @ V from the captured probabilities and values equals the mixer's output before W_O."""
    model = _model("anchor", n_kv_heads=2)
    layer = model.core[0][0].attn
    seen = {}
    handle = layer.o_proj.register_forward_hook(lambda m, a, o: seen.setdefault("y", a[0]))
    try:
        cap = capture_forward(model, random_ids(2, 7), attentions=True, values=True)
    finally:
        handle.remove()
    attn, v = cap.output.attentions[("core.0", 0)], cap.values[("core.0", 0)]
    assert v.shape == (2, 4, 7, 8)  # grouped-query heads repeated to H
    y = (attn @ v).transpose(1, 2).reshape(2, 7, -1)
    assert torch.allclose(y, seen["y"], atol=1e-5)


def test_mesh_composition_coefficients_rebuild_the_loop_states():
    """Eq. (7): h^(k) = α_emb h_emb + Σ_i α_i h_m^(i) with α from the routers."""
    model = _model("mesh", layout="1+1R3+1")
    with torch.no_grad():  # random routers: make them far from uniform
        for layer in [*model.topology.write, *model.topology.read]:
            layer.weight.normal_(0, 0.5)
    cap = capture_forward(model, random_ids(2, 11), states=True, blocks=True)
    rec = cap.output.record
    coeffs = composition_coefficients(rec["write"], rec["read"])
    h_m = {-1: cap.block_outputs(("prelude.0", 0)), **{t: cap.block_outputs(("core.0", t)) for t in range(3)}}
    for k, state in enumerate(cap.output.states):
        rebuilt = coeffs[k]["h_emb"][..., None] * cap.h_emb
        rebuilt = rebuilt + sum(coeffs[k][f"h_m^({i})"][..., None] * h_m[i] for i in range(-1, k))
        assert torch.allclose(rebuilt, state, atol=1e-5), k


def test_logit_lens_at_the_last_iteration_is_the_models_own_loss(tmp_path):
    model = _model("mesh")
    probe = _input(model, tmp_path)
    numbers = get_probe("logit_lens").run(probe).numbers
    with torch.no_grad():
        total = sum(float(model(x, y).lm_loss) * y.numel() for x, y in probe.batches) / sum(y.numel() for _, y in probe.batches)
    assert numbers["coda"]["loss"][-1] == pytest.approx(total, rel=1e-5)
    assert numbers["model"]["loss"] == pytest.approx(total, rel=1e-5)
    assert len(numbers["coda"]["loss"]) == model.cfg.iterations + 1


def test_combination_coefficients_are_reported(tmp_path):
    numbers = get_probe("routers").run(_input(_model("static_combination"), tmp_path)).numbers
    assert numbers["combination"]["alpha_mean"][0] == pytest.approx([1, 1 / 3, 1 / 3, 1 / 3])


def test_loop_probes_refuse_a_dense_model(tmp_path):
    with pytest.raises(ProbeError, match="needs a looped model"):
        get_probe("cka").run(_input(_model("base", layout="3"), tmp_path))


def test_attention_probes_refuse_models_without_softmax(tmp_path):
    with pytest.raises(ProbeError, match="no softmax attention"):
        get_probe("head_entropy").run(_input(_model("anchor", mixer={"kind": "gated_deltanet"}), tmp_path))


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """tiny-mesh, shrunk, trained 4 steps with two checkpoints (for entropy_dynamics)."""
    from looplm import Trainer, load_config

    run = tmp_path_factory.mktemp("probe-run") / "run"
    cfg = load_config("tiny-mesh", [
        f"train.out_dir={run}", "train.max_steps=4", "train.save_every=2", "train.eval_every=2",
        "train.sample_tokens=0", "train.batch_size=4", "model.d_model=32", "data.seq_len=40", "data.val_batches=2",
    ])
    Trainer(cfg, progress=False).fit()
    return run


def test_every_probe_runs_through_the_cli_and_writes_its_files(trained_run, tmp_path):
    out = tmp_path / "probes"
    figures = [] if HAS_MATPLOTLIB else ["--no-figures"]
    assert main(["probe", str(trained_run), "--samples", "6", "--batch-size", "4", "--out", str(out), *figures]) == 0
    assert not (out / "halting.json").exists()  # tiny-mesh has no halting rule: nothing to chart
    for name in (n for n in PROBES if n != "halting"):
        payload = json.loads((out / f"{name}.json").read_text())
        assert payload["probe"] == name and payload["samples"] == 6 and payload["results"]
        if HAS_MATPLOTLIB:
            assert list(out.glob(f"{name}.png")) + list(out.glob(f"{name}_*.png")), name
    cka = json.loads((out / "cka.json").read_text())["results"]
    assert cka["states"] == ["h_emb", "h^(0)", "h^(1)", "h^(2)", "h_out"]
    assert all(cka["cka"][i][i] == pytest.approx(1.0) for i in range(5))
    steps = json.loads((out / "entropy_dynamics.json").read_text())["results"]["steps"]
    assert steps == [2, 4]


def test_one_probe_with_data_override_through_the_cli(trained_run, tmp_path):
    out = tmp_path / "lens"
    args = ["probe", str(trained_run), "--probe", "logit_lens", "--data", "seq_len=24", "--samples", "3",
            "--out", str(out), "--no-figures"]
    assert main(args) == 0
    payload = json.loads((out / "logit_lens.json").read_text())
    assert payload["seq_len"] == 24 and payload["samples"] == 3
    assert [p.name for p in out.iterdir()] == ["logit_lens.json"]


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="checks the message shown without matplotlib")
def test_figures_without_matplotlib_are_a_clear_error(trained_run, tmp_path, caplog):
    assert main(["probe", str(trained_run), "--probe", "cka", "--out", str(tmp_path)]) == 2
    assert "pip install 'looplm[plot]'" in caplog.text and "--no-figures" in caplog.text


def test_unknown_probe_is_a_clear_error(trained_run, caplog):
    assert main(["probe", str(trained_run), "--probe", "nope", "--no-figures"]) == 2
    assert "unknown probe 'nope'" in caplog.text and "logit_lens" in caplog.text


def test_probe_list(capsys):
    assert main(["probe", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PROBES)


def test_halting_probe_refuses_a_model_without_halting(trained_run):
    with pytest.raises(ProbeError, match="needs a halting rule"):
        run_probes(trained_run, ["halting"], samples=2, figures=False)


def test_halting_probe_reports_where_positions_stop(tmp_path):
    torch.manual_seed(0)
    from tests.conftest import ladder_config

    model = LoopLM(ladder_config("ut_act", 6, halting={"kind": "act", "full_compute": False})).eval()
    torch.nn.init.normal_(model.halting.unit.weight, std=2.0)
    probe = _input(model, tmp_path)
    numbers = get_probe("halting").run(probe).numbers
    steps = torch.cat([model(x).halt_steps.flatten() for x, _ in probe.batches])
    assert numbers["rule"] == "act" and sum(numbers["halt_step_fraction"]) == pytest.approx(1.0)
    assert numbers["mean_halt_step"] == pytest.approx(steps.double().mean().item(), rel=1e-5)
    assert numbers["block_passes_per_token"] == pytest.approx(steps.double().mean().item(), rel=1e-5)
    assert sum(numbers["act_weights_mean_by_step"]) == pytest.approx(1.0, rel=1e-5)
    by_step = numbers["act_weights_mean_by_step"]  # 1 block pass per step: the readout's expected step
    assert numbers["readout_depth"] == pytest.approx(sum(w * t for t, w in enumerate(by_step, 1)), rel=1e-4)
    assert 1.0 <= numbers["readout_depth"] <= numbers["mean_halt_step"] + 1e-6
