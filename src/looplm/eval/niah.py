"""Needle in a haystack: RULER's NIAH-single-1/2/3, generated locally and scored by exact match.

LT2 (lt2.txt, "Long-context evaluation", Table "long-context") reports NIAH-Single-1/2/3
of RULER (Hsieh et al., 2024) at 1024, 2048 and 4096 tokens, models trained at 2048.
RULER's three single-needle tasks differ in the haystack and in the value hidden:

| task | haystack | key | value |
| --- | --- | --- | --- |
| ``niah_single_1`` | one noise passage repeated ("The grass is green. ...") | a word | a 7-digit number |
| ``niah_single_2`` | essays (RULER: Paul Graham's; here any local corpus, default pydoc) | a word | a 7-digit number |
| ``niah_single_3`` | essays | a word | a UUID |

The prompt is RULER's base-model template (``scripts/data/synthetic/constants.py``): an
instruction, the haystack with the needle "One of the special magic numbers for KEY is:
VALUE." inserted between two sentences at the requested depth, the question, and the
answer prefix the model continues. As in RULER, a length L counts the prompt *and* the
answer budget, so an example of length L fits a model with ``max_seq_len = L``; the
prompt is the longest that fits: it has at most L - budget tokens, and fewer by less than
one haystack sentence (:data:`MAX_SENTENCE_CHARS` characters) plus a space.

Generation of examples is a pure function of (task, length, depth, index, seed); scoring
(:func:`exact_match`) is separate from running a model (:func:`evaluate_niah`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Optional

from looplm.config_base import ConfigError
from looplm.data import DataConfig
from looplm.data.sources import iter_documents
from looplm.data.tokenizer import Tokenizer
from looplm.model import LoopLM

# ---------------------------------------------------------------- the tasks as data
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."  # RULER's noise
TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What are all the special magic {kind} for {key} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {kind} for {key} mentioned in the provided text are"
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
#: characters per haystack sentence at most (a longer word stays whole): longer corpus
#: sentences are cut at spaces, which bounds how far below its target an example can fall
MAX_SENTENCE_CHARS = 96
#: RULER's default depths (percent of the haystack before the needle), here five of them
DEFAULT_DEPTHS = (0, 25, 50, 75, 100)
DEFAULT_LENGTHS = (1024, 2048, 4096)

# Keys are hyphenated adjective-noun pairs, as RULER draws them from `wonderwords`.
_ADJECTIVES = (
    "ancient", "brave", "calm", "curious", "eager", "fancy", "gentle", "happy", "hidden", "jolly", "kind",
    "lively", "mellow", "nimble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "vivid", "witty",
    "young", "zealous", "bitter", "bold", "cheerful", "damp", "fierce", "golden", "humble", "icy",
)
_NOUNS = (
    "anchor", "badger", "canyon", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
    "kettle", "lantern", "meadow", "needle", "orchard", "pebble", "quartz", "river", "saddle", "tunnel",
    "umbrella", "valley", "walnut", "yarn", "zephyr", "beacon", "candle", "dune", "ember", "forest",
    "glacier", "hammer",
)


@dataclasses.dataclass(frozen=True)
class NiahTask:
    """One of RULER's single-needle tasks: which haystack, which kind of value."""

    name: str
    haystack: Literal["repeat", "essay"]
    value: Literal["number", "uuid"]

    @property
    def kind(self) -> str:
        """The plural noun of the template ("numbers", "uuids"), as RULER writes it."""
        return {"number": "numbers", "uuid": "uuids"}[self.value]


TASKS = {
    "niah_single_1": NiahTask("niah_single_1", haystack="repeat", value="number"),
    "niah_single_2": NiahTask("niah_single_2", haystack="essay", value="number"),
    "niah_single_3": NiahTask("niah_single_3", haystack="essay", value="uuid"),
}


