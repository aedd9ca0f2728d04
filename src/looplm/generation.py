"""Autoregressive decoding for :class:`~looplm.model.LoopLM` (``model.generate``): greedy
or sampled, batched.

Prompts of different lengths are left-padded so that every row's last prompt token sits
in the last column. One prefill forward fills a :class:`~looplm.cache.LoopCache` (which
remembers which key positions are padding and each row's next position id); each new
token is then one forward of ``[B, 1]`` tokens against that cache. The test-time loop
count ``iterations`` goes to every forward, so the cache is filled and read at one count.

Sampling order follows Hugging Face ``transformers``: logits / temperature -> top-k ->
top-p (nucleus) -> softmax -> draw.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from looplm.cache import LoopCache, NotStatic
from looplm.config_base import ConfigError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GenerationOutput:
    """sequences: [B, T + N] long, the (left-padded) prompts followed by the N generated
    columns; rows that stopped early carry ``pad_token_id`` after their stop token.
    new_tokens: per row, the generated ids up to and including the stop token (no
    trailing padding). finished: [B] bool, True where the row emitted a stop token.
    block_passes_per_token: block evaluations per real position processed (prompt and
    generated), catch-up included, summed from every forward's output: below the model's C
    when adaptive halting stops early (None for a dense model)."""

    sequences: torch.Tensor
    new_tokens: list[list[int]]
    finished: torch.Tensor
    block_passes_per_token: Optional[float] = None


def _invalid(name: str, value: Any, allowed: str) -> ConfigError:
    """An invalid argument: its name, the value and what is allowed (a ValueError)."""
    return ConfigError(name, value, allowed)


# ----------------------------------------------------------------- inputs
def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: Union[str, torch.device, None] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists to one batch.

    Returns input_ids [B, T_max] (long) and attention_mask [B, T_max] (long; 1 for real
    tokens, 0 for the padding on the left), T_max the longest prompt.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise _invalid("input_ids", prompts, "a non-empty list of lists of token ids, or a LongTensor [B, T]")
    rows = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise _invalid(f"input_ids[{i}]", prompt, "a list of token ids (int)")
        if len(prompt) == 0:
            raise _invalid(f"input_ids[{i}]", list(prompt), "a non-empty prompt (at least one token)")
        if not all(isinstance(tok, int) and not isinstance(tok, bool) for tok in prompt):
            raise _invalid(f"input_ids[{i}]", list(prompt), "a list of token ids (int)")
        rows.append(list(prompt))
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def _check_mask(mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Validate a user attention mask (0/1, left padding only, no empty row); return it as bool."""
    if mask.shape != input_ids.shape:
        raise _invalid(
            "attention_mask", f"<tensor of shape {tuple(mask.shape)}>", f"a tensor of input_ids' shape {tuple(input_ids.shape)}"
        )
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
            raise _invalid("attention_mask", "<tensor>", "a bool or integer tensor of 0 (left padding) and 1 (real tokens)")
        mask = mask.bool()
    empty = (~mask.any(dim=1)).nonzero()
    if len(empty):
        row = int(empty[0])
        raise _invalid("attention_mask", f"<row {row} all zeros>", "at least one real token (1) in every row: empty prompts cannot be continued")
    # Left padding means each row is 0...0 1...1: the mask never falls from 1 to 0.
    falls = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1).nonzero()
    if len(falls):
        row = int(falls[0])
        raise _invalid(
            "attention_mask",
            f"<row {row}: {mask[row].long().tolist()}>",
            "left padding only (0s before the 1s of each row); right padding is not supported, "
            "pad on the left (e.g. with looplm.generation.left_pad)",
        )
    return mask


def _prepare_inputs(
    input_ids: Union[torch.Tensor, Sequence[Sequence[int]]],
    attention_mask: Optional[torch.Tensor],
    pad_token_id: int,
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] long and bool attention_mask [B, T] on ``device``, validated."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.shape[0] == 0:
            raise _invalid(
                "input_ids", f"<tensor of shape {tuple(input_ids.shape)}>", "a tensor [B, T] with B >= 1 (use input_ids[None] for one prompt)"
            )
        if input_ids.shape[1] == 0:
            raise _invalid("input_ids", f"<tensor of shape {tuple(input_ids.shape)}>", "a non-empty prompt (T >= 1)")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise _invalid("input_ids", f"<{input_ids.dtype} tensor>", "an integer tensor of token ids")
        ids = input_ids.to(device=device, dtype=torch.long)
        mask = (
            torch.ones_like(ids, dtype=torch.bool)
            if attention_mask is None
            else _check_mask(torch.as_tensor(attention_mask).to(device), ids)
        )
    else:
        if attention_mask is not None:
            raise _invalid(
                "attention_mask", "<given>", "None when input_ids is a list of prompts (the mask is built by left-padding)"
            )
        ids, mask = left_pad(input_ids, pad_token_id, device)
        mask = mask.bool()
    if bool(((ids < 0) | (ids >= vocab_size)).any()):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise _invalid("input_ids", f"<contains {bad}>", f"token ids in [0, {vocab_size}) (model.vocab_size={vocab_size})")
    return ids, mask


