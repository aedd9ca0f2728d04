"""Dense checkpoints into loops (looplm.hf.convert): the documented layer maps, the
converted weights, exact dense reproduction, refusals, the CLI, and up-training from the
converted start (train.init_from)."""

from __future__ import annotations

import json

import pytest
import torch

from looplm.cli import main
from looplm.config import load_config
from looplm.config_base import ConfigError
from looplm.hf.convert import MAP_FILE, TRAIN_FILE, convert_checkpoint, convert_dense, layer_map
from looplm.hf.import_model import load_hf_checkpoint
from looplm.model import LoopLM
from tests.conftest import randomize_weights

transformers = pytest.importorskip("transformers")

VOCAB = 260  # >= the byte tokenizer's 257, so the up-training test can use pydoc bytes


# ---------------------------------------------------------------------- layer maps
def test_layer_maps_of_the_documented_example():
    """24 dense layers into 4+8R2+4, as in the module docstring and the README."""
    pre, coda = tuple((i,) for i in range(4)), tuple((i,) for i in range(20, 24))
    average = layer_map(24, "4+8R2+4", "average")
    assert average.prelude == pre and average.coda == coda
    assert average.core == tuple((4 + j, 12 + j) for j in range(8))
    assert average.unused == ()
    stepwise = layer_map(24, "4+8R2+4", "stepwise")
    assert stepwise.core == tuple((i,) for i in (4, 6, 8, 10, 12, 14, 16, 18))
    assert stepwise.prelude == pre and stepwise.coda == coda
    assert stepwise.unused == (5, 7, 9, 11, 13, 15, 17, 19)
    select = layer_map(24, "4+8R2+4", "select")
    assert select.core == tuple((i,) for i in range(4, 12))
    assert select.unused == tuple(range(12, 20))
    assert select.to_dict()["core"] == [[i] for i in range(4, 12)]
    assert "core.0.7     <- dense mean(11, 19)" in average.describe()


def test_layer_maps_when_the_middle_is_not_T_groups():
    """k = floor(M / C) groups, not T: 10 layers into 1+2R3+1 have M = 8, k = 4."""
    assert layer_map(10, "1+2R3+1", "average").core == ((1, 3, 5, 7), (2, 4, 6, 8))
    assert layer_map(10, "1+2R3+1", "stepwise").core == ((1,), (5,))
    assert layer_map(10, "1+2R3+1", "select").core == ((1,), (2,))
    odd = layer_map(9, "1+2R2+1", "average")  # M = 7: 3 groups, dense 7 left over
    assert odd.core == ((1, 3, 5), (2, 4, 6)) and odd.unused == (7,)
    dense = layer_map(6, "4", "select")  # no loop: the first 4 layers, in order
    assert dense.prelude == tuple((i,) for i in range(4)) and dense.core == () and dense.unused == (4, 5)


@pytest.mark.parametrize(("layout", "init", "field"), [
    ("3+4R2+3", "average", "layout"),  # 3 + 4 + 3 > 8
    ("9", "select", "layout"),
    ("2+4R2+2", "mean", "init"),
    ("4+x", "select", "layout"),
])
def test_bad_layout_or_init_is_a_config_error_naming_the_field(layout, init, field):
    with pytest.raises(ConfigError) as err:
        layer_map(8, layout, init)
    assert err.value.field == field