@dataclasses.dataclass(frozen=True)
class Example:
    """One generated prompt. ``depth`` is the requested percent, ``needle_depth`` the share
    of the haystack's characters before the needle (what the model sees)."""

    task: str
    length: int
    depth: int
    index: int
    key: str
    value: str
    prompt: str
    prompt_tokens: int
    budget: int
    needle_depth: float


# ---------------------------------------------------------------- generation (pure)
def haystack_sentences(source: str) -> list[str]:
    """The sentences of a corpus (anything ``data.source`` accepts, e.g. ``pydoc`` or a
    ``.txt`` path), whitespace collapsed, long ones cut at spaces to :data:`MAX_SENTENCE_CHARS`."""
    sentences = []
    for document in iter_documents(DataConfig(source=source)):
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(document.split())):
            piece = ""
            for word in sentence.split():  # greedy: pieces of whole words, each at most MAX_SENTENCE_CHARS
                if piece and len(piece) + 1 + len(word) > MAX_SENTENCE_CHARS:
                    sentences.append(piece)
                    piece = ""
                piece = f"{piece} {word}" if piece else word
            sentences += [piece] if piece else []
    if not sentences:
        raise ConfigError("haystack", f"essay:{source}", "a corpus with some text in it")
    return sentences


def _needle(task: NiahTask, rng: random.Random) -> tuple[str, str]:
    """A key (adjective-noun) and a value (7-digit number, or UUID) drawn from ``rng``."""
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    if task.value == "number":
        return key, str(rng.randint(10**6, 10**7 - 1))  # RULER: randint(10**6, 10**7 - 1)
    return key, str(uuid.UUID(int=rng.getrandbits(128), version=4))


def answer_budget(tokenizer: Tokenizer, value: str) -> int:
    """Tokens the model may generate: the value, its period and a little slack."""
    return len(tokenizer.encode(f" {value}.")) + 4


def make_example(
    task: NiahTask,
    tokenizer: Tokenizer,
    length: int,
    depth: int,
    index: int,
    seed: int = 0,
    essay: Sequence[str] = (),
) -> Example:
    """The ``index``-th example of ``task`` at ``length`` tokens (prompt + answer budget),
    its needle at the sentence boundary closest to ``depth`` percent of the haystack's
    characters. ``essay``: the corpus sentences of the essay tasks
    (:func:`haystack_sentences`). Same arguments, same example."""
    if not 0 <= depth <= 100:
        raise ConfigError("depths", depth, "percentages in [0, 100]")
    rng = random.Random(f"{seed}/{task.name}/{length}/{depth}/{index}")
    key, value = _needle(task, rng)
    if task.haystack == "repeat":
        pool = re.split(r"(?<=\.)\s+", NOISE)
        start = 0
    else:
        if not essay:
            raise ConfigError("essay", [], f"the corpus sentences {task.name} draws its haystack from")
        pool, start = list(essay), rng.randrange(len(essay))
    fill = {"kind": task.kind, "key": key}
    needle = NEEDLE.format(value=value, **fill)
    budget = answer_budget(tokenizer, value)
    target = length - budget

    def build(n: int) -> tuple[str, float]:
        sentences = [pool[(start + i) % len(pool)] for i in range(n)]
        ends = [0]  # characters before the needle if it goes in after sentence k (joined by spaces)
        for sentence in sentences:
            ends.append(ends[-1] + len(sentence) + (1 if ends[-1] else 0))
        at = min(range(n + 1), key=lambda k: abs(ends[k] - depth / 100 * ends[-1]))  # the closest sentence boundary
        before, after = " ".join(sentences[:at]), " ".join(sentences[at:])
        context = " ".join(part for part in (before, needle, after) if part)
        haystack_chars = len(before) + len(after)
        prompt = TEMPLATE.format(context=context, **fill) + ANSWER_PREFIX.format(**fill)
        return prompt, (len(before) / haystack_chars if haystack_chars else 0.0)

    def tokens(n: int) -> int:
        return len(tokenizer.encode(build(n)[0]))

    if tokens(0) > target:
        raise ConfigError("lengths", length, f"at least {tokens(0) + budget} tokens: the template, needle and answer "
                          f"of {task.name} alone take that many (--lengths)")
    lo, hi = 0, 1  # the largest n with tokens(n) <= target, by doubling then bisection
    while tokens(hi) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tokens(mid) <= target else (lo, mid)
    prompt, needle_depth = build(lo)
    return Example(task=task.name, length=length, depth=depth, index=index, key=key, value=value, prompt=prompt,
                   prompt_tokens=len(tokenizer.encode(prompt)), budget=budget, needle_depth=needle_depth)


