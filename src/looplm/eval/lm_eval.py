"""looplm as a model type of lm-evaluation-harness (``lm-eval``, the ``eval`` extra).

Importing this module registers :class:`LoopLMEval` under the name ``looplm`` in
lm-eval's model registry, so ``lm_eval.simple_evaluate(model="looplm",
model_args="run=RUN,iterations=T")`` works from Python. lm-eval 0.4 has no plugin hook
through which its own ``lm_eval`` command could find an installed package's model, so the
command line goes through this module instead, with lm-eval's arguments unchanged::

    python -m looplm.eval.lm_eval --model looplm --model_args run=RUN,iterations=4 --tasks hellaswag

or through ``looplm lm-eval RUN --tasks ...`` (:func:`evaluate_tasks`); ``--suite NAME``
runs a paper's downstream table (:func:`evaluate_suite`, suites in :mod:`looplm.eval.suites`).

The three request types reduce to looplm's own operations:

- ``loglikelihood``: context + continuation, truncated from the left to the model's
  context, scored by :func:`looplm.eval.scoring.score_windows` (batched, longest first).
- ``loglikelihood_rolling``: the document cut into disjoint windows of the model's
  context, as lm-eval's Hugging Face model does (``get_rolling_token_windows`` with a
  context of 1, ``make_disjoint_window``), the first conditioned on the end-of-document
  token; the sum over windows is the document's log-likelihood.
- ``generate_until``: :meth:`looplm.model.LoopLM.generate` (cached decoding), greedy
  unless the task asks to sample, stopped at the end-of-document token or at any stop
  string, at most ``max_gen_toks`` tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from looplm.config_base import ConfigError
from looplm.data import data_tokenizer
from looplm.errors import LoopLMError, MissingExtra
from looplm.eval.load import LoadedRun, load_run, set_step_embeddings
from looplm.eval.scoring import Window, score_windows
from looplm.eval.suites import Suite, suite_table

try:
    import lm_eval.models  # noqa: F401  (registers lm-eval's own models first: its registry loads them only when empty)
    from lm_eval import simple_evaluate, utils as lm_eval_utils
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry
    from lm_eval.tasks import TaskManager
    from datasets.exceptions import DatasetNotFoundError
except ImportError as err:  # a core install (tests/eval/test_lm_eval_extra.py)
    raise MissingExtra(f"the lm-evaluation-harness adapter needs lm-eval ({err}): pip install 'looplm[eval]'") from err

log = logging.getLogger("looplm")

#: generation settings a task's ``generation_kwargs`` may hold
GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def _integer(field: str, value: Any, minimum: int) -> int:
    """An integer >= minimum from an int or a numeric string (lm-eval's command line
    hands ``--batch_size`` over as text)."""
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field, value, f"an integer >= {minimum}")
    return value


def _device(name: Optional[str]) -> str:
    """The device to load on: ``name``, or the GPU if there is one. lm-eval's command line
    asks for cuda:0 unless told otherwise, so on a machine without CUDA that request falls
    back to the CPU, with a warning."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError("device", name, "a torch device such as cpu, cuda or cuda:1") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        log.warning("device %s is not available (no CUDA): running on the CPU", name)
        return "cpu"
    return str(device)