# ---------------------------------------------------------------- tiny checkpoints
def _checkpoint(path, family: str, layers: int = 6, seed: int = 0):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  intermediate_size=48, max_position_embeddings=64)
    if family == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common, rotary_pct=0.5))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, num_key_value_heads=2))
    randomize_weights(model, seed)
    model.config._attn_implementation = "eager"
    model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _ids(length: int = 11):
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
@pytest.mark.parametrize("init", ["average", "select", "stepwise"])
def test_converted_weights_are_the_documented_combination(tmp_path, family, init):
    _checkpoint(tmp_path, family, layers=7)
    dense = load_hf_checkpoint(tmp_path).state_dict()
    model, mapping, fresh = convert_dense(tmp_path, "1+2R2+1", init)
    state = model.state_dict()
    assert mapping.core == {"average": ((1, 3), (2, 4)), "select": ((1,), (2,)), "stepwise": ((1,), (3,))}[init]
    names = [k[len("prelude.0."):] for k in dense if k.startswith("prelude.0.")]
    assert names and fresh == []
    for prefix, sources in [("prelude.0", (0,)), ("core.0.0", mapping.core[0]), ("core.0.1", mapping.core[1]),
                            ("coda.0", (6,))]:
        for name in names:
            expected = torch.stack([dense[f"prelude.{i}.{name}"] for i in sources]).mean(0)
            assert torch.equal(state[f"{prefix}.{name}"], expected), f"{prefix}.{name}"
            if len(sources) == 1:  # select / stepwise / prelude / coda: the dense tensor itself
                assert torch.equal(state[f"{prefix}.{name}"], dense[f"prelude.{sources[0]}.{name}"])
    for key in ("embed.weight", "norm.weight", "head.weight"):
        assert torch.equal(state[key], dense[key])
    assert model.cfg.layout == "1+2R2+1" and model.cfg.d_model == 32


@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
def test_dense_layout_with_select_reproduces_the_dense_logits(tmp_path, family):
    hf = _checkpoint(tmp_path, family, layers=5, seed=1)
    model, mapping, _ = convert_dense(tmp_path, "5", "select")
    ids = _ids()
    with torch.no_grad():
        ours, dense, theirs = model(ids).logits, load_hf_checkpoint(tmp_path)(ids).logits, hf(ids).logits
    assert mapping.prelude == tuple((i,) for i in range(5))
    assert torch.equal(ours, dense)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_one_iteration_loop_with_select_reproduces_the_dense_logits(tmp_path):
    """2+2R1+1 under select is the dense stack cut into prelude, one core pass and coda."""
    _checkpoint(tmp_path, "llama", layers=5, seed=2)
    model, _, _ = convert_dense(tmp_path, "2+2R1+1", "select")
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, load_hf_checkpoint(tmp_path)(ids).logits, atol=1e-6, rtol=1e-6)


def test_overrides_and_fresh_parameters(tmp_path):
    _checkpoint(tmp_path, "llama", layers=6)
    model, _, fresh = convert_dense(tmp_path, "1+2R2+1", "average",
                                    [("model.topology.kind", "anchor"), ("model.step_embeddings", True)])
    assert model.cfg.topology.kind == "anchor" and model.cfg.step_embeddings
    assert fresh and all(k.startswith("step_embedding.") for k in fresh)


def test_refusals_name_the_field(tmp_path):
    _checkpoint(tmp_path, "llama", layers=4)
    cases = [
        (("3+2R2+1", "average", ()), "layout"),
        (("1+2R2+1", "lower", ()), "init"),
        (("1+2R2+1", "average", [("model.share_core", False)]), "model.share_core"),
        (("1+2R2+1", "average", [("train.lr", 1.0)]), "train.lr"),
        (("1+2R2+1", "average", [("model.d_model", 64)]), "overrides"),
    ]
    for (layout, init, overrides), field in cases:
        with pytest.raises(ConfigError) as err:
            convert_dense(tmp_path, layout, init, overrides)
        assert err.value.field == field
    looped = tmp_path / "ouro"
    looped.mkdir()
    (looped / "config.json").write_text(json.dumps({"model_type": "ouro", "num_hidden_layers": 4}))
    with pytest.raises(ConfigError) as err:
        convert_dense(looped, "1+1R2+1", "average")
    assert err.value.field == "hf_config.model_type" and "dense" in str(err.value)


# ---------------------------------------------------------------- output and CLI
def test_cli_writes_a_loadable_directory_with_the_map(tmp_path, caplog):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    _checkpoint(hf_dir, "gpt_neox", layers=6)
    with caplog.at_level("INFO", logger="looplm"):
        assert main(["convert", str(hf_dir), str(out), "--layout", "1+2R2+1", "--init", "average",
                     "model.topology.kind=anchor"]) == 0
    assert "core.0.1     <- dense mean(2, 4)" in caplog.text
    saved = json.loads((out / MAP_FILE).read_text())
    assert saved["core"] == [[1, 3], [2, 4]] and saved["unused"] == [] and saved["fresh"] == []
    loaded = LoopLM.from_pretrained(out)  # manifest verified
    model, _, _ = convert_dense(hf_dir, "1+2R2+1", "average", [("model.topology.kind", "anchor")])
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert main(["convert", str(hf_dir), str(tmp_path / "bad"), "--layout", "1+2R2+1", "--init", "mean"]) == 2
    assert "init" in caplog.text and "average, select, stepwise" in caplog.text