# ---------------------------------------------------------------- scoring (pure)
def generated_value(text: str) -> str:
    """The value a continuation of the answer prefix states: its first word, without the
    sentence's closing punctuation (" 1234567." -> "1234567")."""
    words = text.split()
    return words[0].rstrip(".,;:!?") if words else ""


def exact_match(text: str, value: str) -> bool:
    """Whether the generated text states exactly the needle's value."""
    return generated_value(text) == value


# ---------------------------------------------------------------- running a model
@dataclasses.dataclass
class NiahResult:
    """Per example: the generated text and whether it matched; ``cells`` aggregates them by
    (task, length, depth)."""

    tasks: list[str]
    lengths: list[int]
    depths: list[int]
    samples: int
    seed: int
    haystack: str
    examples: list[dict[str, Any]]

    def accuracy(self, task: str, length: Optional[int] = None, depth: Optional[int] = None) -> float:
        """Percent correct over the examples of ``task`` (at ``length`` and ``depth`` if given)."""
        hits = [e["correct"] for e in self.examples if e["task"] == task
                and length in (None, e["length"]) and depth in (None, e["depth"])]
        return 100.0 * sum(hits) / len(hits)

    def cells(self) -> list[dict[str, Any]]:
        """Accuracy per (task, length, depth), the heat-map's cells."""
        return [{"task": t, "length": n, "depth": d, "accuracy": self.accuracy(t, n, d)}
                for t in self.tasks for n in self.lengths for d in self.depths]

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "cells": self.cells(),
                "summary": {t: {str(n): self.accuracy(t, n) for n in self.lengths} for t in self.tasks}}


def parse_haystack(spec: str) -> Optional[str]:
    """``repeat`` (None: every task uses the repeated noise) or ``essay:SOURCE`` (the
    essay tasks' corpus: ``pydoc`` or anything ``data.source`` accepts)."""
    if spec == "repeat":
        return None
    if spec.startswith("essay:") and len(spec) > len("essay:"):
        return spec[len("essay:") :]
    raise ConfigError("haystack", spec, "'repeat' or 'essay:SOURCE' (SOURCE: pydoc, a .txt/.jsonl/.parquet file or "
                      "folder, hf:NAME)")


def _check_grid(model: LoopLM, tasks: Sequence[str], lengths: Sequence[int], depths: Sequence[int],
                samples: int) -> None:
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        raise ConfigError("tasks", list(tasks), f"names among {', '.join(TASKS)}")
    limit = model.cfg.max_seq_len
    too_long = [n for n in lengths if n > limit]
    if not lengths or too_long:
        raise ConfigError("lengths", list(lengths), f"token counts <= model.max_seq_len={limit} (--lengths): a longer "
                          "prompt does not fit the model's context")
    if not depths or any(not 0 <= d <= 100 for d in depths):
        raise ConfigError("depths", list(depths), "percentages in [0, 100] (--depths)")
    if samples < 1:
        raise ConfigError("samples", samples, "an integer >= 1 (--samples)")


