"""The command line: info, presets and clear errors (train/eval/generate in tests/train)."""

from __future__ import annotations

import json
import shutil

import pytest

from looplm.cli import main


def test_info_reports_mesh_table_6_counts(capsys):
    assert main(["info", "pythia-1.4b-4+8R2+4-mesh", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "4+8R2+4" and info["unrolled_depth"] == 24
    # MeSH Table 6: non-embedding 805,797,918 including 61,470 router weights
    assert info["parameters"]["non_embedding"] == 805_797_918
    assert info["parameters"]["topology"] == 61_470


def test_info_dense_pythia_non_embedding_matches_table_6(capsys):
    assert main(["info", "pythia-1.4b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"]["non_embedding"] == 1_208_602_624


def test_info_table_with_overrides(capsys):
    assert main(["info", "default", "model.layout=2+3R4+2", "model.topology.kind=anchor"]) == 0
    out = capsys.readouterr().out
    assert "2+3R4+2" in out and "unrolled_depth   16" in out and "anchor" in out


def test_presets_lists_every_preset(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "default" in out and "pythia-410m-3+6R3+3-mesh" in out and "tiny-gated_residual" in out


def test_invalid_override_is_a_clear_error(capsys, caplog):
    assert main(["info", "default", "model.topology.kind=meshy"]) == 2
    assert "model.topology.kind='meshy' is invalid" in caplog.text


def test_missing_run_is_a_clear_error(tmp_path, caplog):
    assert main(["eval", str(tmp_path / "nope")]) == 2
    assert "does not exist" in caplog.text


def test_info_requires_config():
    with pytest.raises(SystemExit):
        main(["info"])


def test_train_eval_generate_resume_through_the_cli(tmp_path, capsys):
    run = tmp_path / "run"
    common = ["tiny-mesh", f"train.out_dir={run}", "train.eval_every=0", "train.save_every=3",
              "train.sample_tokens=8", "model.d_model=32", "data.seq_len=32", "train.batch_size=4"]
    assert main(["train", *common, "train.max_steps=3", "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["sample"].startswith("The ")
    # a fresh run into the same directory is refused; --resume continues it
    assert main(["train", *common, "train.max_steps=5", "--no-progress"]) == 2
    assert main(["train", *common, "train.max_steps=5", "--resume", "--no-progress"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 5
    capsys.readouterr()

    assert main(["eval", str(run), "data.seq_len=16", "--json", "--batches", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 2 * 8 * 16  # overrides parsed as YAML
    assert main(["eval", str(run), "--json", "--batches", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["checkpoint"].endswith("step_0000005") and result["val_ppl"] > 1
    assert abs(result["val_ppl"] - __import__("math").exp(result["val_loss"])) < 1e-6

    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith("def ")
    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == greedy
    # the eager step on the static cache (recorded as CUDA graphs on a GPU) decodes the same text
    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "5", "--temperature", "0",
                 "--compile", "cuda-graph"]) == 0
    assert capsys.readouterr().out == greedy
    if shutil.which("g++") or shutil.which("c++"):  # inductor's CPU backend compiles C++
        # the captured static-cache step (torch.compile's default backend) decodes the same text
        assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "5", "--temperature", "0",
                     "--compile"]) == 0
        assert capsys.readouterr().out == greedy


def test_generate_from_save_pretrained_directory(tmp_path, capsys):
    from looplm import LoopLM
    from tests.conftest import tiny_config

    model = LoopLM(tiny_config("anchor", vocab_size=257))
    model.save_pretrained(tmp_path / "pretrained")
    reloaded = LoopLM.from_pretrained(tmp_path / "pretrained")
    for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()):
        assert __import__("torch").equal(a, b)
    assert main(["generate", str(tmp_path / "pretrained"), "--prompt", "ab", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("ab")


def test_flops_command_prints_breakdown_and_matches(capsys):
    import json as _json

    from looplm.cli import main as _main

    assert _main(["flops", "tiny-mesh", "--seq-len", "64", "--convention", "mesh", "--json"]) == 0
    out = _json.loads(capsys.readouterr().out)
    assert out["convention"] == "mesh" and out["seq_len"] == 64
    assert sum(out["components"].values()) == out["forward_flops"]
    assert _main(["flops", "tiny-dense", "--seq-len", "64", "--match-flops", "tiny-dense"]) == 0
    text = capsys.readouterr().out
    assert "layouts matching the flops of tiny-dense" in text
    assert _main(["info", "tiny-mesh"]) == 0
    assert "FLOPs/token" in capsys.readouterr().out


def test_step_embeddings_switch_off_to_extrapolate_through_the_cli(tmp_path, capsys, caplog):
    from looplm import LoopLM
    from tests.conftest import ladder_config

    LoopLM(ladder_config("tied_step", 3, vocab_size=257)).save_pretrained(tmp_path / "ut")
    args = ["generate", str(tmp_path / "ut"), "--prompt", "ab", "--max-new-tokens", "3", "--iterations", "6"]
    assert main(args) == 2  # e_t exists for 3 steps only
    assert "step embeddings" in caplog.text
    assert main([*args, "--no-step-embeddings"]) == 0
    assert capsys.readouterr().out.startswith("ab")
    LoopLM(ladder_config("tied", 3, vocab_size=257)).save_pretrained(tmp_path / "plain")
    assert main(["generate", str(tmp_path / "plain"), "--prompt", "ab", "--no-step-embeddings"]) == 2


def test_python_dash_m_looplm_is_the_cli():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "looplm", "presets"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "default" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "looplm", "no-such-command"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
