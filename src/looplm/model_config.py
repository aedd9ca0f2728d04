"""Configuration of a looped language model: the block, the layout, and the loop's axes.

The model config sits above the axes: it composes their configs (mixers, topology,
resolution, streams, halting, head loop), checks how they combine, and hands the layers
what they are sized by (:attr:`ModelConfig.block_shape`); no axis imports it."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Optional, Union

from looplm.config_base import Config, ConfigError, check
from looplm.depth import DepthConfig, FixedDepthConfig
from looplm.head_loop.config import HeadLoopConfig
from looplm.halting.config import HaltingConfig, NoHaltingConfig
from looplm.layout import Layout, parse_layout
from looplm.mixers.config import AttentionConfig, MixerConfig
from looplm.mixers.pattern import HybridConfig, block_mixers, hybrid_positions
from looplm.modules.lora import LoRAConfig
from looplm.modules.moe import MoEConfig
from looplm.modules.shape import BlockShape
from looplm.resolution.config import ResolutionConfig
from looplm.resolution import schedule
from looplm.streams.config import SingleStreamConfig, StreamsConfig
from looplm.structure import LoopStructure
from looplm.topology.config import SUPPLEMENTS, TOPOLOGIES, TOPOLOGY_CONFIGS, BaseTopologyConfig, TopologyConfig

__all__ = ["ModelConfig", "SUPPLEMENTS", "TOPOLOGIES", "TopologyConfig"]


@dataclasses.dataclass(frozen=True)
class ModelConfig(Config):
    """One looped LM: ``embed -> prelude -> loop(core x T, topology) -> coda -> norm -> head``.

    With ``norm=layernorm, parallel_residual=true, rotary_pct=0.25, mlp=gelu, bias=true``
    the blocks are GPT-NeoX (Pythia) blocks; with ``norm=rmsnorm, mlp=swiglu, bias=false``
    they are LLaMA blocks.
    """

    vocab_size: int = 257
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    layout: Union[str, int] = "2+4R2+2"
    share_core: bool = True
    topology: TopologyConfig = BaseTopologyConfig()
    resolution: ResolutionConfig = ResolutionConfig()
    mixer: MixerConfig = AttentionConfig()
    hybrid: Optional[HybridConfig] = None
    loop_mixers: Optional[tuple[MixerConfig, ...]] = None
    norm: Literal["rmsnorm", "layernorm"] = "layernorm"
    norm_eps: float = 1e-5
    mlp: Literal["gelu", "swiglu"] = "gelu"
    mlp_hidden: Optional[int] = None
    parallel_residual: bool = False
    norm_placement: Literal["pre", "sandwich"] = "pre"  # sandwich: also a norm on each sub-layer's output (Ouro)
    loop_input_norm: bool = False  # the final norm also normalises the loop state entering steps 2..T (Ouro)
    bias: bool = True
    tie_embeddings: bool = False
    rotary_pct: float = 1.0
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    embed_scale: bool = False
    init_std: float = 0.02
    depth_scaled_init: bool = True
    head_loop: Optional[HeadLoopConfig] = None  # SGT head looping grown in training (looplm.head_loop)
    position: Literal["rotary", "learned"] = "rotary"  # learned: absolute table added to the embeddings
    step_embeddings: bool = False  # UT: a learned e_t added to the core's input at macro step t
    streams: StreamsConfig = SingleStreamConfig()  # single state, or solution/reasoning streams (looplm.streams)
    halting: HaltingConfig = NoHaltingConfig()  # none, ACT or Q-halt (looplm.halting)
    lora: LoRAConfig = LoRAConfig()  # per-iteration adapters on the shared core (Relaxed Recursive Transformers)
    depth: DepthConfig = FixedDepthConfig()  # iterations per training step, backprop window (looplm.depth)
    moe: Optional[MoEConfig] = None  # the FFN as a mixture of experts (looplm.modules.moe)

    def __post_init__(self) -> None:
        for name, kind in (("topology", TopologyConfig), ("resolution", ResolutionConfig), ("mixer", MixerConfig),
                           ("hybrid", HybridConfig), ("streams", StreamsConfig), ("halting", HaltingConfig),
                           ("lora", LoRAConfig), ("depth", DepthConfig), ("moe", MoEConfig)):
            if isinstance(getattr(self, name), dict):  # ModelConfig(topology={"kind": "mesh"}) from Python
                object.__setattr__(self, name, kind.from_dict(getattr(self, name), prefix=f"model.{name}"))
        if self.loop_mixers is not None:
            object.__setattr__(self, "loop_mixers", tuple(
                MixerConfig.from_dict(m, prefix=f"model.loop_mixers[{t}]") if isinstance(m, dict) else m
                for t, m in enumerate(self.loop_mixers)
            ))
        if isinstance(self.layout, int) and not isinstance(self.layout, bool):
            object.__setattr__(self, "layout", str(self.layout))  # YAML reads `layout: 12` as an int
        layout = parse_layout(self.layout)  # raises ConfigError naming model.layout
        check(self.vocab_size >= 2, "model.vocab_size", self.vocab_size, "an integer >= 2")
        check(self.d_model >= 1, "model.d_model", self.d_model, "an integer >= 1")
        check(self.n_heads >= 1, "model.n_heads", self.n_heads, "an integer >= 1")
        check(
            self.d_model % self.n_heads == 0,
            "model.n_heads",
            self.n_heads,
            f"a divisor of d_model={self.d_model}",
        )
        check(
            self.n_kv_heads is None or (self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0),
            "model.n_kv_heads",
            self.n_kv_heads,
            f"null or a divisor of n_heads={self.n_heads}",
        )
        check(0.0 <= self.rotary_pct <= 1.0, "model.rotary_pct", self.rotary_pct, "a number in [0, 1]")
        rot = int(self.head_dim * self.rotary_pct)
        check(rot % 2 == 0, "model.rotary_pct", self.rotary_pct, f"a fraction giving an even number of rotary dims of head_dim={self.head_dim} (got {rot})")
        check(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "a number > 0")
        check(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "a number > 0")
        check(self.norm_placement in ("pre", "sandwich"), "model.norm_placement", self.norm_placement,
              "'pre' (norm on each sub-layer's input) or 'sandwich' (and on its output, as Ouro)")
        check(self.mlp_hidden is None or self.mlp_hidden >= 1, "model.mlp_hidden", self.mlp_hidden, "null or an integer >= 1")
        check(self.max_seq_len >= 1, "model.max_seq_len", self.max_seq_len, "an integer >= 1")
        check(self.init_std > 0, "model.init_std", self.init_std, "a number > 0")
        self.resolution.validate(layout.resolutions, self.layout)  # per-iteration ω_t, s_t against T
        if self.loop_mixers is not None:
            check(
                layout.is_looped and len(self.loop_mixers) == layout.iterations,
                "model.loop_mixers",
                [m.kind for m in self.loop_mixers],
                f"one mixer per iteration of the loop ({layout.iterations} for layout {self.layout!r})",
            )
            check(self.hybrid is None, "model.loop_mixers", [m.kind for m in self.loop_mixers],
                  "null when model.hybrid is set: choose a depth-level or a loop-level hybrid")
        if self.hybrid is not None:
            hybrid_positions(self.hybrid, len(self.structure.names))
        self.mixer.validate(self.block_shape, "model.mixer")
        if self.hybrid is not None:
            self.hybrid.mixer.validate(self.block_shape, "model.hybrid.mixer")
        for t, spec in enumerate(self.loop_mixers or ()):
            spec.validate(self.block_shape, f"model.loop_mixers[{t}]")
        if self.head_loop is not None:
            check(self.norm_placement == "pre", "model.norm_placement", self.norm_placement,
                  "'pre' with model.head_loop set (SGT's grown passes are pre-norm)")
            specs = [self.mixer, *(self.loop_mixers or ())] + ([self.hybrid.mixer] if self.hybrid else [])
            object.__setattr__(self, "head_loop", HeadLoopConfig.checked(
                self.head_loop, structure=self.structure, n_heads=self.n_heads,
                parallel_residual=self.parallel_residual, softmax=any(s.is_softmax for s in specs)))
        self._check_loop_axes(layout)
        if self.lora.enabled:
            core = self.block_mixers()
            self.lora.validate(looped=layout.is_looped, shared=self.share_core, head_loop=self.head_loop is not None,
                               core_softmax=all(s.is_softmax for j in range(self.structure.core) for s in core[("core", j)]),
                               layout=self.layout)
        self._check_moe(layout)
        if not layout.is_looped:
            check(
                self.resolution == ResolutionConfig(),
                "model.resolution",
                self.resolution.to_dict(),
                f"the defaults for the dense layout {self.layout!r}: resolutions act on a loop such as 4+8x{{1/2,1}}+4",
            )
            check(
                not self.topology.defines_update,
                "model.topology.kind",
                self.topology.kind,
                f"'base' for the dense layout {self.layout!r}: topologies act on a loop such as 4+8R2+4",
            )

    def _check_loop_axes(self, layout: Layout) -> None:
        """Step embeddings, streams and halting act on a loop, and on what they can freeze."""
        if not layout.is_looped:
            for name, ok, value, default in (
                ("step_embeddings", not self.step_embeddings, self.step_embeddings, False),
                ("loop_input_norm", not self.loop_input_norm, self.loop_input_norm, False),
                ("streams.kind", not self.streams.defines_update, self.streams.kind, "single"),
                ("halting.kind", not self.halting.adaptive, self.halting.kind, "none"),
                ("depth", not self.depth.changes_training, self.depth.to_dict(), {"kind": "fixed"}),
            ):
                check(ok, f"model.{name}", value,
                      f"{default!r} for the dense layout {self.layout!r}: it acts on a loop such as 1R12")
            return
        multires = any(r != 1 for r in layout.resolutions)
        # S↑'s causal right shift (SpiralFormer Eq. 22) moves each chunk's update past the
        # positions that produced it: a topology that replaces the state with that update
        # would drop every token's own information (position 0, and every token whose chunk
        # has not yet closed), so a sub-token iteration needs a state the update is added to.
        # A kind that replaces the state with the update (base; gated_residual, whose ρ starts at
        # zero; concat_adapter's s ← update) would too; concat_adapter re-reads the input e at
        # the next iteration, so it only needs a full-resolution last iteration.
        topology = self.topology
        keeps = topology.adds_update or (topology.injects_input and layout.resolutions[-1] == 1)
        if multires and not keeps and not self.streams.defines_update:
            adds = ", ".join(k for k, c in TOPOLOGY_CONFIGS.items() if c.adds_update)
            full_last = f" (or a last iteration at resolution 1 for {topology.kind})" if topology.injects_input else ""
            raise ConfigError("model.topology.kind", topology.kind,
                              f"a kind that adds the update to the state ({adds}) with the multi-resolution layout "
                              f"{self.layout!r}{full_last}: {topology.kind!r} replaces the state with S↑'s update, "
                              "which drops each token's own state through the causal shift; SpiralFormer §2.3 uses "
                              "Anchor or MeSH")
        if self.loop_input_norm:
            check(not self.streams.defines_update, "model.loop_input_norm", self.loop_input_norm,
                  f"false with model.streams.kind={self.streams.kind} (it normalises the single loop state)")
        if self.streams.defines_update:
            for name, ok, value, allowed in (
                ("topology.kind", not self.topology.defines_update, self.topology.kind,
                 "'base' (the streams define the update)"),
                ("share_core", self.share_core, self.share_core, "true (every pass reuses the one core)"),
                ("layout", not multires, self.layout, "a full-resolution loop such as 1R6"),
                ("loop_mixers", self.loop_mixers is None, self.loop_mixers, "null"),
                ("head_loop", self.head_loop is None, self.head_loop, "null"),
            ):
                check(ok, f"model.{name}", value, f"{allowed} with model.streams.kind={self.streams.kind}")
        if self.halting.adaptive:
            kind = self.halting.kind
            check(self.topology.can_freeze_positions, "model.topology.kind", self.topology.kind,
                  f"not {self.topology.kind!r} with model.halting.kind={kind} (a halted position cannot freeze "
                  "the shared buffer)")
            check(not multires, "model.layout", self.layout, f"a full-resolution loop with model.halting.kind={kind}")
            check(self.head_loop is None, "model.head_loop", self.head_loop, f"null with model.halting.kind={kind}")
        if self.halting.needs_no_coda:
            check(layout.coda == 0, "model.layout", self.layout,
                  f"a layout ending in the loop (no coda) with {self.halting.label}: its target "
                  "reads logits straight from the solution stream")
        if layout.is_looped:
            check(layout.iterations >= self.halting.min_iterations, "model.layout", self.layout,
                  f"a loop of at least {self.halting.min_iterations} iterations with {self.halting.label}")
        self.halting.check_loop(layout.iterations, self.layout,
                                sorted({m.kind for mixers in self.block_mixers().values() for m in mixers}))
        if self.halting.reuses_first_step_kv:  # step t of core block j attends over step 0's keys of block j
            for name, ok, value, allowed in (
                ("share_core", self.share_core, self.share_core, "true (one core stack: every step runs block j)"),
                ("loop_mixers", self.loop_mixers is None, self.loop_mixers, "null (the same attention at every step)"),
                ("streams.kind", not self.streams.defines_update, self.streams.kind, "single (one core pass per step)"),
                ("lora.targets", not (self.lora.enabled and self.lora.adapts("qkv")), list(self.lora.targets),
                 "['mlp'] or ['o_proj'] (a later step projects its queries with the shared qkv alone)"),
            ):
                check(ok, f"model.{name}", value, f"{allowed} with {self.halting.label}")
        self._check_depth(layout, multires)
        exit_at = self.halting.exit_at_step
        if exit_at is not None:
            check(exit_at < layout.iterations, "model.halting.exit_at_step", exit_at,
                  f"null or a 0-based loop step below the {layout.iterations} iterations of layout {self.layout!r}")

    def _check_depth(self, layout: Layout, multires: bool) -> None:
        """A count drawn per step needs a loop that runs any count; a truncated backward has
        no halting losses to drop (the early steps' would train nothing), and needs a topology
        that re-reads the loop input (else the prelude and the embeddings train nothing)."""
        depth = self.depth
        if depth.sampled:
            for name, ok, value, allowed in (
                ("share_core", self.share_core, self.share_core, "true (one core stack runs any count)"),
                ("layout", not multires, self.layout, "a full-resolution loop (one resolution per trained iteration)"),
                ("loop_mixers", self.loop_mixers is None, self.loop_mixers, "null (one mixer per trained iteration)"),
                ("step_embeddings", not self.step_embeddings, self.step_embeddings,
                 "false (one e_t per trained step)"),
                ("lora.rank", not self.lora.enabled, self.lora.rank, "0 (one adapter per trained iteration)"),
                ("moe.per_iteration", not (self.moe is not None and self.moe.per_iteration),
                 self.moe is not None and self.moe.per_iteration, "false (one expert set per trained iteration)"),
            ):
                check(ok, f"model.{name}", value, f"{allowed} with model.depth.kind={depth.kind}")
            check(self.topology.iteration_free, "model.topology.kind", self.topology.kind,
                  f"a kind without per-iteration parameters with model.depth.kind={depth.kind}")
        if depth.changes_training:
            check(not self.halting.adaptive, "model.halting.kind", self.halting.kind,
                  f"'none' with model.depth (kind={depth.kind}, backprop_window={depth.backprop_window}): "
                  "a drawn count or a truncated backward leaves the halting losses of early steps untrained")
        window = depth.backprop_window
        if window is not None and (depth.sampled or window < layout.iterations) and not self.streams.defines_update:
            # the first r − k iterations run without gradient, so the state enters the window
            # detached: only a loop input the topology reads again at every iteration carries
            # the gradient back to the prelude and the embeddings (Huginn's input injection)
            reads = self.topology.rereads
            check("h0" in reads or (layout.prelude == 0 and "h_emb" in reads), "model.topology.kind",
                  self.topology.kind,
                  "a kind that reads the loop input at every iteration (anchor, additive with anchor, "
                  "static_combination, dynamic_combination, concat_adapter"
                  + ("; anchor_embedding with no prelude" if layout.prelude == 0 else "")
                  + f") with model.depth.backprop_window={window}: the iterations before the window run "
                  f"without gradient, so {'the prelude and ' if layout.prelude else ''}the embeddings would "
                  "get no gradient at all")

    def _check_moe(self, layout: Layout) -> None:
        """Per-iteration experts need a shared core to differ across; SGT's grown blocks
        keep the dense FFN."""
        if self.moe is None:
            return
        check(self.head_loop is None, "model.head_loop", self.head_loop, "null with model.moe set (SGT's grown "
              "blocks run a dense FFN)")
        check(not (self.lora.enabled and "mlp" in self.lora.targets), "model.lora.targets", list(self.lora.targets),
              "targets without mlp with model.moe set (the experts are stacked weights, not nn.Linear layers "
              "an adapter can wrap)")
        if self.moe.per_iteration:
            check(layout.is_looped and self.share_core, "model.moe.per_iteration", True,
                  f"false with layout {self.layout!r} and share_core={self.share_core}: per-iteration experts "
                  "differentiate the iterations of one shared core")

    def ffn_sets(self, part: str) -> int:
        """Expert sets of a block of ``part`` (prelude / core / coda): one per loop iteration
        for the core's per-iteration experts, else 1."""
        per_iteration = self.moe is not None and self.moe.per_iteration and part == "core"
        return self.iterations if per_iteration else 1

    @property
    def passes_per_step(self) -> int:
        """Core block passes per macro step (streams): 1, or H·(L + 1)."""
        return self.structure.passes_per_step

    @property
    def block_passes(self) -> int:
        """Block evaluations of one forward, every position running every step: prelude +
        core·T·passes + coda (autoregressive-trm.txt App. B's compute C)."""
        return self.structure.trained_block_passes

    @functools.cached_property
    def structure(self) -> LoopStructure:
        """The loop's shape: block counts, core stacks, block names and parameter paths,
        block passes (:mod:`looplm.structure`)."""
        return LoopStructure.of(self.parsed_layout, self.share_core, self.streams.passes)

    @functools.cached_property
    def parsed_layout(self) -> Layout:
        """The parsed layout (prelude / core / coda block counts, iterations)."""
        return parse_layout(self.layout)

    @property
    def iterations(self) -> int:
        return self.parsed_layout.iterations

    @property
    def resolution_schedule(self):
        """Per iteration (g_t, ω_t, s_t) with defaults resolved (``looplm.resolution.schedule``)."""
        return schedule.iteration_resolutions(self.parsed_layout.resolutions, self.resolution.offsets, self.resolution.shifts)

    def core_lengths(self, length: int) -> list[int]:
        """L_t: positions the looped core processes at each iteration of a length-``length``
        training forward (= length at full resolution, the complete chunks otherwise); the
        core's token passes per iteration are L_t times its block count."""
        return schedule.core_lengths(self.resolution_schedule, length)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Rotary channels per head: 0 with learned absolute positions."""
        return 0 if self.position == "learned" else int(self.head_dim * self.rotary_pct)

    @property
    def ffn_hidden(self) -> int:
        """FFN width: 4d for GELU; for SwiGLU 8d/3 rounded up to a multiple of 64 (LLaMA §2)."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.mlp == "gelu":
            return 4 * self.d_model
        return 64 * -(-(8 * self.d_model // 3) // 64)

    @property
    def buffer_slots(self) -> int:
        """MeSH buffer length B (default T + 3, MeSH Appendix E.2); kind mesh only."""
        return self.topology.slots(self.iterations)

    @functools.cached_property
    def block_shape(self) -> BlockShape:
        """What every block and mixer is sized by (handed down, so they need not import this)."""
        return BlockShape(
            d_model=self.d_model, n_heads=self.n_heads, kv_heads=self.kv_heads, rotary_dim=self.rotary_dim,
            rope_theta=self.rope_theta, bias=self.bias, norm=self.norm, norm_eps=self.norm_eps, mlp=self.mlp,
            ffn_hidden=self.ffn_hidden, parallel_residual=self.parallel_residual, norm_placement=self.norm_placement,
            moe=self.moe,
        )

    def block_mixers(self) -> dict[tuple[str, int], tuple[MixerConfig, ...]]:
        """``(part, j) -> mixers`` of every block: depth- and loop-level hybrids
        (:func:`looplm.mixers.pattern.block_mixers`)."""
        return block_mixers(self.structure, self.mixer, self.hybrid, self.loop_mixers)