def evaluate_niah(
    model: LoopLM,
    tokenizer: Tokenizer,
    *,
    tasks: Sequence[str] = tuple(TASKS),
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    samples: int = 10,
    haystack: str = "essay:pydoc",
    seed: int = 0,
    iterations: Optional[int] = None,
    batch_size: int = 1,
) -> NiahResult:
    """Greedy answers of ``model`` (cached ``generate``) to ``samples`` examples per task,
    length and depth, each scored by :func:`exact_match`. Examples of one cell are
    decoded together, left-padded (one at a time for a multi-resolution model, which
    refuses left padding)."""
    _check_grid(model, tasks, lengths, depths, samples)
    source = parse_haystack(haystack)
    essay = haystack_sentences(source) if source is not None and any(TASKS[t].haystack == "essay" for t in tasks) else ()
    multires = any(r != 1 for r in model.cfg.parsed_layout.resolutions)
    step = 1 if multires else max(1, batch_size)
    records = []
    for name in tasks:
        task = TASKS[name] if source is not None else dataclasses.replace(TASKS[name], haystack="repeat")
        for length in lengths:
            for depth in depths:
                cell = [make_example(task, tokenizer, length, depth, i, seed, essay) for i in range(samples)]
                for start in range(0, samples, step):
                    batch = cell[start : start + step]
                    out = model.generate(  # every example leaves at least its own budget free in `length`
                        [tokenizer.encode(e.prompt) for e in batch],
                        max_new_tokens=min(e.length - e.prompt_tokens for e in batch),
                        temperature=0.0, stop_tokens=[tokenizer.eos_id], pad_token_id=tokenizer.pad_id,
                        iterations=iterations,
                    )
                    for example, ids in zip(batch, out.new_tokens):
                        text = tokenizer.decode([t for t in ids if t != tokenizer.eos_id])
                        fields = {k: v for k, v in dataclasses.asdict(example).items() if k != "prompt"}
                        records.append({**fields, "generated": text, "correct": exact_match(text, example.value)})
    return NiahResult(tasks=list(tasks), lengths=list(lengths), depths=list(depths), samples=samples, seed=seed,
                      haystack=haystack, examples=records)


# ---------------------------------------------------------------- reporting
def markdown_table(result: NiahResult) -> str:
    """LT2's layout (one column per task and length, accuracy in percent averaged over
    depths), then one depth-by-length table per task."""
    head = [f"{t} {n}" for t in result.tasks for n in result.lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head),
             "| " + " | ".join(f"{result.accuracy(t, n):.1f}" for t in result.tasks for n in result.lengths) + " |"]
    for task in result.tasks:
        lines += ["", f"**{task}** (accuracy %, {result.samples} samples per cell)", "",
                  "| depth % | " + " | ".join(str(n) for n in result.lengths) + " |",
                  "| --- |" + " --- |" * len(result.lengths)]
        lines += [f"| {d} | " + " | ".join(f"{result.accuracy(task, n, d):.1f}" for n in result.lengths) + " |"
                  for d in result.depths]
    return "\n".join(lines) + "\n"


def heatmap(plt, result: NiahResult):
    """One depth-by-length panel per task, accuracy 0-100 % (the usual NIAH figure)."""
    fig, axes = plt.subplots(1, len(result.tasks), figsize=(3.2 * len(result.tasks), 3.0), squeeze=False)
    for ax, task in zip(axes[0], result.tasks):
        grid = [[result.accuracy(task, n, d) for n in result.lengths] for d in result.depths]
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        ax.set_xticks(range(len(result.lengths)), [str(n) for n in result.lengths])
        ax.set_yticks(range(len(result.depths)), [str(d) for d in result.depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(task, fontsize=9)
    axes[0][0].set_ylabel("needle depth (%)")
    fig.colorbar(im, ax=list(axes[0]), label="exact match (%)")
    return fig


def write_results(result: NiahResult, out: str | Path, figures: bool = True) -> list[Path]:
    """``niah.md``, ``niah.json`` and (``figures``) ``niah.png`` in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "niah.md", out / "niah.json"]
    written[0].write_text(markdown_table(result), encoding="utf-8")
    written[1].write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    if figures:
        from looplm.probes.plots import pyplot

        plt = pyplot()
        fig = heatmap(plt, result)
        fig.savefig(out / "niah.png", dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(out / "niah.png")
    return written
