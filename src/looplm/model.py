"""The looped language model: one graph for every configuration.

    tokens ─ embed ─ prelude ─ Recurrence(core × T, topology) ─ coda ─ norm ─ head ─ logits

A dense transformer is the layout with no recurrence (``"12"``). The recurrence is a
plain loop: the core stack runs on the state h^(t) and the topology (``looplm.topology``)
folds its output into the next state. Positions, rotary tables and key validity are
computed once per forward (a :class:`~looplm.mixers.MixerContext`) and passed to every
mixer; the decoding cache is an explicit argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Step, in_pass
from looplm.cache import LoopCache, StaticLoopCache
from looplm.config_base import ConfigError
from looplm.generation import generate
from looplm.halting import Halting, Readout, build_halting
from looplm.head_loop.block import grown_block_type
from looplm.init import init_weights, output_projection_std
from looplm.mixers import MixerContext
from looplm.model_config import ModelConfig
from looplm.modules.block import Block, build_block
from looplm.modules.linear_cross_entropy import linear_cross_entropy
from looplm.modules.norm import build_norm
from looplm.modules.region import static_block_pass, takes_region
from looplm.modules.rotary import Rotary
from looplm.modules.step import StepEmbedding
from looplm.resolution import MultiResolution, build_resolution
from looplm.streams import build_streams
from looplm.targets import IGNORE_INDEX
from looplm.topology import Topology, build_topology


@dataclasses.dataclass
class ModelOutput:
    """logits: [B, T, V] (None when the loss was computed without them: ``loss_rows``).
    lm_loss: mean next-token cross-entropy over targets != -100
    (None without targets). loss: lm_loss plus every auxiliary loss, what training
    minimises (a halting rule whose losses hold the task loss leaves lm_loss out: the exit
    gate's expected objective). aux_losses: named auxiliary losses already weighted (e.g. ``dsa_index``),
    present whether or not targets are given.
    states: [h^(0), ..., h^(T)] (each [B, T, d]) when ``output_states``; the per-iteration
    hidden states of the loop. record: per-iteration topology values (e.g. MeSH router
    weights ``write`` / ``read``, each a list over t = -1 .. T-1 of [B, T, B_slots]).
    attentions: with ``output_attentions``, softmax probabilities [B, H, T, S] keyed by
    (block, pass), e.g. ("core.1", 0); blocks are named prelude.j, core.j, coda.j; a loop
    with streams numbers its core passes t·passes + i. Halting rules record
    ``act_weights`` / ``q_halt`` per step.
    The realised compute of a looped model (None for a dense one): halt_steps [B, T], the
    macro steps each new position ran before halting; block_passes [B, T], the block
    evaluations that position needed (prelude + core·steps·passes + coda); catch_up_passes
    [], the block evaluations this forward spent giving cached positions the macro steps
    they had skipped (decoding under adaptive halting, :meth:`LoopLM._catch_up`)."""

    logits: Optional[torch.Tensor]
    loss: Optional[torch.Tensor] = None
    lm_loss: Optional[torch.Tensor] = None
    aux_losses: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    states: Optional[list[torch.Tensor]] = None
    record: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    attentions: Optional[dict[tuple[str, int], torch.Tensor]] = None
    halt_steps: Optional[torch.Tensor] = None
    block_passes: Optional[torch.Tensor] = None
    catch_up_passes: Optional[torch.Tensor] = None


@dataclasses.dataclass
class RecurrenceOutput:
    """What the recurrence hands on: the readout for the coda [B, T, d] and the fields of
    :class:`ModelOutput` it fills (states: every h^(t))."""

    readout: torch.Tensor
    states: list[torch.Tensor]
    record: dict[str, list[torch.Tensor]]
    halt_steps: torch.Tensor
    block_passes: torch.Tensor
    catch_up_passes: torch.Tensor


class LoopLM(nn.Module):
    """Embedding, prelude blocks, looped core, coda blocks, final norm and LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        layout, structure = cfg.parsed_layout, cfg.structure
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        plan = cfg.block_mixers()  # each block's mixer(s): depth- and loop-level hybrids

        def block(part: str, j: int) -> Block:
            mixers = plan[(part, j)]
            lora = (cfg.lora, cfg.iterations) if part == "core" else None  # per-iteration adapters: the core's
            return build_block(cfg.block_shape, mixers, grown_block_type(cfg.head_loop, mixers), cfg.ffn_sets(part),
                               lora)

        self.prelude = nn.ModuleList(block("prelude", j) for j in range(structure.prelude))
        # core[i][j]: block j of stack i; one stack when shared, one per iteration otherwise
        self.core = nn.ModuleList(
            nn.ModuleList(block("core", j) for j in range(structure.core)) for _ in range(structure.stacks)
        )
        self.topology: Optional[Topology] = (
            build_topology(cfg.topology, cfg.d_model, cfg.iterations) if layout.is_looped else None
        )
        # None: every iteration at full resolution
        self.resolution: Optional[MultiResolution] = build_resolution(cfg.resolution, layout, cfg.d_model)
        self.step_embedding = StepEmbedding(cfg.iterations, cfg.d_model) if cfg.step_embeddings else None
        self.streams = build_streams(cfg.streams, cfg.d_model) if layout.is_looped else None
        self.halting: Optional[Halting] = build_halting(cfg.halting, cfg.d_model) if layout.is_looped else None
        self.coda = nn.ModuleList(block("coda", j) for j in range(structure.coda))
        self.norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.max_seq_len)
        #: The activation-checkpointing seam, set from outside (looplm.train.activation_checkpointing):
        #: ``recompute(part, fn, x)`` returns ``fn(x)`` for each region of a forward without a
        #: cache, part naming it: "prelude", "core" or "coda" (one block) or "pass" (one core
        #: pass, the core stack once, whose blocks are "core" regions inside it); it may
        #: recompute fn in the backward. None: call fn directly. Not a module: same state dict.
        self.recompute: Optional[Callable[[str, Callable[[torch.Tensor], torch.Tensor], torch.Tensor],
                                          torch.Tensor]] = None
        self.reset_parameters()
        if self.halting is not None and not self.halting.trains_lm:  # Ouro's Stage II: the gate alone trains
            self.requires_grad_(False)
            self.halting.requires_grad_(True)

    def reset_parameters(self) -> None:
        """The init pass (:mod:`looplm.init`), then every axis initialises its own parameters."""
        cfg = self.cfg
        init_weights(self, self.blocks(), cfg.init_std,
                     output_projection_std(cfg.init_std, cfg.block_passes, cfg.depth_scaled_init))
        for part in (self.topology, self.streams, self.halting, self.step_embedding):
            if part is not None:
                part.reset_parameters(cfg.init_std)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        *,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[LoopCache] = None,
        iterations: Optional[int] = None,
        output_states: bool = False,
        output_attentions: bool = False,
        logits_to_keep: int = 0,
        loss_rows: int = 0,
    ) -> ModelOutput:
        """input_ids, targets: [B, T] (targets already shifted; -100 is ignored).
        attention_mask: [B, T], 1 for real tokens and 0 for (left) padding of the *new*
        tokens; earlier positions' validity lives in ``cache``. iterations: loop count
        T at inference (test-time compute scaling), where the topology allows it.
        output_attentions: return the softmax mixers' probabilities per (block, iteration).
        logits_to_keep: > 0 computes the logits of the last that many positions only (a
        generation prefill needs one: [B, T, V] logits at a large vocabulary are the largest
        tensor of a long prompt); 0 computes all. Not with targets.
        loss_rows: > 0 computes the loss without the logits (``logits`` is None), that many
        rows at a time (:mod:`looplm.modules.linear_cross_entropy`: no [B·T, V] tensor,
        equal to float rounding); 0 computes the logits and the loss from them."""
        if logits_to_keep and targets is not None:
            raise ConfigError("logits_to_keep", logits_to_keep, "0 when targets are given (the loss reads every position)")
        if loss_rows < 0 or (loss_rows and targets is None):
            raise ConfigError("loss_rows", loss_rows, "0, or a number of rows >= 1 when targets are given")
        n_iter = self._check_iterations(iterations, cache)
        h_emb = self.embed(input_ids)
        if self.cfg.embed_scale:
            h_emb = h_emb * math.sqrt(self.cfg.d_model)
        ctx, positions = self._context(input_ids, attention_mask, cache, h_emb.dtype)
        if self.pos_embed is not None:
            h_emb = h_emb + self.pos_embed(positions)  # X = Embed(x) + Pos(x)
        if output_attentions:
            ctx.attentions = {}

        h = self._run(self.prelude, "prelude", 0, h_emb, ctx, cache)
        recurrence = self._recur(n_iter, h_emb, h, ctx, cache, targets) if self.topology is not None else None
        if recurrence is not None:
            h = recurrence.readout
        logits = lm_loss = loss = None
        if loss_rows:
            out = self.final_states(h, ctx, cache)
            lm_loss = linear_cross_entropy(out.reshape(-1, out.shape[-1]), self.head.weight, targets.reshape(-1),
                                           loss_rows, IGNORE_INDEX)
        else:
            logits = self.read_out(h, ctx, cache, logits_to_keep)
        if targets is not None:
            if lm_loss is None:
                lm_loss = F.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
                )
            if self.halting is not None and not self.halting.trains_readout:
                loss = sum(ctx.losses.values())  # the halting rule's losses hold the task loss (Ouro's Stage I)
            else:
                loss = lm_loss + sum(ctx.losses.values()) if ctx.losses else lm_loss
        output = ModelOutput(logits=logits, loss=loss, lm_loss=lm_loss, aux_losses=dict(ctx.losses.items()),
                             attentions=ctx.attentions)
        if recurrence is not None:
            output.states = recurrence.states if output_states else None
            output.record = recurrence.record
            output.halt_steps, output.block_passes = recurrence.halt_steps, recurrence.block_passes
            output.catch_up_passes = recurrence.catch_up_passes
        return output

    def _recur(self, n_iter: int, h_emb, h_pre, ctx: MixerContext, cache: Optional[LoopCache],
               targets) -> RecurrenceOutput:
        """The recurrence: n_iter macro steps of the streams' body (the core passes of
        ``streams.schedule``, folded in by the topology), the step signal e_t added to every
        core input, the halting rule observing the solution after each step and freezing
        halted positions. The loop stops once every position has halted (the frozen states
        would not change), except under torch.compile: the check reads the device back and
        would break the graph, so a compiled forward runs every step, halted positions frozen
        (what a full-loop cache does; same results). With a cache, positions that stopped
        early in earlier calls are caught up (:meth:`_catch_up`) before a new position first
        needs a later step."""
        streams, topology, halting = self.streams, self.topology, self.halting
        state = streams.start(topology, h_emb, h_pre)
        halt = halting.begin(state.h, ctx.new_valid)
        trace = [state.h]
        catch_up = torch.zeros((), dtype=torch.long, device=h_pre.device)
        # A full-loop cache (a static one) runs every step on every position, halted ones
        # frozen: no data-dependent exit, and no position ever misses a step's entries.
        stops = halting.freezes and not (cache is not None and cache.full_loop)
        exits = stops and not torch.compiler.is_compiling()  # the "all halted?" read-back breaks a graph
        # truncated backpropagation (model.depth.backprop_window = k): the first r − k steps
        # run without gradient, so training memory follows k, not r (Huginn §3.3)
        no_grad = self.cfg.depth.no_grad_iterations(n_iter) if torch.is_grad_enabled() else 0
        for t in range(n_iter):
            if cache is not None and stops and halting.catches_up:
                catch_up = catch_up + self._catch_up(t, ctx, cache)
            step_ctx = halting.step_context(halt, ctx, cache, t)  # ctx, unless the rule hides some keys
            with torch.no_grad() if t < no_grad else contextlib.nullcontext():
                new = streams.step(topology, state, self._passes(t, step_ctx, cache), t)
            state = halting.fold(halt, state, new, t)
            last = t == n_iter - 1
            solution = streams.finish(topology, state) if last else state.h
            halting.observe(halt, solution, t, last, Readout(self.norm, self.head), targets)
            trace.append(state.h)
            if exits and not last and halt.done:
                break
        readout = halting.finish(halt)
        for name, value in halt.losses.items():
            ctx.add_loss(name, value)
        if cache is not None and stops:
            cache.append_frozen(state, t + 1)
        elif cache is not None and halting.keeps_depth:  # a full-loop cache: the new positions' depths
            cache.record_depth(halt.steps, ctx.slots)
        structure = self.cfg.structure
        if isinstance(halt.steps, int):  # no halting: every position ran every step, one fill each
            steps = halt.steps
            halt.steps, block_passes = (torch.full(h_pre.shape[:2], n, dtype=torch.long, device=h_pre.device)
                                        for n in (steps, structure.block_passes(steps)))
        else:
            block_passes = structure.block_passes(halt.steps)
        if cache is not None and halting.freezes and not stops:  # the steps halted positions ran frozen
            catch_up = catch_up + structure.core_passes(((n_iter - halt.steps) * ctx.new_valid).sum())
        return RecurrenceOutput(readout.to(h_pre.dtype), trace, {**state.record, **halt.record}, halt.steps,
                                block_passes, catch_up)

    def _passes(self, t: int, ctx: MixerContext, cache: Optional[LoopCache]):
        """core(x, i): the i-th core pass of macro step t on x + e_t (the step signal), named
        t·passes + i in the cache: ũ = f_core(x) at resolution r_t. With
        ``model.loop_input_norm`` the state entering steps t >= 1 is first normalised by the
        final norm (Ouro: ``self.norm`` closes every UT step), so each step's state is the
        one its readout head(norm(·)) reads. When the halting rule gathered the positions
        taking the step (``ctx.gathered``: MoR's token skipping), the pass runs on their rows
        and writes them back; the others keep their input, and the rule keeps them frozen."""
        signal = self.step_embedding.at(t) if self.step_embedding is not None else None
        structure = self.cfg.structure
        entry = self.norm if self.cfg.loop_input_norm and t > 0 else None

        def core(x: torch.Tensor, i: int) -> torch.Tensor:
            def core_pass(x: torch.Tensor) -> torch.Tensor:
                full = x
                if ctx.gathered is not None:  # only the positions taking the step run it (MoR)
                    x = ctx.gathered.gather(x)
                x = x if entry is None else entry(x)
                x = x if signal is None else x + signal.to(x.dtype)
                x = self._core(t, x, ctx, cache, slot=structure.slot(t, i))
                return x if ctx.gathered is None else ctx.gathered.scatter(full, x)

            if self.recompute is None or cache is not None:
                return core_pass(x)
            return self.recompute("pass", core_pass, x)

        return core

    def _pass_calls(self, t: int, call: Call) -> Callable[[int], list[Step]]:
        """core_calls(i): the module calls of :meth:`_passes`' core(x, i), in its order, as the
        execution plan lists them (``call``: the full forward at iteration t): the loop-input
        norm, the step signal, the core update (:meth:`_core_calls`), named by the pass's slot."""
        def core_calls(i: int) -> list[Step]:
            slot = self.cfg.structure.slot(t, i)
            steps = []
            if self.cfg.loop_input_norm and t > 0:
                steps.append(Step("final_norm", f"loop_input_norm.{slot}", self.norm, call))
            if self.step_embedding is not None:
                steps += self.step_embedding.step_calls(t, slot, call)
            return in_pass(steps + self._core_calls(t, call), slot=slot)

        return core_calls

    def _catch_up(self, t: int, ctx: MixerContext, cache: LoopCache) -> Union[int, torch.Tensor]:
        """Give the cached positions that stopped before macro step t their entries for it:
        the step runs on their frozen loop states, outputs discarded (cache.py explains the
        policy). Returns the block evaluations it spent on real positions; a no-op (0)
        unless an earlier call stopped early."""
        start, end = cache.first_missing(t), ctx.past
        if start >= end:
            return 0
        valid = ctx.valid[:, :end]
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)[:, start:]
        sub = MixerContext(rope=self.rotary(positions, ctx.rope[0].dtype), valid=valid, past=start, padded=ctx.padded)
        self.streams.step(self.topology, cache.frozen_slice(start, end), self._passes(t, sub, cache), t)
        cache.mark_caught_up(start, end, t + 1)
        return self.cfg.structure.core_passes(valid[:, start:].sum())

    def _run(self, blocks, name: str, t: int, h, ctx: MixerContext, cache: Optional[LoopCache],
             slot: Optional[int] = None) -> torch.Tensor:
        """Blocks at iteration t (their per-iteration mixer view); ``slot`` names the pass in
        the cache and the attention record (default t)."""
        slot = t if slot is None else slot
        for key, block in zip(self.cfg.structure.names_of(name), blocks, strict=True):
            ctx.at(key, slot)
            if cache is None and self.recompute is not None:
                h = self.recompute(name, functools.partial(_block_output, block, ctx, t), h)
                continue
            state = cache.get(key, slot) if cache is not None else None
            if isinstance(cache, StaticLoopCache) and cache.block_regions and takes_region(block, ctx, state):
                h = static_block_pass(block, h, ctx, state, t)  # traced once for every pass alike
                continue
            h, state = block(h, ctx, state, iteration=t)
            if cache is not None and state is not None:  # None: the pass keeps nothing (it read another's)
                cache.set(key, slot, state)
        return h

    def _core(self, t: int, h, ctx: MixerContext, cache: Optional[LoopCache], slot: Optional[int] = None) -> torch.Tensor:
        """The core's update at iteration t: f_core(h^(t)) at full resolution, else
        S↓ -> f_core on the chunk latents -> S↑ -> causal right shift (spiralformer Alg. 1-2;
        the core runs only on the chunks completed by the new positions)."""
        stack = self.core[self.cfg.structure.stack_at(t)]
        if self.resolution is None or self.resolution.identity(t):
            return self._run(stack, "core", t, h, ctx, cache, slot)
        step = self.resolution.down(t, h, ctx, self.rotary, cache)  # Eq. (8): z [B, L_t, d]
        z_hat = self._run(stack, "core", t, step.z, step.ctx, cache) if step.z.shape[1] else step.z  # Eq. (9)
        return self.resolution.up(t, step, z_hat, cache)  # Eq. (10), (22)

    def _core_calls(self, t: int, call: Call) -> list[Step]:
        """The module calls of :meth:`_core` at iteration t, as the execution plan lists them:
        the stack's blocks on ``call``, or the resolution's S↓ -> blocks -> S↑."""
        structure = self.cfg.structure
        stack = self.core[structure.stack_at(t)]

        def blocks(c: Call) -> list[Step]:
            return [Step("core", name, block, c) for name, block in zip(structure.names_of("core"), stack, strict=True)]

        return blocks(call) if self.resolution is None else self.resolution.pass_calls(t, call, blocks)

    def _check_iterations(self, iterations: Optional[int], cache: Optional[LoopCache]) -> int:
        trained = self.cfg.iterations
        n_iter = trained if iterations is None else iterations
        if n_iter != trained:
            if self.topology is None:
                raise ConfigError("iterations", iterations, f"None: layout {self.cfg.layout!r} has no loop")
            if n_iter < 1:
                raise ConfigError("iterations", iterations, "an integer >= 1")
            if not self.cfg.share_core:
                raise ConfigError(
                    "iterations", iterations, f"{trained}: share_core=false has one core stack per trained iteration"
                )
            if self.topology.trained_iterations is not None:
                raise ConfigError(
                    "iterations",
                    iterations,
                    f"{trained}: topology {self.cfg.topology.kind!r} has per-iteration parameters for "
                    f"the {trained} trained iterations only",
                )
            if self.cfg.lora.enabled and n_iter > trained:
                raise ConfigError("iterations", iterations, f"at most {trained}: model.lora has one adapter per "
                                  "trained iteration (Relaxed Recursive Transformers)")
            if self.cfg.loop_mixers is not None and n_iter > trained:
                raise ConfigError("iterations", iterations, f"at most {trained}: model.loop_mixers names one mixer "
                                  "per trained iteration (a loop-level hybrid)")
            if self.resolution is not None:
                raise ConfigError(
                    "iterations", iterations, f"{trained}: layout {self.cfg.layout!r} has one resolution per trained iteration"
                )
            if self.cfg.ffn_sets("core") > 1:
                raise ConfigError("iterations", iterations, f"{trained}: model.moe.per_iteration holds one expert set "
                                  "per trained iteration")
            if self.step_embedding is not None and self.step_embedding.enabled and n_iter > trained:
                on = f"at most {trained} while step embeddings are on (one e_t per trained step); switch them off to extrapolate"
                raise ConfigError("iterations", iterations, f"{on} (model.step_embedding.enabled = False)",
                                  cli_hint=f"{on} (add --no-step-embeddings)")
        if cache is not None:
            cache.use_iterations(n_iter)
        return n_iter

    def _context(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], cache: Optional[LoopCache], dtype
    ) -> tuple[MixerContext, torch.Tensor]:
        """Position ids [B, T], rotary tables and key validity, once per forward; updates the
        cache's bookkeeping (valid positions, next position per row)."""
        B, T = input_ids.shape
        device = input_ids.device
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {(B, T)}")
        new_valid = (
            torch.ones(B, T, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
        )
        # host-side ints; a captured step on a static cache leaves them to its eager caller
        # (guarding on the cache's length would recompile every step)
        static = isinstance(cache, StaticLoopCache)
        past = cache.get_seq_length() if cache is not None else 0
        if not (static and torch.compiler.is_compiling()) and past + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {past + T} positions exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if static:  # rows written in place; nothing on the host moves
            slots, positions = cache.extend_static(new_valid, masked=attention_mask is not None)
            ctx = MixerContext(rope=self.rotary(positions, dtype), valid=cache.valid, past=None, padded=cache.padded,
                               slots=slots)
            return ctx, positions
        if cache is not None:
            valid, start, padded = cache.extend(new_valid, masked=attention_mask is not None)
        else:
            valid, start = new_valid, None
            padded = attention_mask is not None and not bool(new_valid.all())
        if attention_mask is None:  # every new position is real: the next T ids of each row
            if start is None:
                positions = torch.arange(T, device=device).expand(B, T)
            else:  # a view of the cache's old next_position, which extend replaced (not changed)
                positions = start[:, None] if T == 1 else start[:, None] + torch.arange(T, device=device)
        else:
            first = torch.zeros(B, dtype=torch.long, device=device) if start is None else start
            positions = (first[:, None] + new_valid.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, T]
        return MixerContext(rope=self.rotary(positions, dtype), valid=valid, past=past, padded=padded), positions

    # ---------------------------------------------------------------- utilities
    generate = generate  # sample continuations through the cache: looplm.generation.generate(model, ...)

    def save_pretrained(self, directory: Union[str, Path]) -> None:
        """Write ``config.json`` and ``model.safetensors`` (Hugging Face layout), then
        ``manifest.json`` with their sha256 (:mod:`looplm.artifacts`): a directory whose
        manifest is missing or does not match was not written completely."""
        from safetensors.torch import save_model

        from looplm.artifacts import CONFIG_FILE, MANIFEST, MODEL_FILE, write_manifest, write_text

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST).unlink(missing_ok=True)  # the old manifest must not vouch for half-new files
        write_text(directory / CONFIG_FILE, json.dumps(self.cfg.to_dict(), indent=2) + "\n", atomic=True)
        save_model(self, str(directory / MODEL_FILE))
        write_manifest(directory, (CONFIG_FILE, MODEL_FILE))

    @classmethod
    def from_pretrained(cls, directory: Union[str, Path], map_location: str = "cpu", verify: bool = True) -> "LoopLM":
        """The model of a ``save_pretrained`` directory, a training checkpoint or a run
        directory (its latest checkpoint), verified against its manifest first
        (``verify=False``: load a damaged directory anyway, for inspection)."""
        from looplm.artifacts import MODEL_FILE, load_weights, read_weights_dir

        directory, config = read_weights_dir(directory, verify=verify)
        model_config = config["model"] if "model" in config else config  # a run's config.json holds model/data/train
        model = cls(ModelConfig.from_dict(model_config, prefix="model"))
        load_weights(model, directory / MODEL_FILE, device=map_location)
        return model

    def blocks(self) -> list[Block]:
        """Every distinct block module (prelude, core stacks, coda)."""
        return [*self.prelude, *(b for stack in self.core for b in stack), *self.coda]

    def read_out(self, h: torch.Tensor, ctx: MixerContext, cache: Optional[LoopCache] = None,
                 logits_to_keep: int = 0) -> torch.Tensor:
        """Logits head(norm(coda(h))) [B, T, V] of a state h [B, T, d] leaving the loop, with
        the positions and masks of ``ctx``; ``logits_to_keep`` > 0: of the last that many
        positions only (the coda still runs on all, to fill ``cache``)."""
        return self.head(self.final_states(h, ctx, cache, logits_to_keep))

    def final_states(self, h: torch.Tensor, ctx: MixerContext, cache: Optional[LoopCache] = None,
                     logits_to_keep: int = 0) -> torch.Tensor:
        """norm(coda(h)) [B, T, d]: what the head reads (of the last ``logits_to_keep``
        positions when > 0; the coda still runs on all, to fill ``cache``)."""
        h = self._run(self.coda, "coda", 0, h, ctx, cache)
        return self.norm(h[:, -logits_to_keep:] if logits_to_keep > 0 else h)

    def loop_logits(self, input_ids: torch.Tensor, states: list[torch.Tensor]) -> list[torch.Tensor]:
        """z^(τ) = head(norm(coda(h^(τ)))) [B, T, V] for each loop state h^(τ) of
        ``forward(input_ids, output_states=True).states`` (pass ``states[1:]`` for τ = 1..T):
        what the model would emit had it stopped after τ iterations (LT2 §5, Eq. kd-loss)."""
        ctx, _ = self._context(input_ids, None, None, states[0].dtype)
        return [self.read_out(h, ctx) for h in states]


def _block_output(block: Block, ctx: MixerContext, t: int, h: torch.Tensor) -> torch.Tensor:
    """A block's output without a cache: the region :attr:`LoopLM.recompute` may recompute."""
    return block(h, ctx, None, iteration=t)[0]