# ---------------------------------------------------------------- sampling
def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (exactly k, ties broken by ``torch.topk``);
    the rest become -inf. logits: [B, V] -> [B, V]."""
    k = min(k, logits.shape[-1])
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(k, dim=-1).indices, True)
    return logits.masked_fill(~keep, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most probable tokens whose total
    probability is >= p (the most probable token always stays); the rest become -inf.
    logits: [B, V] -> [B, V]."""
    if p >= 1.0:
        return logits  # everything; avoids dropping tail tokens through float round-off
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token in the ranking
    drop_sorted = before >= p  # the set above already reaches p, so this token is not needed
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_token(
    logits: torch.Tensor,
    *,
    sample: bool,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Choose one token per row from last-position logits [B, V]; returns [B] long.
    Greedy (argmax) unless ``sample``; sampling applies temperature -> top-k -> top-p."""
    logits = logits.float()
    if not sample:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


# -------------------------------------------------------------- generation
def _stop_ids(stop_tokens: Union[int, Iterable[int]], vocab_size: int) -> list[int]:
    items = [stop_tokens] if isinstance(stop_tokens, int) and not isinstance(stop_tokens, bool) else stop_tokens
    try:
        ids = list(items)
    except TypeError:
        raise _invalid("stop_tokens", stop_tokens, "a token id or a collection of token ids") from None
    for tok in ids:
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise _invalid("stop_tokens", stop_tokens, f"token ids (int) in [0, {vocab_size})")
    return ids


def _check_options(
    max_new_tokens: int, temperature: float, top_k: Optional[int], top_p: Optional[float], pad_token_id: int, vocab_size: int
) -> None:
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise _invalid("max_new_tokens", max_new_tokens, "an integer >= 0")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise _invalid("temperature", temperature, "a number >= 0 (0 means greedy)")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise _invalid("top_k", top_k, "None or an integer >= 1")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise _invalid("top_p", top_p, "None or a number in (0, 1]")
    if not is_int(pad_token_id) or not 0 <= pad_token_id < vocab_size:
        raise _invalid("pad_token_id", pad_token_id, f"a token id in [0, {vocab_size}) (model.vocab_size={vocab_size})")


def generate(
    model: nn.Module,
    input_ids: Union[torch.Tensor, Sequence[Sequence[int]]],
    *,
    attention_mask: Optional[torch.Tensor] = None,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    do_sample: Optional[bool] = None,
    stop_tokens: Union[int, Iterable[int]] = (),
    pad_token_id: int = 0,
    iterations: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    compile: Union[bool, dict, str] = False,
) -> GenerationOutput:
    """Continue each prompt by up to ``max_new_tokens`` tokens of ``model`` (a
    :class:`~looplm.model.LoopLM`; this is its ``generate`` method) through the decoding cache.

    input_ids: LongTensor [B, T], optionally with attention_mask [B, T] (1 real token, 0
    left padding; right padding is refused), or a list of B token-id lists of any lengths,
    which are left-padded with ``pad_token_id``.

    Decoding is greedy (argmax) when ``do_sample`` is False or ``temperature == 0``, and
    sampled otherwise; ``do_sample=None`` means "sample iff temperature > 0", so the
    defaults sample at temperature 1 and ``temperature=0`` is greedy. When sampling, the
    logits are divided by ``temperature`` and then filtered by ``top_k`` and ``top_p``
    (in that order); both are ignored when greedy. ``generator`` makes draws reproducible.

    A row finishes after it emits any of ``stop_tokens`` (kept in the output) and emits
    ``pad_token_id`` from then on; decoding ends when every row has finished.
    ``iterations`` is the loop count of every forward (test-time compute; the model
    refuses counts its topology cannot run). The model runs in eval mode without
    gradients; its training flag is restored afterwards.

    ``compile``: decode through one captured step (``torch.compile(fullgraph=True)``; on
    CUDA with ``mode="reduce-overhead"``, so each token is one CUDA-graph replay) over a
    static cache preallocated for the prompt and ``max_new_tokens``; a dict is passed to
    ``torch.compile`` as options (e.g. ``{"backend": "aot_eager"}``). The numbers are the
    eager path's. Each block pass of the step is one nested compile region, compiled once
    for every pass alike, so the backend's work does not grow with the loop's depth
    (Dynamo's tracing still does; :mod:`looplm.modules.region`; ``{"block_regions": False}`` in the dict compiles the
    unrolled step instead, and a step whose regions cannot be captured falls back to it,
    logged). Multi-resolution iterations (SpiralFormer) capture one graph per set of
    iterations whose chunk completes at the new position (the coarse core runs there), a
    host-side phase, and decode eagerly until every iteration's first chunk has completed.
    A cache with no static form decodes eagerly instead, and the reason is logged. The
    prompt's prefill always runs eagerly.

    ``compile="cuda-graph"``: no torch.compile; the eager decoding step on the static cache
    is recorded as a CUDA graph and replayed (:class:`_GraphedStep`). Recording costs one
    step whatever the loop's depth (torch.compile traces every block pass of every iteration),
    and flash-linear-attention's kernels, which torch.compile does not trace, run inside the
    graph. On a CPU the static step runs eagerly (logged).

    Host syncs: none per token for greedy decoding; with ``stop_tokens``, one read every
    ``STOP_CHECK_EVERY`` tokens of whether every row has stopped.
    """
    cfg = model.cfg
    _check_options(max_new_tokens, temperature, top_k, top_p, pad_token_id, cfg.vocab_size)
    if do_sample is not None and not isinstance(do_sample, bool):
        raise _invalid("do_sample", do_sample, "None, True or False")
    if compile is not None and not isinstance(compile, (bool, dict)) and compile != CUDA_GRAPH:
        raise _invalid("compile", compile, f"True, False, a dict of torch.compile options or {CUDA_GRAPH!r}")
    capture = compile is not None and compile is not False  # {} too: torch.compile's defaults
    if isinstance(compile, dict) and not isinstance(compile.get(BLOCK_REGIONS, True), bool):
        raise _invalid(f"compile[{BLOCK_REGIONS!r}]", compile[BLOCK_REGIONS], "True (the default) or False")
    stops = _stop_ids(stop_tokens, cfg.vocab_size)
    device = next(model.parameters()).device
    ids, mask = _prepare_inputs(input_ids, attention_mask, pad_token_id, cfg.vocab_size, device)
    longest = int(mask.sum(dim=1).max())
    if longest + max_new_tokens > cfg.max_seq_len:
        raise _invalid(
            "max_new_tokens",
            max_new_tokens,
            f"at most {max(cfg.max_seq_len - longest, 0)}: the longest prompt has {longest} tokens and "
            f"model.max_seq_len={cfg.max_seq_len} bounds prompt + new tokens",
        )
    sample = (temperature > 0) if do_sample is None else (do_sample and temperature > 0)

    B = ids.shape[0]
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)  # generated ids kept per row
    stop_tensor = torch.tensor(stops, dtype=torch.long, device=device)
    columns: list[torch.Tensor] = []
    was_training = model.training
    spent: Optional[torch.Tensor] = None  # realised block passes (kept on the device) over ``seen`` real positions
    seen = 0
    model.eval()
    try:
        with torch.no_grad():
            if max_new_tokens > 0:
                cache = LoopCache(full_loop=capture)  # a static cache needs every step's entries
                # Left padding puts every row's last real token in the last column.
                out = model(ids, attention_mask=mask.long(), cache=cache, iterations=iterations, logits_to_keep=1)
                logits = out.logits[:, -1]
                spent, seen = _passes_spent(out, mask), int(mask.sum())
                # a fixed loop spends the same passes on every position: the prompt's rate is the
                # generation's, and nothing is added up per token
                adds_up = spent is not None and model.cfg.halting.adaptive
                step_fn, cache = _decoder(model, cache, ids.shape[1] + max_new_tokens,
                                          (compile if isinstance(compile, (dict, str)) else {}) if capture else None)
                ones = torch.ones(B, 1, dtype=torch.long, device=device)
                for step in range(max_new_tokens):
                    token = next_token(
                        logits, sample=sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
                    )
                    if stops:  # (without stop tokens no row ever finishes)
                        token = token.masked_fill(finished, pad_token_id)  # [B]
                    columns.append(token)
                    if stops:
                        stopped = ~finished & torch.isin(token, stop_tensor)
                        lengths = torch.where(stopped, step + 1, lengths)
                        finished = finished | stopped
                    if step == max_new_tokens - 1 or (stops and (step + 1) % STOP_CHECK_EVERY == 0
                                                      and bool(finished.all())):  # a host read every k steps
                        break
                    # No mask: the new tokens are real, and the cache remembers the prompt's padding.
                    logits, passes = step_fn(model, token, cache, iterations)
                    if adds_up:
                        spent, seen = spent + _passes_spent(passes, ones), seen + B
    finally:
        model.train(was_training)

    generated = torch.stack(columns, dim=1) if columns else ids.new_zeros(B, 0)  # [B, N]
    if stops and len(columns) and bool(finished.all()):  # drop the columns decoded after the last stop
        generated = generated[:, : int(lengths.max())]
    sequences = torch.cat([ids, generated], dim=1)  # [B, T + N]
    n = generated.shape[1]
    new_tokens = [row[: min(int(length), n)] for row, length in zip(generated.tolist(), lengths.tolist())]
    passes = float(spent) / seen if spent is not None else None
    return GenerationOutput(sequences=sequences, new_tokens=new_tokens, finished=finished,
                            block_passes_per_token=passes)


#: how often (in decoded tokens) ``generate`` reads back whether every row has stopped: a
#: host sync stalls the device's queue, so it is paid once per this many tokens, and at most
#: this many - 1 steps are decoded after the last row stopped (their columns are dropped)
STOP_CHECK_EVERY = 16


def _decode_step(model: nn.Module, token: torch.Tensor, cache: LoopCache, iterations: Optional[int]):
    """One decoding forward of [B] new tokens: (last logits [B, V], the output the realised
    compute is read from). The function ``generate(compile=True)`` captures."""
    out = model(token[:, None], cache=cache, iterations=iterations)
    return out.logits[:, -1], _Passes(out.block_passes, out.catch_up_passes)


@dataclasses.dataclass
class _Passes:
    """The realised-compute fields of one forward's output (what :func:`_passes_spent` reads)."""

    block_passes: Optional[torch.Tensor]
    catch_up_passes: Optional[torch.Tensor]


#: ``generate(compile=CUDA_GRAPH)``: record the eager decoding step as CUDA graphs (no torch.compile)
CUDA_GRAPH = "cuda-graph"


def _decoder(model: nn.Module, cache: LoopCache, capacity: int, options: Union[None, dict, str]):
    """The decoding step and the cache it runs on: eager on the growing cache (``options``
    None), or captured with ``torch.compile(**options)`` (``options`` == CUDA_GRAPH: recorded
    as CUDA graphs, :class:`_GraphedStep`) on a static copy of it
    (:meth:`LoopCache.static`) sized for ``capacity`` positions, rounded up to a multiple of
    ``STATIC_ROUND`` so prompts of similar lengths share one compiled graph. The step's block
    passes are nested compile regions (:mod:`looplm.modules.region`) unless ``options`` holds
    ``BLOCK_REGIONS: False``; a first capture that fails with them is retried unrolled. A cache
    with no static form, or a step that cannot be captured, decodes eagerly, with the reason
    logged; one that has a static form after more positions (``NotStatic.after``) decodes
    eagerly until then."""
    if options is None:
        return _decode_step, cache
    try:
        static = cache.static(-(-capacity // STATIC_ROUND) * STATIC_ROUND)
    except NotStatic as reason:
        if reason.after is None:
            logger.warning("generate(compile=True) decodes eagerly: %s", reason)
            return _decode_step, cache
        logger.info("generate(compile=True) decodes eagerly up to position %d: %s", reason.after, reason)
        after, captured = reason.after, None

        def deferred(model, token, growing, iterations):
            nonlocal captured
            if captured is not None:
                return captured[0](model, token, captured[1], iterations)
            out = _decode_step(model, token, growing, iterations)
            if growing.get_seq_length() >= after:
                captured = _decoder(model, growing, capacity, options)
            return out

        return deferred, cache
    if options == CUDA_GRAPH:
        runtime = _graph_runtime(static.valid.device)
        if runtime is None:
            logger.warning("generate(compile=%r) decodes eagerly on the static cache: CUDA graphs need a CUDA "
                           "device, the model is on %s", CUDA_GRAPH, static.valid.device.type)
            return _decode_step, static  # the eager step counts on the host itself
        return _GraphedStep(runtime), static
    options = dict(options)
    static.block_regions = options.pop(BLOCK_REGIONS, True)
    if static.valid.device.type == "cuda":
        options.setdefault("mode", "reduce-overhead")  # CUDA graphs: one replay per token
        for tensor in static.tensors():
            torch._dynamo.mark_static_address(tensor, guard=False)  # a new cache re-records, never recompiles
    compiled = torch.compile(_decode_step, fullgraph=True, dynamic=False, **options)
    graphs = static.phase_count()  # multi-resolution iterations: one graph per phase
    if graphs > torch._dynamo.config.recompile_limit:
        compiled = torch._dynamo.config.patch(recompile_limit=graphs)(compiled)
    first = static.get_seq_length()
    run = compiled

    def step(model, token, cache, iterations):
        nonlocal run
        before = cache.get_seq_length()
        try:
            out = run(model, token, cache, iterations)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as error:
            if run is not compiled or before != first:  # only the first capture may fail over
                raise
            reason = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
            if cache.block_regions:  # then the unrolled step, then eager
                logger.warning("generate(compile=True) could not capture the decoding step with block regions "
                               "(%s); capturing it unrolled", reason)
                cache.block_regions = False
                return step(model, token, cache, iterations)
            logger.warning("generate(compile=True) could not capture the decoding step (%s); decoding "
                           "eagerly on the static cache", reason)
            run = _decode_step
            out = run(model, token, cache, iterations)
        if cache.get_seq_length() == before:
            cache.advance(1)  # a captured step leaves the host count to its caller (an eager one counts)
        return out

    return step, static


def _graph_runtime(device: torch.device):
    """What records and replays CUDA graphs on ``device`` (``torch.cuda``), or None."""
    return torch.cuda if device.type == "cuda" else None


class _GraphedStep:
    """The eager decoding step on a static cache, recorded as CUDA graphs and replayed, one
    graph per (loop count, host-side phase) — one phase unless multi-resolution iterations
    (:meth:`~looplm.cache.StaticLoopCache.phase`) — in one shared memory pool.

    A phase's first step runs eagerly on a side stream (it warms up what must not happen while
    recording: cuBLAS workspaces, Triton's autotuning, lazily built weights); its second is
    recorded, then replayed. Recording runs the step's Python but none of its kernels, so the
    host count is set back and the graph replayed at once. Every later step of the phase copies
    its token into the graph's input and replays: one launch per token. A step that cannot be
    recorded (a host sync in it, say) decodes eagerly from then on, with the reason logged.
    The logits returned are the graph's output buffer, rewritten by the next replay."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime  # torch.cuda (the tests give a CPU stand-in with its semantics)
        self.graphs: dict = {}  # (iterations, phase) -> (graph, token buffer, step output)
        self.warm: set = set()
        self.pool = None
        self.failed = False

    def __call__(self, model, token, cache, iterations):
        key = (iterations, cache.phase())
        if self.failed or key not in self.warm:
            self.warm.add(key)
            return self._eager(model, token, cache, iterations)
        if key not in self.graphs and not self._record(key, model, token, cache, iterations):
            return self._eager(model, token, cache, iterations)
        graph, buffer, out = self.graphs[key]
        buffer.copy_(token)
        graph.replay()
        cache.advance(1)
        return out

    def _eager(self, model, token, cache, iterations):
        cuda = self.runtime
        side = cuda.Stream()
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            out = _decode_step(model, token, cache, iterations)
        cuda.current_stream().wait_stream(side)
        return out

    def _record(self, key, model, token, cache, iterations) -> bool:
        cuda = self.runtime
        before = cache.get_seq_length()
        self.pool = self.pool if self.pool is not None else cuda.graph_pool_handle()
        graph, buffer = cuda.CUDAGraph(), token.clone()
        try:
            with cuda.graph(graph, pool=self.pool):
                out = _decode_step(model, buffer, cache, iterations)
        except RuntimeError as error:  # e.g. "operation not permitted when stream is capturing"
            self.failed = True
            logger.warning("generate(compile=%r) could not record the decoding step (%s); decoding eagerly on "
                           "the static cache", CUDA_GRAPH, " ".join(str(error).split())[:300])
            return False
        finally:
            cache.recount(before)  # the recording ran the Python, not the kernels
        self.graphs[key] = (graph, buffer, out)
        return True


#: a static cache's capacity is rounded up to a multiple of this many positions
STATIC_ROUND = 64

#: the ``compile`` dict's key (popped before the rest goes to ``torch.compile``) that turns
#: off the block regions of the captured step (:mod:`looplm.modules.region`): False traces
#: and compiles every block pass of the unrolled loop, as before issue 30
BLOCK_REGIONS = "block_regions"


def _passes_spent(output, valid: torch.Tensor) -> Optional[torch.Tensor]:
    """Block evaluations one forward (its :class:`~looplm.model.ModelOutput`) spent on real
    positions: what each new position needed (``valid`` [B, T]) plus catching up cached
    ones; None for a dense model."""
    if output.block_passes is None:
        return None
    return (output.block_passes * valid).sum() + output.catch_up_passes
