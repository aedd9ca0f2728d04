"""looplm as an lm-evaluation-harness model: every reported number against an independent
computation from the model's own logits, on local tasks the tests write (no network)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
pytest.importorskip("lm_eval")

from looplm.artifacts import CONFIG_FILE, MODEL_FILE, write_manifest  # noqa: E402
from looplm.cli import main  # noqa: E402
from looplm.config import RunConfig  # noqa: E402
from looplm.data import DataConfig, build_tokenizer  # noqa: E402
from looplm.eval.lm_eval import LoopLMEval, evaluate_tasks  # noqa: E402
from looplm.model import LoopLM  # noqa: E402
from tests.conftest import ladder_config, tiny_config  # noqa: E402

MC = [  # choices of different lengths, so acc and acc_norm can differ
    {"question": "Which is a colour?", "choices": ["red", "a table", "seventeen"], "label": 0},
    {"question": "What do cats say?", "choices": ["woof", "meow", "nothing at all, ever"], "label": 1},
    {"question": "Two plus two?", "choices": ["four", "five", "twenty-two", "4"], "label": 0},
    {"question": "Sky?", "choices": ["blue", "green"], "label": 0},
    {"question": "Opposite of up?", "choices": ["down", "sideways and around"], "label": 0},
]
DOCS = [  # one shorter than the 24-token context of the rolling task, others several windows long
    "short text.",
    "The quick brown fox jumps over the lazy dog.\n\nAnd  then it ran away, far away.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore.",
]
GEN = [
    {"prompt": "Q: colour of the sky?\nA:", "answer": " blue"},
    {"prompt": "Count: one two", "answer": " three"},
    {"prompt": "x", "answer": "y"},
    {"prompt": "The capital of France is", "answer": " Paris"},
    {"prompt": "abc", "answer": "d"},
]
UNTIL = ["\n", "e."]  # one single-token and one two-token stop string under the byte tokenizer
ROLLING_CONTEXT = 24


def _yaml(name: str, data: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """A directory of three lm-eval tasks over local JSONL files."""
    root = tmp_path_factory.mktemp("tasks")
    for name, rows in [("mc", MC), ("docs", [{"text": t} for t in DOCS]), ("gen", GEN)]:
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "mc.yaml").write_text(_yaml("looplm_mc", root / "mc.jsonl", (
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: label\ndoc_to_choice: choices\n"
        "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n")))
    (root / "docs.yaml").write_text(_yaml("looplm_docs", root / "docs.jsonl", (
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}\n"
        "  - {metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}\n"
        "  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}\n")))
    (root / "gen.yaml").write_text(_yaml("looplm_gen", root / "gen.jsonl", (
        "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: answer\n"
        f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - {metric: exact_match, aggregation: mean, higher_is_better: true}\n")))
    return root


def write_run(directory: Path, model: LoopLM, tokenizer: str = "byte") -> Path:
    """A verified checkpoint directory whose run config names ``tokenizer``."""
    model.save_pretrained(directory)
    config = RunConfig(model=model.cfg, data=DataConfig(tokenizer=tokenizer))
    (directory / CONFIG_FILE).write_text(json.dumps(config.to_dict()))
    write_manifest(directory, [MODEL_FILE, CONFIG_FILE])
    return directory


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    """data.tokenizer values: the byte tokenizer, a tokenizers JSON and a transformers directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tokenizers")
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [r["question"] + " " + " ".join(r["choices"]) for r in MC] + DOCS + [g["prompt"] for g in GEN]
    raw.train_from_iterator(corpus * 5, trainer)
    raw.save(str(root / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<pad>")
    fast.save_pretrained(str(root / "hf"))
    return {"byte": "byte", "json": str(root / "tokenizer.json"), "transformers": str(root / "hf")}


def tiny_model(vocab_size: int, seed: int = 0, **fields) -> LoopLM:
    torch.manual_seed(seed)
    fields = {"topology": "anchor", **fields}
    return LoopLM(tiny_config(fields.pop("topology"), vocab_size=vocab_size, max_seq_len=64, **fields)).eval()


# ----------------------------------------------------------------- independent computation
def logprobs(model: LoopLM, inputs: list[int], targets: list[int], iterations=None) -> tuple[float, bool]:
    """Σ log p(targets) and greedy-ness from one plain forward of ``inputs`` alone; the
    targets are the predictions of its last len(targets) positions."""
    with torch.no_grad():
        logits = model(torch.tensor([inputs]), iterations=iterations).logits[0, len(inputs) - len(targets):].float()
    logp = logits.log_softmax(-1).gather(-1, torch.tensor(targets)[:, None]).squeeze(-1)
    return float(logp.sum()), bool((logits.argmax(-1) == torch.tensor(targets)).all())


def choice_logprob(model, tok, context: str, continuation: str, iterations=None, max_length=64) -> float:
    """lm-eval's split of context + continuation into tokens, the context cut from the
    left to ``max_length`` inputs, scored from scratch."""
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return logprobs(model, whole[:-1][-max_length:], whole[len(ctx):], iterations)[0]


def expected_mc(model, tok, iterations=None, max_length=64) -> tuple[float, float, list[list[float]]]:
    acc = norm = 0.0
    lls = []
    for row in MC:
        context = f"Question: {row['question']}\nAnswer:"
        ll = [choice_logprob(model, tok, context, " " + c, iterations, max_length) for c in row["choices"]]
        lls.append(ll)
        acc += max(range(len(ll)), key=ll.__getitem__) == row["label"]
        normed = [v / len(c) for v, c in zip(ll, row["choices"])]
        norm += max(range(len(ll)), key=normed.__getitem__) == row["label"]
    return acc / len(MC), norm / len(MC), lls


def rolling_logprob(model, tok, text: str, context: int) -> float:
    """Each prediction chunk of ``context`` tokens read with as much of the preceding text
    as fits (the first after the end-of-document token), as lm-eval's HF model does."""
    ids = tok.encode(text)
    x = [tok.eos_id, *ids]
    total = 0.0
    for a in range(0, len(ids), context):
        b = min(a + context, len(ids))
        start = max(0, b - context)
        total += logprobs(model, x[start:b], ids[a:b])[0]
    return total


def greedy_text(model, tok, prompt: str, max_tokens: int, until=UNTIL, max_length=64) -> str:
    """Greedy decoding by full forwards (no cache) from the prompt cut from the left to
    leave room for ``max_tokens``, stopped at eos or a stop string."""
    ids = tok.encode(prompt)[-(max_length - max_tokens):]
    out: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        if token == tok.eos_id:
            break
        out.append(token)
        if any(stop in tok.decode(out) for stop in until):
            break
    text = tok.decode(out)
    for stop in until:
        text = text.split(stop, 1)[0]
    return text


# ----------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def byte_runs(tmp_path_factory, tasks) -> dict:
    """One byte-level model evaluated on all three tasks at batch sizes 1 and 4."""
    model = tiny_model(257)
    run = write_run(tmp_path_factory.mktemp("byte") / "run", model)
    results = {bs: evaluate_tasks(run, ["looplm_mc", "looplm_docs", "looplm_gen"], batch_size=bs,
                                  include_path=tasks, max_length=ROLLING_CONTEXT) for bs in (1, 4)}
    return {"model": model, "run": run, "results": results}


def test_batch_size_and_padding_change_no_number(byte_runs):
    one, four = byte_runs["results"][1], byte_runs["results"][4]
    for task in ("looplm_mc", "looplm_docs", "looplm_gen"):
        for key, value in one["results"][task].items():
            if isinstance(value, float):
                assert four["results"][task][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (task, key)
        for a, b in zip(one["samples"][task], four["samples"][task]):
            for ra, rb in zip(a["filtered_resps"], b["filtered_resps"]):
                if isinstance(ra, str):  # generated text
                    assert ra == rb
                elif isinstance(ra, float):  # a document's rolling log-likelihood
                    assert rb == pytest.approx(ra, rel=1e-6)
                else:  # (log-likelihood, is_greedy) of a choice
                    assert float(rb[0]) == pytest.approx(float(ra[0]), rel=1e-6) and rb[1] == ra[1]


def test_multiple_choice_acc_and_acc_norm_equal_the_logits(byte_runs):
    model, tok = byte_runs["model"], build_tokenizer("byte")
    acc, acc_norm, lls = expected_mc(model, tok, max_length=ROLLING_CONTEXT)  # contexts cut from the left
    assert lls != expected_mc(model, tok)[2]
    result = byte_runs["results"][4]
    assert result["results"]["looplm_mc"]["acc,none"] == pytest.approx(acc)
    assert result["results"]["looplm_mc"]["acc_norm,none"] == pytest.approx(acc_norm)
    for sample, expected in zip(sorted(result["samples"]["looplm_mc"], key=lambda s: s["doc_id"]), lls):
        assert [float(r[0]) for r in sample["filtered_resps"]] == pytest.approx(expected, rel=1e-5)


def test_rolling_perplexity_equals_the_summed_token_loss(byte_runs):
    model, tok = byte_runs["model"], build_tokenizer("byte")
    lls = [rolling_logprob(model, tok, text, ROLLING_CONTEXT) for text in DOCS]
    # the short document fits one window: its log-likelihood is one forward's summed loss
    short = [tok.eos_id, *tok.encode(DOCS[0])]
    assert lls[0] == pytest.approx(logprobs(model, short[:-1], short[1:])[0], rel=1e-6)
    result = byte_runs["results"][4]
    samples = sorted(result["samples"]["looplm_docs"], key=lambda s: s["doc_id"])
    assert [float(s["filtered_resps"][0]) for s in samples] == pytest.approx(lls, rel=1e-5)
    words = sum(len(re.split(r"\s+", t)) for t in DOCS)
    nbytes = sum(len(t.encode()) for t in DOCS)
    metrics = result["results"]["looplm_docs"]
    assert metrics["word_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / words), rel=1e-5)
    assert metrics["byte_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / nbytes), rel=1e-5)
    assert metrics["bits_per_byte,none"] == pytest.approx(-sum(lls) / nbytes / math.log(2), rel=1e-5)


def test_generate_until_equals_greedy_decoding_by_full_forwards(byte_runs):
    model, tok = byte_runs["model"], build_tokenizer("byte")
    expected = [greedy_text(model, tok, g["prompt"], 12, max_length=ROLLING_CONTEXT) for g in GEN]
    result = byte_runs["results"][4]
    samples = sorted(result["samples"]["looplm_gen"], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in samples] == expected
    matches = sum(text == g["answer"] for text, g in zip(expected, GEN))
    assert result["results"]["looplm_gen"]["exact_match,none"] == pytest.approx(matches / len(GEN))


def test_stop_strings_of_one_and_several_tokens(byte_runs):
    from lm_eval.api.instance import Instance

    model, tok = byte_runs["model"], build_tokenizer("byte")
    prompts = [g["prompt"] for g in GEN]
    free = [model.generate([tok.encode(p)], max_new_tokens=20, temperature=0).new_tokens[0] for p in prompts]

    def ascii_stop(ids: list[int], n: int) -> str:
        """The first run of n ASCII bytes after the first generated token: a stop string
        the model really writes (ASCII, so that partial UTF-8 cannot fake it)."""
        start = next(i for i in range(1, len(ids)) if all(t < 128 for t in ids[i : i + n]) and len(ids[i:]) >= n)
        return bytes(ids[start : start + n]).decode()

    stops = [[ascii_stop(free[0], 1)], [ascii_stop(free[1], 1)], [ascii_stop(free[2], 2)],
             [ascii_stop(free[3], 2), ascii_stop(free[3], 1)], ["\x00never"]]
    requests = [Instance("generate_until", {}, (p, {"until": u, "max_gen_toks": 20}), i)
                for i, (p, u) in enumerate(zip(prompts, stops))]
    texts = LoopLMEval(byte_runs["run"], batch_size=3).generate_until(requests)
    for text, prompt, until, unstopped in zip(texts, prompts, stops, free):
        assert text == greedy_text(model, tok, prompt, 20, until=until)
        assert tok.decode(unstopped).startswith(text) and not any(stop in text for stop in until)
    assert all(len(text.encode()) < len(ids) for text, ids in zip(texts[:4], free[:4]))  # the stops cut
    assert texts[4] == tok.decode(free[4])


@pytest.mark.parametrize("kind", ["json", "transformers"])
def test_every_tokenizer(kind, tokenizers, tasks, tmp_path):
    tok = build_tokenizer(tokenizers[kind])
    model = tiny_model(tok.vocab_size, seed=1)
    run = write_run(tmp_path / "run", model, tokenizers[kind])
    result = evaluate_tasks(run, ["looplm_mc", "looplm_docs"], batch_size=3, include_path=tasks,
                            max_length=ROLLING_CONTEXT)
    acc, acc_norm, _ = expected_mc(model, tok, max_length=ROLLING_CONTEXT)
    assert result["results"]["looplm_mc"]["acc,none"] == pytest.approx(acc)
    assert result["results"]["looplm_mc"]["acc_norm,none"] == pytest.approx(acc_norm)
    samples = sorted(result["samples"]["looplm_docs"], key=lambda s: s["doc_id"])
    lls = [rolling_logprob(model, tok, text, ROLLING_CONTEXT) for text in DOCS]
    assert [float(s["filtered_resps"][0]) for s in samples] == pytest.approx(lls, rel=1e-5)


def test_iterations_and_step_embeddings(tasks, tmp_path):
    tok = build_tokenizer("byte")
    model = tiny_model(257)
    run = write_run(tmp_path / "anchor", model)
    result = evaluate_tasks(run, ["looplm_mc"], batch_size=4, include_path=tasks, iterations=4)
    acc, acc_norm, lls = expected_mc(model, tok, iterations=4)
    assert result["results"]["looplm_mc"]["acc_norm,none"] == pytest.approx(acc_norm)
    samples = sorted(result["samples"]["looplm_mc"], key=lambda s: s["doc_id"])
    assert [float(r[0]) for r in samples[0]["filtered_resps"]] == pytest.approx(lls[0], rel=1e-5)
    assert lls != expected_mc(model, tok)[2]  # four iterations are not the trained two

    torch.manual_seed(0)
    stepped = LoopLM(ladder_config("tied_step", 3, vocab_size=257)).eval()  # a UT-style loop with e_t
    run = write_run(tmp_path / "ut", stepped)
    result = evaluate_tasks(run, ["looplm_mc"], include_path=tasks, iterations=5, step_embeddings=False)
    stepped.step_embedding.enabled = False
    assert result["results"]["looplm_mc"]["acc_norm,none"] == pytest.approx(expected_mc(stepped, tok, 5)[1])
    with pytest.raises(ValueError, match="iterations=5 is invalid: at most 3 while step embeddings are on"):
        LoopLMEval(run, iterations=5)


@pytest.mark.parametrize("fields", [
    {"layout": "1+1x{1/2,1}+1"},  # multi-resolution: refuses left padding, decoded in equal-length batches
    {"layout": "1+1R3", "step_embeddings": True, "halting": {"kind": "act"}},  # adaptive halting
    {"mixer": {"kind": "gated_deltanet"}},
])
def test_model_families_generate_and_score_in_batches(fields, tasks, tmp_path):
    tok = build_tokenizer("byte")
    model = tiny_model(257, **fields)
    run = write_run(tmp_path / "run", model)
    result = evaluate_tasks(run, ["looplm_mc", "looplm_gen"], batch_size=4, include_path=tasks)
    assert result["results"]["looplm_mc"]["acc_norm,none"] == pytest.approx(expected_mc(model, tok)[1])
    samples = sorted(result["samples"]["looplm_gen"], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in samples] == [greedy_text(model, tok, g["prompt"], 12) for g in GEN]


def test_registered_by_name_for_lm_evals_own_entry_points(byte_runs, tasks):
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model

    assert get_model("looplm") is LoopLMEval
    from looplm.eval.lm_eval import task_manager

    result = simple_evaluate(model="looplm", model_args=f"run={byte_runs['run']},batch_size=2,max_length=24",
                             tasks=["looplm_docs"], task_manager=task_manager(["looplm_docs"], tasks))
    expected = byte_runs["results"][1]["results"]["looplm_docs"]["bits_per_byte,none"]
    assert result["results"]["looplm_docs"]["bits_per_byte,none"] == pytest.approx(expected, rel=1e-6)


def test_cli_writes_the_table_and_json(byte_runs, tasks, tmp_path, capsys):
    out = tmp_path / "results.json"
    args = ["lm-eval", str(byte_runs["run"]), "--tasks", "looplm_mc", "looplm_docs", "--include-path", str(tasks),
            "--batch-size", "4", "--max-length", str(ROLLING_CONTEXT), "--output", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "looplm_mc" in table and "acc_norm" in table and "bits_per_byte" in table
    saved = json.loads(out.read_text())
    expected = byte_runs["results"][4]["results"]
    assert saved["results"]["looplm_mc"]["acc,none"] == pytest.approx(expected["looplm_mc"]["acc,none"])
    assert saved["results"]["looplm_docs"]["word_perplexity,none"] == pytest.approx(
        expected["looplm_docs"]["word_perplexity,none"], rel=1e-6)


def test_bad_input_is_one_error_line(byte_runs, tasks, tmp_path, caplog, monkeypatch):
    import functools

    import looplm.eval.lm_eval as adapter

    # an unknown name is looked up in lm-eval's built-in tasks too; indexing those takes
    # many seconds, and what is tested here is the error, so the index is the local one
    monkeypatch.setattr(adapter, "TaskManager", functools.partial(adapter.TaskManager, include_defaults=False))
    run = str(byte_runs["run"])
    cases = [
        (["--tasks", "no_such_task_xyz", "--include-path", str(tasks)], "tasks=['no_such_task_xyz'] is invalid"),
        (["--tasks", "looplm_mc", "--include-path", str(tmp_path / "nowhere")], "include_path="),
        (["--tasks", "looplm_mc", "--include-path", str(tasks), "--max-length", "999"],
         "max_length=999 is invalid: an integer in [2, model.max_seq_len=64]"),
        (["--tasks", "looplm_mc", "--include-path", str(tasks), "--iterations", "3", "--no-step-embeddings"],
         "step_embeddings=False is invalid"),
    ]
    for extra, message in cases:
        caplog.clear()
        assert main(["lm-eval", run, *extra]) == 2, extra
        assert message in caplog.text, (extra, caplog.text)
    caplog.clear()
    assert main(["lm-eval", str(tmp_path / "no-run"), "--tasks", "looplm_mc", "--include-path", str(tasks)]) == 2
    assert "no checkpoint at" in caplog.text
    with pytest.raises(ValueError, match="batch_size='auto' is invalid: an integer >= 1"):
        LoopLMEval(run, batch_size="auto")
    from lm_eval.api.instance import Instance

    lm = LoopLMEval(run, max_length=16)
    for kwargs, message in [({"beams": 4}, "generation_kwargs={'beams': 4} is invalid: keys among until"),
                            ({"max_gen_toks": 16}, "max_gen_toks=16 is invalid: fewer than max_length=16"),
                            ({"until": [1]}, "until=[1] is invalid: a string or a list of strings")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            lm.generate_until([Instance("generate_until", {}, ("abc", kwargs), 0)])


def test_lm_evals_own_command_line_through_python_m(byte_runs, tasks, tmp_path, monkeypatch, capsys):
    """`python -m looplm.eval.lm_eval ARGS` is lm-eval's CLI with `looplm` registered
    (in-process here; lm-eval's default --device cuda:0 falls back to the CPU)."""
    import functools
    import sys

    import lm_eval.tasks

    from looplm.eval.lm_eval import main as lm_eval_main

    # lm-eval's CLI indexes its ~15k built-in tasks (many seconds); the local tasks suffice here
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager,
                                                                        include_defaults=False))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["lm_eval", "--model", "looplm", "--model_args",
                                      f"run={byte_runs['run']},max_length={ROLLING_CONTEXT}", "--batch_size", "3",
                                      "--tasks", "looplm_docs", "--include_path", str(tasks),
                                      "--output_path", str(tmp_path / "out")])
    lm_eval_main()
    assert "bits_per_byte" in capsys.readouterr().out
    saved = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    expected = byte_runs["results"][1]["results"]["looplm_docs"]["bits_per_byte,none"]
    assert saved["results"]["looplm_docs"]["bits_per_byte,none"] == pytest.approx(expected, rel=1e-6)
