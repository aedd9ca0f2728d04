"""looplm inside transformers: an exported directory loads with the Auto* classes and
computes looplm's own logits (one forward, cached decoding), greedy ``generate()`` picks
looplm's tokens, beam search through the cache equals beam search by recomputation, and
save -> load -> save writes the same bytes."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import looplm.hf.export  # noqa: E402,F401  (registers the Auto* classes)
from looplm.config_base import ConfigError  # noqa: E402
from looplm.generation import left_pad  # noqa: E402
from looplm.hf.export import LoopLMCache, LoopLMForCausalLM, export  # noqa: E402
from looplm.model import LoopLM  # noqa: E402
from tests.conftest import all_configs, grow, random_ids, tiny_config  # noqa: E402

VOCAB = 257  # the byte tokenizer's: an export refuses a tokenizer larger than the model's vocabulary
CONFIGS = {name: dataclasses.replace(cfg, vocab_size=VOCAB) for name, cfg in all_configs()}
ATOL = 1e-5
# one per family: attention topologies, a linear mixer hybrid, a sparse mixer, a
# resolution schedule, head loops, two streams with Q-halt, ACT halting, a loop-level hybrid
REPRESENTATIVE = ["topology=anchor", "topology=mesh", "residual-tied", "swa-anchor", "hybrid-full-gdn-gated",
                  "mamba2-anchor", "nsa-residual", "loop-level-kinds", "spiral-mesh", "sgt-heads-grown",
                  "ut-act-adaptive-anchor", "ar-trm-adaptive", "nested-act-prelude-coda", "lora-anchor"]

UNPADDED = {"spiral-mesh"}  # multi-resolution iterations cut chunks by position: no left padding


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (looplm model, export directory), built once per config."""
    root = tmp_path_factory.mktemp("export")

    @functools.cache
    def build(name: str, iterations=None) -> tuple[LoopLM, Path]:
        torch.manual_seed(0)
        model = LoopLM(CONFIGS[name])
        grow(name, model)
        model.eval()
        tag = f"{name}-{iterations}"
        model.save_pretrained(root / tag / "src")
        return model, export(root / tag / "src", root / tag / "out", iterations=iterations)

    return build


def _load(out: Path) -> LoopLMForCausalLM:
    return AutoModelForCausalLM.from_pretrained(out).eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_looplm(exported, name):
    model, out = exported(name)
    hf = _load(out)
    assert isinstance(hf, LoopLMForCausalLM)
    ids = random_ids(2, 11, VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids, use_cache=False).logits, model(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["topology=anchor", "ut-act-adaptive-anchor", "hybrid-gdn-dsa-mesh"])
def test_labels_give_looplm_loss(exported, name):
    """transformers' unshifted labels: the loss looplm computes for shifted targets,
    auxiliary losses (ponder cost, DSA indexer) included."""
    model, out = exported(name)
    hf = _load(out)
    ids = random_ids(2, 8, VOCAB, seed=6)
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    with torch.no_grad():
        loss, logits = hf(ids, labels=ids, use_cache=False, return_dict=False)
        torch.testing.assert_close(loss, model(ids, targets).loss, atol=ATOL, rtol=0)
    assert logits.shape == (2, 8, VOCAB)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoding_equals_full_forward(exported, name):
    """Prefill through transformers' calling convention (full 2-D mask, past_key_values
    returned and passed back), then one token at a time."""
    model, out = exported(name)
    hf = _load(out)
    ids = random_ids(2, 10, VOCAB, seed=1)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        full = model(ids).logits
        step = hf(ids[:, :6], attention_mask=mask[:, :6])
        assert isinstance(step.past_key_values, LoopLMCache)
        logits = [step.logits]
        for t in range(6, 10):
            step = hf(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=step.past_key_values)
            logits.append(step.logits)
        assert step.past_key_values.get_seq_length() == 10
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_greedy_generate_equals_looplm_generate(exported, name):
    """Left-padded prompts of different lengths (equal lengths for multi-resolution loops,
    which refuse padding): transformers' greedy generate() == looplm's."""
    model, out = exported(name)
    hf = _load(out)
    short = 7 if name in UNPADDED else 4
    prompts = [random_ids(1, 7, seed=2)[0].tolist(), random_ids(1, short, seed=3)[0].tolist()]
    ours = model.generate(prompts, max_new_tokens=6, temperature=0, pad_token_id=0)
    ids, mask = left_pad(prompts, 0)
    theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    assert torch.equal(theirs, ours.sequences)


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_beam_search_cache_reordering(exported, name):
    """Beam search through the cache (reordered by select_batch every step) picks the beams
    that beam search recomputing the whole prefix without a cache picks."""
    _, out = exported(name)
    hf = _load(out)
    ids = random_ids(2, 5, seed=4)
    common = dict(max_new_tokens=5, min_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False,
                  pad_token_id=0, eos_token_id=None)
    mask = torch.ones_like(ids)
    cached = hf.generate(ids, attention_mask=mask, use_cache=True, **common)
    recomputed = hf.generate(ids, attention_mask=mask, use_cache=False, **common)
    assert cached.shape == (4, 10)
    assert torch.equal(cached, recomputed)