class LoopLMEval(TemplateLM):
    """A looplm run behind lm-eval's ``LM`` interface.

    run: a run directory, checkpoint or ``save_pretrained`` directory (verified against
    its manifest unless ``verify=False``), or an already loaded :class:`LoadedRun`; its
    data config names the tokenizer (byte, ``tokenizers`` JSON or ``transformers`` dir).
    iterations: loop count (test-time compute; None: as trained). step_embeddings: False
    runs without them (to extrapolate past the trained count). max_length: context in
    tokens (default and maximum model.max_seq_len). max_gen_toks: default generation
    budget when a task gives none. batch_size: sequences per forward. device: where a run
    given by path is loaded (default: the GPU if there is one, else the CPU).
    max_batch_size: accepted because lm-eval always passes it; looplm has no automatic
    batch size, so it is unused.
    """

    def __init__(
        self,
        run: Union[str, Path, LoadedRun],
        iterations: Optional[int] = None,
        step_embeddings: bool = True,
        max_length: Optional[int] = None,
        max_gen_toks: int = 256,
        batch_size: Union[int, str] = 1,
        device: Optional[str] = None,
        verify: bool = True,
        max_batch_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        if not isinstance(step_embeddings, bool):
            raise ConfigError("step_embeddings", step_embeddings, "true or false")
        if not isinstance(verify, bool):
            raise ConfigError("verify", verify, "true or false")
        self._run = run if isinstance(run, LoadedRun) else load_run(run, device=_device(device), verify=verify)
        self.model = self._run.model
        self._device = next(self.model.parameters()).device  # lm-eval's LM.device reads it
        self.looplm_tokenizer = data_tokenizer(self._run.config.data)
        limit = self.model.cfg.max_seq_len
        self.max_length = limit if max_length is None else _integer("max_length", max_length, 2)
        if self.max_length > limit:
            raise ConfigError("max_length", max_length, f"an integer in [2, model.max_seq_len={limit}]")
        self.max_gen_toks = _integer("max_gen_toks", max_gen_toks, 1)
        self.batch_size = _integer("batch_size", batch_size, 1)
        self.iterations = None if iterations is None else _integer("iterations", iterations, 1)
        set_step_embeddings(self.model, step_embeddings)
        with torch.no_grad():  # the model's own checks of `iterations`, before lm-eval builds any request
            self.model(torch.tensor([[self.eot_token_id]], device=self._device), iterations=self.iterations)

    # ------------------------------------------------------------ tokenization
    @property
    def eot_token_id(self) -> int:
        return self.looplm_tokenizer.eos_id

    @property
    def tokenizer_name(self) -> str:
        return self.looplm_tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None) -> list[int]:
        """looplm's tokenizers add no special tokens; the end-of-document token that
        conditions an empty context is added by lm-eval (``prefix_token_id``)."""
        return self.looplm_tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.looplm_tokenizer.decode(tokens)

    # ------------------------------------------------------------ loglikelihood
    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context ids, continuation ids). The last
        max_length + 1 tokens of context + continuation form the window; the continuation
        must fit in it."""
        windows = []
        for (context, continuation), context_ids, continuation_ids in requests:
            if len(continuation_ids) > self.max_length:
                raise LoopLMError(
                    f"a continuation of {len(continuation_ids)} tokens does not fit in the model's context of "
                    f"{self.max_length} tokens (max_length): {continuation[:60]!r}"
                )
            whole = [*context_ids, *continuation_ids][-(self.max_length + 1) :]
            windows.append(Window(tokens=whole, scored=len(continuation_ids)))
        scores = score_windows(self.model, windows, self.batch_size, self.iterations)
        results = []
        for (request, _, _), score in zip(requests, scores):
            results.append((score.logprob, score.greedy))
            self.cache_hook.add_partial("loglikelihood", request, results[-1])
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Σ log p of each document, scored in disjoint windows of max_length tokens."""
        windows, owners = [], []
        for i, (text,) in enumerate(request.args for request in requests):
            pairs = lm_eval_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )
            for context, predicted in map(lm_eval_utils.make_disjoint_window, pairs):
                windows.append(Window(tokens=[*context, *predicted], scored=len(predicted)))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, score in zip(owners, score_windows(self.model, windows, self.batch_size, self.iterations)):
            totals[owner] += score.logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------ generation
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation settings are decoded together, longest
        prompt first; a multi-resolution model (which refuses left padding) decodes
        only prompts of equal length together."""
        prepared = [self._generation_request(*request.args) for request in requests]
        equal_lengths = any(r != 1 for r in self.model.cfg.parsed_layout.resolutions)
        groups: dict[tuple[Generation, int], list[int]] = {}
        for i, (ids, settings) in enumerate(prepared):
            groups.setdefault((settings, len(ids) if equal_lengths else 0), []).append(i)
        outputs: list[str] = [""] * len(requests)
        for (settings, _), members in groups.items():
            members.sort(key=lambda i: len(prepared[i][0]), reverse=True)
            for start in range(0, len(members), self.batch_size):
                batch = members[start : start + self.batch_size]
                texts = self._generate([prepared[i][0] for i in batch], settings)
                for i, text in zip(batch, texts):
                    outputs[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return outputs

    def _generation_request(self, context: str, gen_kwargs: dict[str, Any]) -> tuple[list[int], "Generation"]:
        """Prompt ids (truncated from the left to leave room for the generated tokens) and
        the validated settings of one request."""
        unknown = sorted(set(gen_kwargs) - set(GENERATION_KEYS))
        if unknown:
            raise ConfigError("generation_kwargs", {k: gen_kwargs[k] for k in unknown},
                              f"keys among {', '.join(GENERATION_KEYS)}")
        until = gen_kwargs.get("until", [])
        until = [until] if isinstance(until, str) else list(until)
        if not all(isinstance(stop, str) for stop in until):
            raise ConfigError("until", until, "a string or a list of strings")
        budget = _integer("max_gen_toks", gen_kwargs.get("max_gen_toks", self.max_gen_toks), 1)
        if budget >= self.max_length:
            raise ConfigError("max_gen_toks", budget, f"fewer than max_length={self.max_length} tokens, to leave room "
                              "for the prompt")
        temperature = float(gen_kwargs.get("temperature", 0.0))
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ConfigError("temperature", temperature, "a number >= 0 (0 is greedy)")
        sample = bool(gen_kwargs.get("do_sample", False)) and temperature > 0
        settings = Generation(
            until=tuple(stop for stop in until if stop), max_gen_toks=budget, temperature=temperature if sample else 0.0,
            top_k=gen_kwargs.get("top_k") if sample else None, top_p=gen_kwargs.get("top_p") if sample else None,
        )
        ids = self.tok_encode(context)[-(self.max_length - budget) :] or [self.eot_token_id]
        return ids, settings

    def _generate(self, prompts: list[list[int]], settings: "Generation") -> list[str]:
        """Decode a batch; stop strings that are one token stop decoding early, longer
        ones are cut from the text (the cut is the same either way)."""
        stop_ids = {self.eot_token_id}
        for stop in settings.until:
            ids = self.tok_encode(stop)
            if len(ids) == 1 and self.tok_decode(ids) == stop:
                stop_ids.add(ids[0])
        out = self.model.generate(
            prompts, max_new_tokens=settings.max_gen_toks, temperature=settings.temperature, top_k=settings.top_k,
            top_p=settings.top_p, stop_tokens=sorted(stop_ids), pad_token_id=self.looplm_tokenizer.pad_id,
            iterations=self.iterations,
        )
        return [_cut(self.tok_decode(tokens), settings.until) for tokens in out.new_tokens]


@dataclasses.dataclass(frozen=True)
class Generation:
    """The decoding settings of a ``generate_until`` request (hashable: requests that
    share them are batched). temperature 0 is greedy; top_k / top_p apply when sampling."""

    until: tuple[str, ...]
    max_gen_toks: int
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]


# By name, not by class: `python -m looplm.eval.lm_eval` runs this file as __main__ and
# lm-eval then imports it again as looplm.eval.lm_eval; both register the same name.
model_registry.register("looplm", target=f"{__spec__.name}:LoopLMEval")


def _cut(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    for stop in until:
        text = text.split(stop, 1)[0]
    return text


# ---------------------------------------------------------------- running tasks
def task_manager(tasks: Sequence[str], include_path: Optional[str | Path] = None) -> TaskManager:
    """lm-eval's task index: the tasks of ``include_path`` alone when they cover every
    requested task (indexing lm-eval's ~15k built-in task configs takes many seconds),
    else with the built-in tasks. An unknown task name is an error naming it."""
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ConfigError("include_path", str(include_path), "a directory of lm-eval task YAML files")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(local.match_tasks(list(tasks))) >= set(tasks):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    missing = sorted(set(tasks) - set(manager.match_tasks(list(tasks))))
    if missing:
        where = "lm-eval's tasks" + ("" if include_path is None else f" or {include_path}")
        raise ConfigError("tasks", missing, f"task or group names found in {where} (lm-eval ls tasks lists them)")
    return manager


class MissingData(LoopLMError):
    """A task's dataset cannot be loaded here (no network, not in the cache, a missing file)."""


def evaluate_tasks(
    run: Union[str, Path, LoadedRun],
    tasks: Sequence[str],
    *,
    num_fewshot: Optional[int] = None,
    batch_size: int = 1,
    iterations: Optional[int] = None,
    step_embeddings: bool = True,
    limit: Optional[int] = None,
    include_path: Optional[str | Path] = None,
    max_length: Optional[int] = None,
    verify: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of a run on ``tasks``: its results dictionary
    (``results[task][metric + ",none"]``, configs, versions, n-shot), samples included."""
    if not tasks:
        raise ConfigError("tasks", list(tasks), "at least one task name")
    manager = task_manager(tasks, include_path)
    model = LoopLMEval(run, iterations=iterations, step_embeddings=step_embeddings, max_length=max_length,
                       batch_size=batch_size, verify=verify)
    try:
        return simple_evaluate(
            model=model, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, task_manager=manager,
            log_samples=True, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except (ConnectionError, FileNotFoundError, DatasetNotFoundError) as err:  # `datasets` offline or a missing file
        raise MissingData(
            f"a task's dataset is not available here: {err}. Provide it: run once where there is network (lm-eval "
            "downloads it into the Hugging Face cache, HF_HOME) and rerun with HF_DATASETS_OFFLINE=1 and that "
            "cache; or write a task YAML over local files (dataset_path: json, dataset_kwargs: {data_files: ...}) "
            "and pass its directory as include_path (--include-path)"
        ) from err



def evaluate_suite(
    run: Union[str, Path, LoadedRun],
    suite: Suite,
    *,
    batch_size: int = 1,
    iterations: Optional[int] = None,
    step_embeddings: bool = True,
    limit: Optional[int] = None,
    include_path: Optional[str | Path] = None,
    max_length: Optional[int] = None,
    verify: bool = True,
    seed: int = 0,
) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """A paper's suite (:data:`looplm.eval.suites.SUITES`): lm-eval on its tasks once per
    shot count, then its table in the paper's layout (:func:`looplm.eval.suites.suite_table`).
    Returns the table and lm-eval's results per shot count."""
    if not isinstance(run, LoadedRun):  # loaded once for every shot count
        run = load_run(run, device=_device(None), verify=verify)
    results = {}
    for shots in suite.shots:
        try:
            results[shots] = evaluate_tasks(
                run, suite.tasks, num_fewshot=shots, batch_size=batch_size, iterations=iterations,
                step_embeddings=step_embeddings, limit=limit, include_path=include_path, max_length=max_length,
                seed=seed,
            )
        except MissingData as err:
            datasets = "; ".join(f"{c.header} ({', '.join(c.tasks)}): {c.dataset}" for c in suite.columns)
            raise MissingData(f"{err}. Suite {suite.name} reads {datasets}") from err.__cause__
    return suite_table(suite, results), results


def results_table(results: dict[str, Any]) -> str:
    """lm-eval's own markdown table of the metrics (and of the groups, if any)."""
    table = lm_eval_utils.make_table(results)
    return table + ("\n" + lm_eval_utils.make_table(results, "groups") if results.get("groups") else "")


def write_results(results: dict[str, Any], path: str | Path) -> None:
    """The results as JSON (lm-eval's serialisation of numpy values and functions)."""
    text = json.dumps(results, indent=2, default=lm_eval_utils.handle_non_serializable, ensure_ascii=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n", encoding="utf-8")


def main() -> None:
    """``lm_eval``'s own command line, with ``--model looplm`` registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