# ------------------------------------------------------------------- up-training
def _run_config(out, run_dir, *extra):
    return load_config(str(out / TRAIN_FILE), [
        "data.source=pydoc", "data.tokenizer=byte", "data.seq_len=32", "data.val_batches=1",
        f"train.out_dir={run_dir}", "train.max_steps=12", "train.batch_size=4", "train.lr=3e-3",
        "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0", "train.save_every=0",
        "train.sample_tokens=0", "train.device=cpu", "train.precision=fp32", *extra,
    ])


def test_up_training_from_the_converted_start_lowers_the_loss(tmp_path):
    from looplm.train import Trainer
    from looplm.train.metrics import train_losses

    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    _checkpoint(hf_dir, "llama", layers=6)
    convert_checkpoint(hf_dir, out, "1+2R2+1", "average")
    converted = LoopLM.from_pretrained(out).state_dict()
    trainer = Trainer(_run_config(out, tmp_path / "run"), progress=False)
    start = trainer.model.state_dict()
    assert all(torch.equal(start[k], converted[k]) for k in converted)  # init_from loaded before step 1
    trainer.fit()
    losses = train_losses(tmp_path / "run" / "metrics.jsonl")
    assert sorted(losses) == list(range(1, 13))
    first, last = sum(losses[s] for s in (1, 2)) / 2, sum(losses[s] for s in (11, 12)) / 2
    assert last < first - 0.1, losses


def test_init_from_refuses_another_model_config_and_resume(tmp_path):
    from looplm.train import Trainer

    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    _checkpoint(hf_dir, "llama", layers=4)
    convert_checkpoint(hf_dir, out, "1+1R2+1", "select")
    with pytest.raises(ConfigError, match="model.d_model: checkpoint 32, this run 64") as err:
        Trainer(_run_config(out, tmp_path / "a", "model.d_model=64"), progress=False)
    assert err.value.field == "train.init_from"
    run = tmp_path / "b"
    Trainer(_run_config(out, run, "train.max_steps=2"), progress=False).fit()
    with pytest.raises(ConfigError) as err:
        Trainer(_run_config(out, run, "train.max_steps=3"), resume=True, progress=False)
    assert err.value.field == "train.init_from"
    Trainer(_run_config(out, run, "train.max_steps=3", "train.init_from=null"), resume=True, progress=False).fit()


# ------------------------------------------------------- per-iteration LoRA (Relaxed)
def _tie_norms_and_biases(path, family: str, layers: int, seed: int = 3):
    """A dense checkpoint whose layers share their norms and biases (random, so they are not
    trivially 1 and 0): the adapters relax the linears only, so full rank is exact here."""
    hf = _checkpoint(path, family, layers=layers, seed=seed)
    first = hf.gpt_neox.layers[0] if family == "gpt_neox" else hf.model.layers[0]
    shared = {n: p for n, p in first.named_parameters() if p.ndim == 1}
    with torch.no_grad():
        for layer in (hf.gpt_neox.layers if family == "gpt_neox" else hf.model.layers):
            for name, p in layer.named_parameters():
                if name in shared:
                    p.copy_(shared[name])
    hf.save_pretrained(path, safe_serialization=True)
    return hf