def test_left_padding_refused_where_looplm_refuses_it(exported):
    _, out = exported("spiral-mesh")
    ids, mask = left_pad([[1, 2, 3, 4, 5], [6, 7]], 0)
    with pytest.raises(ValueError, match="left-padded batches are not supported"):
        _load(out).generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)


def test_a_mask_that_is_not_left_padding_is_refused(exported):
    """generate() masks every pad_token_id it finds in a prompt; inside a prompt that is not
    left padding, which looplm cannot run."""
    _, out = exported("topology=anchor")
    ids = torch.tensor([[5, 6, 0, 7]])
    with pytest.raises(ConfigError, match="left padding only"):
        _load(out).generate(ids, max_new_tokens=2, pad_token_id=0)


def test_sampling_runs_and_top_k_1_is_greedy(exported):
    _, out = exported("topology=anchor")
    hf = _load(out)
    ids = random_ids(2, 5, seed=5)
    fixed = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, pad_token_id=0,
                 eos_token_id=None)
    greedy = hf.generate(ids, do_sample=False, **fixed)
    assert torch.equal(hf.generate(ids, do_sample=True, top_k=1, **fixed), greedy)
    torch.manual_seed(0)
    sampled = hf.generate(ids, do_sample=True, temperature=1.5, **fixed)
    assert sampled.shape == (2, 9) and torch.equal(sampled[:, :5], ids)


def test_iterations_field_sets_the_loop_count(exported):
    model, out = exported("topology=base", iterations=4)
    hf = _load(out)
    assert hf.config.iterations == 4
    ids = random_ids(1, 6)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids, iterations=4).logits, atol=ATOL, rtol=0)
        assert not torch.allclose(hf(ids).logits, model(ids).logits)
        torch.testing.assert_close(hf(ids, iterations=2).logits, model(ids).logits, atol=ATOL, rtol=0)
    greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=3, temperature=0, iterations=4).sequences)
    per_call = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                           do_sample=False, pad_token_id=0, eos_token_id=None, iterations=3)
    assert torch.equal(per_call, model.generate(ids, max_new_tokens=3, temperature=0, iterations=3).sequences)


def test_export_refuses_a_loop_count_the_model_cannot_run(tmp_path):
    LoopLM(tiny_config("mesh", vocab_size=VOCAB)).save_pretrained(tmp_path / "src")  # MeSH: per-iteration routers
    with pytest.raises(ConfigError, match="iterations"):
        export(tmp_path / "src", tmp_path / "out", iterations=5)
    assert not (tmp_path / "out").exists()


def test_save_load_save_is_byte_stable(exported, tmp_path):
    _, out = exported("residual-tied")
    _load(out).save_pretrained(tmp_path / "again")
    _load(tmp_path / "again").save_pretrained(tmp_path / "third")
    written = sorted(p.name for p in (tmp_path / "again").iterdir())
    assert written == ["config.json", "generation_config.json", "model.safetensors"]
    for name in written:
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name
        assert (tmp_path / "third" / name).read_bytes() == (out / name).read_bytes(), name


