"""Fault injection: every expected failure is refused cleanly, as one ``error:`` line and exit 2.

Damaged checkpoints (flipped bytes in the data and in the header, truncated files, a
missing manifest, a corrupt or missing ``latest``, an empty ``checkpoints/``), broken
configs and overrides, non-finite hyper-parameters, unwritable output directories, binary
or single-document data, wrong generation arguments and a diverging run. None of them may
show a traceback or exit 0 with a wrong result.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from looplm import LoopLM, load_config
from looplm.artifacts import CheckpointError
from looplm.cli import main
from looplm.config_base import ConfigError
from looplm.data.sources import TXT_PASSAGE_CHARS, split_passages
from looplm.errors import TrainingDiverged
from looplm.eval.load import load_run
from looplm.eval.validation import evaluate_run
from looplm.train import Trainer
from looplm.train.config import TrainConfig
from tests.conftest import tiny_config

SMALL = ["model.d_model=32", "data.seq_len=32", "train.batch_size=4", "train.sample_tokens=0", "data.val_batches=2"]
STEP = "checkpoints/step_0000002"


def train_args(out_dir: Path, *extra: str) -> list[str]:
    return ["train", "tiny-mesh", f"train.out_dir={out_dir}", *SMALL, "train.max_steps=2", "train.eval_every=0",
            *extra, "--no-progress"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("failures") / "run"
    assert main(train_args(run)) == 0
    return run


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    """A private copy of the trained run, to damage."""
    return Path(shutil.copytree(trained_run, tmp_path / "run"))


def error_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("error:")]


def refused(args: list[str], caplog, match: str) -> str:
    """Run the CLI, expect exit 2 with exactly one ``error:`` line matching ``match``."""
    caplog.clear()
    assert main(args) == 2, args
    lines = error_lines(caplog)
    assert len(lines) == 1, lines
    assert match in lines[0], lines[0]
    return lines[0]


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


READERS = [
    ["eval", "{run}", "--batches", "1"],
    ["generate", "{run}", "--prompt", "ab", "--max-new-tokens", "2"],
    ["info", "{run}"],
    ["probe", "{run}", "--probe", "logit_lens", "--samples", "2", "--no-figures"],
]


def readers(run: Path) -> list[list[str]]:
    return [[a.format(run=run) for a in args] for args in READERS]


# ------------------------------------------------------------------ damaged checkpoints
def test_flipped_tensor_bytes_are_refused_by_every_reader(run_copy, caplog, capsys):
    flip_byte(run_copy / STEP / "model.safetensors", -64)  # inside the tensor data: still a valid file
    for args in readers(run_copy):
        line = refused(args, caplog, "is corrupted: model.safetensors has sha256")
        assert "--no-verify" in line and "verify=False" not in line  # CLI wording on the command line
    with pytest.raises(CheckpointError, match="verify=False"):
        LoopLM.from_pretrained(run_copy)
    # the explicit opt-out loads it anyway, for forensics
    assert main(["eval", str(run_copy), "--batches", "1", "--no-verify"]) == 0
    assert LoopLM.from_pretrained(run_copy, verify=False) is not None
    capsys.readouterr()


def test_broken_header_is_refused_with_or_without_verification(run_copy, caplog):
    flip_byte(run_copy / STEP / "model.safetensors", 12)  # the JSON header
    refused(["eval", str(run_copy)], caplog, "is corrupted: model.safetensors has sha256")
    refused(["eval", str(run_copy), "--no-verify"], caplog, "not a readable safetensors file")


def test_truncated_file_is_refused(run_copy, caplog):
    weights = run_copy / STEP / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    refused(["generate", str(run_copy), "--prompt", "a"], caplog, "is corrupted")
    refused(["generate", str(run_copy), "--prompt", "a", "--no-verify"], caplog, "not a readable safetensors file")


def test_missing_manifest_and_missing_file_are_refused(run_copy, caplog):
    (run_copy / STEP / "manifest.json").unlink()
    for args in readers(run_copy):
        refused(args, caplog, "manifest.json is missing")
    line = refused(["train", "tiny-mesh", f"train.out_dir={run_copy}", *SMALL, "train.max_steps=3", "--resume",
                    "--no-progress"], caplog, "manifest.json is missing")
    assert "earlier checkpoint" in line and "--no-verify" not in line  # training has no opt-out


def test_corrupt_missing_or_empty_latest(run_copy, tmp_path, caplog):
    latest = run_copy / "checkpoints" / "latest"
    latest.write_bytes(b"\x00\xffgarbage")
    for args in readers(run_copy):
        refused(args, caplog, "latest is corrupted")
    latest.write_text("step_0000099\n")
    refused(["eval", str(run_copy)], caplog, "names step_0000099, but")
    latest.unlink()
    line = refused(["eval", str(run_copy)], caplog, "latest is missing")
    assert "step_0000002" in line  # names the step directory to pass instead
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)
    refused(["eval", str(tmp_path / "fresh")], caplog, "has no checkpoint yet")


def test_save_pretrained_directories_are_verified(tmp_path):
    model = LoopLM(tiny_config("anchor", vocab_size=257))
    model.save_pretrained(tmp_path / "pre")
    manifest = json.loads((tmp_path / "pre" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    flip_byte(tmp_path / "pre" / "model.safetensors", -8)
    for load in (lambda: LoopLM.from_pretrained(tmp_path / "pre"), lambda: load_run(tmp_path / "pre")):
        with pytest.raises(CheckpointError, match="model.safetensors has sha256"):
            load()
    model.save_pretrained(tmp_path / "pre")  # writing again repairs it
    reloaded = LoopLM.from_pretrained(tmp_path / "pre")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))


def test_from_pretrained_reads_a_run_directory(trained_run):
    a = LoopLM.from_pretrained(trained_run)
    b = load_run(trained_run).model
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# ------------------------------------------------------------------ configs and arguments
def test_yaml_syntax_error_names_the_file_and_line(tmp_path, caplog):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  layout: [1\ntrain: {}\n")
    line = refused(["train", str(path)], caplog, str(path))
    assert "valid YAML" in line and "line 3" in line


@pytest.mark.parametrize("override", ["train.lr=[", "model.layout={a: 1", "train.max_steps=\"3"])
def test_malformed_override_is_a_clear_error(override, caplog):
    refused(["config", "tiny-mesh", override], caplog, "valid YAML")


@pytest.mark.parametrize("value", ["inf", ".inf", "-.inf", ".nan", "nan", "1e999"])
def test_non_finite_hyperparameters_are_refused(value, caplog):
    refused(["config", "tiny-mesh", f"train.lr={value}"], caplog, "a finite number")
    with pytest.raises(ConfigError, match="finite"):
        load_config("tiny-mesh", [f"model.init_std={value}"])


@pytest.mark.parametrize("field", ["lr", "eps", "weight_decay", "grad_clip", "sample_temperature"])
def test_non_finite_train_fields_are_refused_from_python(field):
    with pytest.raises(ConfigError, match=f"train.{field}=.*finite"):
        TrainConfig(**{field: math.inf})


@pytest.mark.parametrize("args, match", [
    (["--top-k", "0"], "--top-k: '0' is invalid"),
    (["--top-p", "0"], "--top-p: '0' is invalid"),
    (["--top-p", "1.5"], "--top-p: '1.5' is invalid"),
    (["--temperature", "-1"], "--temperature: '-1' is invalid"),
    (["--temperature", "nan"], "--temperature: 'nan' is invalid"),
    (["--max-new-tokens", "-1"], "--max-new-tokens: '-1' is invalid"),
    (["--iterations", "0"], "--iterations: '0' is invalid"),
])
def test_generation_arguments_are_one_error_line(trained_run, args, match):
    result = subprocess.run([sys.executable, "-m", "looplm.cli", "generate", str(trained_run), "--prompt", "a", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error:"), result.stderr
    assert match in result.stderr


def test_generation_arguments_from_python_name_the_argument(trained_run):
    model = load_run(trained_run).model
    for kwargs, match in (({"top_k": 0}, "top_k=0"), ({"top_p": 0.0}, "top_p=0.0"),
                          ({"temperature": -1.0}, "temperature=-1.0"), ({"max_new_tokens": -1}, "max_new_tokens=-1")):
        with pytest.raises(ConfigError, match=match):
            model.generate([[1, 2]], **kwargs)


def test_fresh_run_into_a_used_directory_gives_command_line_advice(trained_run, caplog):
    line = refused(train_args(trained_run), caplog, "already holds a run's checkpoints")
    assert "--resume" in line and "resume=True" not in line
    with pytest.raises(ConfigError, match=r"resume=True"):  # the Python wording from Python
        Trainer(load_config("tiny-mesh", [f"train.out_dir={trained_run}", *SMALL]), progress=False)


def test_wrong_config_name_suggests_presets_and_a_directory_hints_at_resume(trained_run, caplog):
    refused(["train", "tiny-mehs"], caplog, "did you mean tiny-mesh")
    refused(["train", str(trained_run)], caplog, "--resume")


def test_config_command_prints_every_field_as_loadable_yaml(tmp_path, capsys):
    assert main(["config", "tiny-mesh", "train.max_steps=7"]) == 0
    text = capsys.readouterr().out
    for field in ("save_every", "eval_every", "keep_last", "lr", "warmup_fraction", "val_fraction", "topology"):
        assert f"{field}:" in text
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    assert load_config(str(path)) == load_config("tiny-mesh", ["train.max_steps=7"])


# ------------------------------------------------------------------ output directories
def test_unwritable_out_dir_is_refused_before_training(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    refused(train_args(blocker), caplog, "train.out_dir")
    assert blocker.read_text() == "not a directory"


def test_unwritable_checkpoints_dir_is_refused_before_training(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("a file where checkpoints/ should be")
    line = refused(train_args(run), caplog, "not writable")
    assert "checkpoints" in line
    assert not (run / "metrics.jsonl").exists()  # nothing was trained, nothing written


def test_permission_denied_is_refused_before_training(tmp_path, caplog, monkeypatch):
    import tempfile

    real = tempfile.NamedTemporaryFile

    def denied(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).name == "checkpoints":
            raise PermissionError(13, "Permission denied", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", denied)
    refused(train_args(tmp_path / "run"), caplog, "Permission denied")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_unwritable_probe_output_is_an_error_line(trained_run, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    refused(["probe", str(trained_run), "--probe", "logit_lens", "--samples", "2", "--no-figures",
             "--out", str(blocker / "sub")], caplog, "error:")


# ------------------------------------------------------------------ divergence and non-finite results
def test_diverging_run_is_an_error_line(tmp_path, caplog, monkeypatch):
    from looplm.model import LoopLM as Model

    forward = Model.forward

    def nan_loss(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if out.loss is not None and self.training:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(Model, "forward", nan_loss)
    line = refused(train_args(tmp_path / "run", "train.max_bad_steps=2"), caplog, "training stopped at step 2")
    assert "lower train.lr" in line
    with pytest.raises(TrainingDiverged):
        Trainer(load_config("tiny-mesh", [f"train.out_dir={tmp_path / 'py'}", *SMALL, "train.max_bad_steps=1"]),
                progress=False).fit()


def test_non_finite_evaluation_warns_and_exits_2(tmp_path, caplog, capsys):
    model = LoopLM(tiny_config("residual", vocab_size=257))
    with torch.no_grad():
        model.head.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path / "nan")
    args = ["eval", str(tmp_path / "nan"), "data.seq_len=16", "--batches", "1", "--json"]
    refused(args, caplog, "val_loss is nan")
    assert any("not finite" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    assert json.loads(capsys.readouterr().out)["val_loss"] is None  # valid JSON: NaN written as null
    result = evaluate_run(tmp_path / "nan", ["data.seq_len=16"], batches=1)
    assert math.isnan(result["val_loss"])


# ------------------------------------------------------------------ data
def test_binary_file_is_refused(tmp_path, caplog):
    data = tmp_path / "weights.txt"
    data.write_bytes(bytes(range(256)) * 64)
    refused(train_args(tmp_path / "run", f"data.source={data}"), caplog, "NUL bytes")
    data.write_bytes(bytes(range(128, 256)) * 64)  # no NUL, but not UTF-8
    refused(train_args(tmp_path / "run", f"data.source={data}"), caplog, "invalid UTF-8")


def test_a_few_invalid_bytes_are_replaced_with_a_warning(tmp_path, caplog):
    from looplm.data.sources import read_text_file

    path = tmp_path / "latin.txt"
    path.write_bytes("caf".encode() + b"\xe9 " + b"plain text " * 200)
    text = read_text_file(path)
    assert text.startswith("caf\ufffd ") and "invalid UTF-8" in caplog.text


def test_one_long_txt_file_has_a_held_out_split(tmp_path):
    from looplm.data import data_tokenizer
    from looplm.data.packing import packed_corpus
    from looplm.data.config import DataConfig

    paragraphs = [f"Paragraph {i}: " + " ".join(f"word{i * 7 + j}" for j in range(60)) for i in range(400)]
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(paragraphs) + "\n")
    cfg = DataConfig(source=str(path), seq_len=64, val_fraction=0.1)
    corpus = packed_corpus(cfg, data_tokenizer(cfg))
    documents = corpus.train_documents + corpus.val_documents
    assert documents > 20 and corpus.val_documents >= 1 and corpus.train.shape[0] > corpus.val.shape[0] > 0


def test_passages_join_back_and_end_at_paragraph_breaks():
    text = "".join(f"line {i}\n" + ("\n" if i % 7 == 0 else "") for i in range(3000)) + "x" * (5 * TXT_PASSAGE_CHARS)
    passages = split_passages(text)
    assert "".join(passages) == text
    assert all(len(p) <= 4 * TXT_PASSAGE_CHARS for p in passages)
    paragraph_part = [p for p in passages if not p.startswith("x")][:-1]
    assert all(p.endswith("\n\n") and len(p) >= TXT_PASSAGE_CHARS for p in paragraph_part)


def test_too_small_corpus_says_how_it_was_split(tmp_path, caplog):
    path = tmp_path / "short.txt"
    path.write_text("only a few words\n")
    line = refused(train_args(tmp_path / "run", f"data.source={path}"), caplog, "data.seq_len=32")
    assert "documents" in line and "data.val_fraction" in line


def test_missing_validation_set_is_a_warning(tmp_path, caplog):
    path = tmp_path / "small.txt"
    path.write_text("tiny corpus text. " * 20)  # one passage: held out entirely or not at all
    cfg = load_config("tiny-mesh", [f"train.out_dir={tmp_path / 'run'}", *SMALL, f"data.source={path}",
                                    "data.val_fraction=0.01"])
    Trainer(cfg, progress=False)
    assert "no validation set" in caplog.text


# ------------------------------------------------------------------ newcomer paths
def test_probe_on_a_missing_path_names_the_path_first(tmp_path, caplog, monkeypatch):
    from looplm.errors import MissingExtra
    from looplm.probes import plots

    def no_matplotlib():
        raise MissingExtra("probe figures need matplotlib")

    monkeypatch.setattr(plots, "pyplot", no_matplotlib)
    refused(["probe", str(tmp_path / "nope")], caplog, "does not exist")


def test_python_api_prints_the_summary_without_logging_setup(tmp_path):
    code = (
        "from looplm import Trainer, load_config\n"
        f"cfg = load_config('tiny-mesh', ['train.out_dir={tmp_path / 'run'}', 'train.max_steps=1', "
        "'model.d_model=32', 'data.seq_len=32', 'train.batch_size=2', 'train.sample_tokens=0'])\n"
        "Trainer(cfg, progress=False).fit()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "run summary" in result.stderr and "checkpoint" in result.stderr