@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
@pytest.mark.parametrize("init", ["average", "stepwise"])
def test_full_rank_adapters_reproduce_the_dense_logits(tmp_path, family, init):
    """Bae et al. §2.3: B_t A_t = W_{P+tC+j} - W'_j at full rank, so the relaxed loop runs the
    dense model's layers in the dense order (32 >= min(in, out) of every linear here)."""
    _tie_norms_and_biases(tmp_path, family, layers=6)
    ids = _ids()
    dense = load_hf_checkpoint(tmp_path)
    model, mapping, fresh = convert_dense(tmp_path, "1+2R2+1", init, [("model.lora.rank", 32)])
    assert fresh == [] and mapping.unrolled(2) == ((1, 3), (2, 4))
    tied, _, _ = convert_dense(tmp_path, "1+2R2+1", init)
    with torch.no_grad():
        want = dense(ids).logits
        torch.testing.assert_close(model(ids).logits, want, atol=2e-5, rtol=1e-5)
        assert (tied(ids).logits - want).abs().max() > 1e-2  # the tied loop alone is not the dense model


def test_low_rank_adapters_are_the_truncated_svd_of_the_residual(tmp_path):
    _checkpoint(tmp_path, "llama", layers=6, seed=4)
    dense = load_hf_checkpoint(tmp_path).state_dict()
    model, _, _ = convert_dense(tmp_path, "1+2R2+1", "stepwise", [("model.lora.rank", 3)])
    state = model.state_dict()
    for j, layers in enumerate(((1, 3), (2, 4))):
        for t, i in enumerate(layers):
            for linear, lora in (("attn.qkv", "lora.attn.0.qkv"), ("ffn.down", "lora.ffn.down")):
                residual = dense[f"prelude.{i}.{linear}.weight"] - state[f"core.0.{j}.{linear}.weight"]
                A, B = state[f"core.0.{j}.{lora}.A.{t}"], state[f"core.0.{j}.{lora}.B.{t}"]
                assert A.shape[0] == B.shape[1] == 3
                S = torch.linalg.svdvals(residual.double())
                # Eckart–Young: the rank-3 truncation leaves exactly the tail of the spectrum
                err = torch.linalg.matrix_norm((residual - B @ A).double())
                torch.testing.assert_close(err, S[3:].norm(), atol=1e-5, rtol=1e-5)


def test_lora_conversion_refuses_a_middle_without_T_groups(tmp_path):
    _checkpoint(tmp_path, "llama", layers=5)  # middle of 3 layers, 1+2R2+1 needs 4
    with pytest.raises(ConfigError) as err:
        convert_dense(tmp_path, "1+2R2+1", "average", [("model.lora.rank", 2)])
    assert err.value.field == "model.lora.rank" and "T·C = 4" in str(err.value)


def test_cli_lora_rank_writes_adapters_and_their_layers(tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    _checkpoint(hf_dir, "gpt_neox", layers=6)
    assert main(["convert", str(hf_dir), str(out), "--layout", "1+2R2+1", "--init", "average", "--lora-rank", "4"]) == 0
    saved = json.loads((out / MAP_FILE).read_text())
    assert saved["lora"] == {"rank": 4, "iterations": [[1, 3], [2, 4]]} and saved["fresh"] == []
    loaded = LoopLM.from_pretrained(out)
    assert loaded.cfg.lora.rank == 4
    model, _, _ = convert_dense(hf_dir, "1+2R2+1", "average", [("model.lora.rank", 4)])
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_relaxed_conversion_exports_to_transformers_with_the_dense_logits(tmp_path):
    """``looplm convert --lora-rank`` then ``looplm export``: transformers loads the relaxed
    loop, and at full rank (tied norms and biases agreeing) it computes the dense logits."""
    pytest.importorskip("safetensors")
    from transformers import AutoModelForCausalLM

    hf_dir, out, exported = tmp_path / "hf", tmp_path / "out", tmp_path / "exported"
    _tie_norms_and_biases(hf_dir, "llama", layers=6, seed=5)
    assert main(["convert", str(hf_dir), str(out), "--layout", "1+2R2+1", "--init", "average",
                 "--lora-rank", "32"]) == 0
    assert main(["export", str(out), str(exported)]) == 0
    relaxed = AutoModelForCausalLM.from_pretrained(exported).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(relaxed(ids, use_cache=False).logits, load_hf_checkpoint(hf_dir)(ids).logits,
                                   atol=2e-5, rtol=1e-5)
        generated = relaxed.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 9)