def test_trust_remote_code_loads_without_importing_looplm_hf(exported):
    """A fresh interpreter: AutoConfig/AutoModelForCausalLM find the classes through the
    auto_map and the shipped modeling_looplm.py (which imports looplm)."""
    model, out = exported("sgt-heads-grown")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
        "assert 'looplm.hf' not in type(m).__module__, type(m).__module__\n"
        "ids = torch.arange(6)[None] * 40\n"
        "with torch.no_grad():\n"
        "    print(repr(m(ids).logits.sum().item()))\n"
    )
    src = str(Path(looplm.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    with torch.no_grad():
        expected = model(torch.arange(6)[None] * 40).logits.sum().item()
    assert float(result.stdout.strip().splitlines()[-1]) == pytest.approx(expected, abs=1e-4)


def test_byte_tokenizer_round_trips(exported):
    from looplm.data.tokenizer import ByteTokenizer

    _, out = exported("topology=anchor")
    tok = AutoTokenizer.from_pretrained(out)
    byte = ByteTokenizer()
    for text in ["hello world", "héllo — ünïcode ✓ 漢字", "  leading spaces\nand\ttabs ", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == byte.encode(text)
        assert tok.decode(ids) == text
    assert tok.eos_token_id == tok.pad_token_id == byte.eos_id
    assert tok.decode(byte.encode("ab") + [byte.eos_id], skip_special_tokens=True) == "ab"


def test_run_with_a_tokenizers_json_exports_that_tokenizer(tmp_path):
    """A training checkpoint whose data.tokenizer is a tokenizers JSON: OUT's tokenizer
    encodes as the run's does, with its end-of-document token as eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from looplm.artifacts import CONFIG_FILE, MODEL_FILE, write_manifest
    from looplm.config import RunConfig
    from looplm.data import DataConfig
    from looplm.data.tokenizer import HFTokenizer

    words = ["<|endoftext|>", "the", "loop", "runs", "again", "[UNK]"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(tmp_path / "tokenizer.json"))
    run = RunConfig(model=tiny_config("anchor"), data=DataConfig(tokenizer=str(tmp_path / "tokenizer.json")))
    ckpt = tmp_path / "ckpt"
    LoopLM(run.model).save_pretrained(ckpt)
    (ckpt / CONFIG_FILE).write_text(__import__("json").dumps(run.to_dict()))
    write_manifest(ckpt, (CONFIG_FILE, MODEL_FILE))

    out = export(ckpt, tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(out)
    ours = HFTokenizer(tmp_path / "tokenizer.json")
    assert tok.encode("the loop runs again", add_special_tokens=False) == ours.encode("the loop runs again")
    assert tok.eos_token_id == ours.eos_id == 0
    assert _load(out).config.eos_token_id == 0


def test_export_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path):
    LoopLM(tiny_config("anchor")).save_pretrained(tmp_path / "src")  # 61 tokens; the byte tokenizer has 257
    with pytest.raises(ConfigError, match="at most model.vocab_size=61"):
        export(tmp_path / "src", tmp_path / "out")


def test_cli_export(tmp_path, caplog):
    from tokenizers import Tokenizer, models

    from looplm.cli import main

    LoopLM(tiny_config("anchor")).save_pretrained(tmp_path / "src")
    Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "out"), "--iterations", "3",
                 "--tokenizer", str(tmp_path / "tokenizer.json")]) == 0
    assert _load(tmp_path / "out").config.iterations == 3
    assert AutoTokenizer.from_pretrained(tmp_path / "out").eos_token_id == 0
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "out2")]) == 2
    assert "error: no checkpoint at" in caplog.text


def test_missing_transformers_names_the_extra():
    """Without transformers the import side of looplm.hf still loads; the export, and the
    export's classes reached through looplm.hf (old exported directories), name the extra."""
    script = ("import sys; sys.modules['transformers'] = None\n"
              "import looplm, looplm.hf\n"
              "print(looplm.hf.load_hf_checkpoint.__name__)\n"
              "for attempt in ('import looplm.hf.export', 'from looplm.hf import LoopLMConfig'):\n"
              "    try:\n        exec(attempt)\n    except looplm.errors.MissingExtra as err:\n        print(err)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(looplm.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    lines = result.stdout.splitlines()
    assert lines[0] == "load_hf_checkpoint", result.stderr[-2000:]
    assert len(lines) == 3 and all("pip install 'looplm[hf]'" in line for line in lines[1:]), result.stdout


def test_directories_exported_before_the_subpackage_still_resolve_their_classes():
    """Their modeling_looplm.py imports the classes from looplm.hf, not looplm.hf.export."""
    from looplm.hf import LoopLMCache as cache, LoopLMConfig as config, LoopLMForCausalLM as model

    assert (config, model, cache) == (looplm.hf.export.LoopLMConfig, LoopLMForCausalLM, LoopLMCache)
    with pytest.raises(AttributeError, match="no attribute 'LoopLMModel'"):
        looplm.hf.LoopLMModel
