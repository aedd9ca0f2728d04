"""``looplm import HF_DIR OUT``: tiny random Ouro, LLaMA and GPT-NeoX checkpoints with a
tokenizer become run directories that ``looplm eval`` / ``generate`` read, giving the
reference model's logits, loss and greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from looplm.cli import main  # noqa: E402
from looplm.config_base import ConfigError  # noqa: E402
from looplm.data import data_tokenizer, validation_batches  # noqa: E402
from looplm.eval.load import eval_data_config, load_run  # noqa: E402
from looplm.eval.text_generation import generate_text  # noqa: E402
from looplm.eval.validation import evaluate_run  # noqa: E402
from looplm.hf.import_run import import_checkpoint  # noqa: E402
from looplm.train.checkpoint import load_checkpoint  # noqa: E402
from tests.conftest import randomize_weights  # noqa: E402
from tests.hf.test_ouro import BASE as OURO, ouro_logits, ouro_weights, write_checkpoint  # noqa: E402

WORDS = ["<|endoftext|>", "[UNK]", "the", "loop", "runs", "again", "and", "stops", "here", "a", "model", "reads"]
ATOL = 1e-5


def save_tokenizer(directory) -> None:
    """A word-level transformers tokenizer (save_pretrained: tokenizer.json, tokenizer_config.json, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", unk_token="[UNK]")
    fast.save_pretrained(directory)


def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(" ".join(WORDS[2 + (i * 7 + j) % 10] for j in range(40)) for i in range(30)))
    return str(path)


def llama(directory, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=80, max_position_embeddings=64,
                                   rms_norm_eps=1e-5)
    return _save(transformers.LlamaForCausalLM(cfg), directory, seed)


def neox(directory, seed=0):
    cfg = transformers.GPTNeoXConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=64, rotary_pct=0.25)
    return _save(transformers.GPTNeoXForCausalLM(cfg), directory, seed)


def _save(model, directory, seed):
    torch.manual_seed(seed)
    randomize_weights(model, seed)
    model.config._attn_implementation = "eager"
    model.float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return model


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_imported_dense_run_evaluates_and_generates_like_transformers(tmp_path, family):
    hf = (llama if family == "llama" else neox)(tmp_path / "hf")
    step = import_checkpoint(tmp_path / "hf", tmp_path / "run")
    assert step == tmp_path / "run" / "checkpoints" / "step_0000000"
    run = load_run(tmp_path / "run")
    assert run.config.data.tokenizer == str((tmp_path / "run" / "tokenizer").resolve())
    assert run.config.data.seq_len == 64  # at most the model's max_position_embeddings

    # looplm eval: the loss of the transformers model on the same held-out batch
    overrides = [f"data.source={corpus(tmp_path)}", "data.val_fraction=0.3"]
    result = evaluate_run(tmp_path / "run", overrides=overrides, batches=1, batch_size=2)
    data_cfg = eval_data_config(run.config.data, [*overrides, "data.val_batches=1"])
    (inputs, targets), = validation_batches(data_cfg, data_tokenizer(data_cfg), 2)
    with torch.no_grad():
        logits = hf(inputs).logits
        torch.testing.assert_close(run.model(inputs).logits, logits, atol=ATOL, rtol=0)
    expected = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100).item()
    assert result["val_loss"] == pytest.approx(expected, abs=1e-5)

    # looplm generate (greedy): transformers' greedy tokens, decoded by the recorded tokenizer
    prompt = "the loop runs"
    text = generate_text(tmp_path / "run", prompt, max_new_tokens=6, temperature=0.0)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    greedy = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id)
    assert text == prompt + tok.decode(greedy[0, ids.shape[1]:], skip_special_tokens=True)
    # token for token (ids past the word list decode to nothing, so the text alone is weak)
    ours = run.model.generate([ids[0].tolist()], max_new_tokens=6, temperature=0.0, stop_tokens=(tok.eos_token_id,))
    assert list(ours.new_tokens[0]) == greedy[0, ids.shape[1]:].tolist()


def test_imported_ouro_run_gives_the_reference_logits_and_eval_loss(tmp_path):
    hf = {**OURO, "early_exit_threshold": 0.6}
    weights = ouro_weights(hf, seed=3)
    write_checkpoint(tmp_path / "ouro", hf, weights)
    save_tokenizer(tmp_path / "ouro")
    assert main(["import", str(tmp_path / "ouro"), str(tmp_path / "run")]) == 0
    run = load_run(tmp_path / "run")
    assert run.config.model.halting.kind == "exit_gate" and run.config.model.halting.threshold == 0.6
    overrides = [f"data.source={corpus(tmp_path)}", "data.val_fraction=0.3"]
    data_cfg = eval_data_config(run.config.data, [*overrides, "data.val_batches=1"])
    (inputs, targets), = validation_batches(data_cfg, data_tokenizer(data_cfg), 2)
    expected, _ = ouro_logits(weights, hf, inputs, hf["total_ut_steps"], 0.6)
    with torch.no_grad():
        torch.testing.assert_close(run.model(inputs).logits, expected, atol=ATOL, rtol=0)
    result = evaluate_run(tmp_path / "run", overrides=overrides, batches=1, batch_size=2)
    loss = F.cross_entropy(expected.transpose(1, 2), targets, ignore_index=-100).item()
    assert result["val_loss"] == pytest.approx(loss, abs=1e-5)
    text = generate_text(tmp_path / "run", "the loop", max_new_tokens=3, temperature=0.0)
    assert text.startswith("the loop")


def test_an_imported_run_is_not_resumed_and_is_not_overwritten(tmp_path):
    llama(tmp_path / "hf")
    import_checkpoint(tmp_path / "hf", tmp_path / "run")
    state = load_checkpoint(tmp_path / "run").state
    assert state["step"] == 0 and state["optimizer"] is None
    assert state["imported_from"] == str((tmp_path / "hf").resolve()) and state["model_type"] == "llama"
    with pytest.raises(ConfigError, match="out="):
        import_checkpoint(tmp_path / "hf", tmp_path / "run")


def test_a_checkpoint_without_tokenizer_files_needs_a_tokenizer(tmp_path):
    hf = {**OURO, "vocab_size": 300}
    write_checkpoint(tmp_path / "ouro", hf, ouro_weights(hf, seed=1))
    with pytest.raises(ConfigError, match="tokenizer="):
        import_checkpoint(tmp_path / "ouro", tmp_path / "run")
    import_checkpoint(tmp_path / "ouro", tmp_path / "run", tokenizer="byte")
    assert load_run(tmp_path / "run").config.data.tokenizer == "byte"
    small = write_checkpoint(tmp_path / "small", OURO, ouro_weights(OURO, seed=2))
    with pytest.raises(ConfigError, match="model.vocab_size=53"):  # the byte tokenizer's 257 tokens do not fit
        import_checkpoint(small, tmp_path / "run2", tokenizer="byte")
