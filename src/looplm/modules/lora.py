"""Per-iteration low-rank adapters on the shared core's linears (Relaxed Recursive Transformers).

Bae et al. 2024, "Relaxed Recursive Transformers: Effective Parameter Sharing with
Layer-wise LoRA" (arXiv 2410.20672), §2.3: a recursive (tied) model relaxes its sharing by
giving every unrolled layer its own LoRA module, so the shared weight W' of a core block
runs at loop iteration t as

    h = W' x + B_t A_t x          (A_t: r × in, B_t: out × r; rank r)

on each targeted linear: the mixer's projections (``attention``: q/k/v, the output
projection, and LT2's output gate when present) and the FFN's (``mlp``: up/gate/down).
The adapters are a per-iteration *view* of the block's linears (:meth:`Block.mixer_at`,
:meth:`Block.ffn_at`): iteration t's mixer and FFN are shallow copies whose targeted
linears add B_t A_t x; the stored layers and their state-dict names are unchanged, and the
adapters live in the block (``core.0.j.lora``), so sharding or checkpointing the block
takes them along.

Sections as in the paper's ICLR 2025 version (§2.2 initialisation of the tied weights, §2.3
the relaxation and its SVD initialisation, §2.4 continuous depth-wise batching); its method
was read from the abstract and secondary summaries, not the full text. Resolved where the
paper leaves room:

* looplm fuses q, k and v into one projection (``qkv``); it gets one rank-r adapter over
  the fused output (the paper's three rank-r adapters on q, k, v hold 3r·(d + out/3)
  parameters, this one r·(d + out)). A full-rank adapter (r >= min(in, out)) reproduces any
  per-iteration weight either way.
* No α/r scaling: B_t A_t is added as is, so the SVD initialisation of a converted model
  (:func:`svd_init`, §2.3) is exact.
* Trained from scratch, A_t starts Gaussian and B_t at zero (Hu et al. 2021 §4.1): the
  relaxed model starts as the tied one.
* The paper's continuous depth-wise batching (§2.4, batched inference across loop depths)
  is out of scope.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost, module_cost
from looplm.config_base import Config, check

#: Which linears of a core block get adapters: every projection of the token mixer
#: (``attention``: q/k/v, W_O and an output gate), its fused q/k/v or its W_O alone, the FFN's.
TARGETS = ("attention", "qkv", "o_proj", "mlp")
#: The targets that name single projections of softmax attention.
PROJECTIONS = ("qkv", "o_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig(Config):
    """rank: r of every adapter (0: none; the model holds no adapter parameters).
    targets: which of the core blocks' linears are adapted, a subset of ``attention``
    (every projection of the mixer), ``qkv`` / ``o_proj`` (one of them) and ``mlp`` (the FFN's)."""

    rank: int = 0
    targets: tuple[str, ...] = ("attention", "mlp")

    def __post_init__(self) -> None:
        check(isinstance(self.rank, int) and self.rank >= 0, "model.lora.rank", self.rank, "an integer >= 0 (0: no adapters)")
        targets = tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        check(len(targets) > 0 and set(targets) <= set(TARGETS) and len(set(targets)) == len(targets),
              "model.lora.targets", list(targets), f"a non-empty list of distinct values among {', '.join(TARGETS)}")
        check(not ("attention" in targets and set(PROJECTIONS) & set(targets)), "model.lora.targets", list(targets),
              "either 'attention' (every projection of the mixer) or some of 'qkv', 'o_proj', not both")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self, *, looped: bool, shared: bool, head_loop: bool, core_softmax: bool, layout: str) -> None:
        """How adapters combine with the model: they relax a shared core's tying, and
        adapt softmax attention, whose projections are module calls (a linear mixer's
        kernels read their weights directly)."""
        if not self.enabled:
            return
        check(looped, "model.lora.rank", self.rank, f"0 for the dense layout {layout!r}: adapters relax a looped core")
        check(shared, "model.lora.rank", self.rank,
              "0 with model.share_core=false (each iteration already has its own weights)")
        check(not head_loop, "model.lora.rank", self.rank,
              "0 with model.head_loop set (SGT's head passes slice the shared projections' weights)")
        if self.adapts_mixer:
            check(core_softmax, "model.lora.targets", list(self.targets),
                  "['mlp'] unless every core block's mixer is softmax attention (attention / sliding_window): "
                  "a linear mixer's kernels read their projections' weights directly")

    @property
    def adapts_mixer(self) -> bool:
        return any(t != "mlp" for t in self.targets)

    def adapts(self, name: str) -> bool:
        """Whether the mixer's linear ``name`` (``qkv``, ``o_proj``, ``gate``) gets adapters."""
        return "attention" in self.targets or name in self.targets

    def linear_shapes(self, mixer: dict[str, tuple[int, int]], mlp: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The (in, out) of every adapted linear of one block, given its mixer's (by name) and FFN's."""
        return [*(shape for name, shape in mixer.items() if self.adapts(name)), *(mlp if "mlp" in self.targets else ())]

    def parameter_count(self, shapes: Sequence[tuple[int, int]], iterations: int) -> int:
        """T · Σ r·(in + out) over the adapted linears (A_t: r × in, B_t: out × r)."""
        return iterations * sum(self.rank * (i + o) for i, o in shapes) if self.enabled else 0


class IterationLoRA(nn.Module):
    """A_t [r, in] and B_t [out, r] of one linear, one pair per loop iteration t (``A[t]``,
    ``B[t]``). Separate parameters, not one [T, r, in] tensor: iteration t's gradient is
    then its parameter's own, with no per-use select-backward into a T-sized zero tensor
    and no sum over iterations (tests/modules/test_lora.py keeps the operator count)."""

    def __init__(self, in_features: int, out_features: int, rank: int, iterations: int):
        super().__init__()
        self.A = nn.ParameterList(torch.empty(rank, in_features) for _ in range(iterations))
        self.B = nn.ParameterList(torch.empty(out_features, rank) for _ in range(iterations))
        self.reset_parameters()

    def extra_repr(self) -> str:
        r, i = self.A[0].shape
        return f"iterations={len(self.A)}, rank={r}, in={i}, out={self.B[0].shape[0]}"

    def reset_parameters(self) -> None:
        """A_t ~ N(0, 1/in), B_t = 0: the adapted linear starts as the shared one (Hu et al. 2021 §4.1)."""
        for A, B in zip(self.A, self.B, strict=True):
            nn.init.normal_(A, std=1 / math.sqrt(A.shape[-1]))
            nn.init.zeros_(B)

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """x: [..., in] -> B_t A_t x [..., out]."""
        return F.linear(F.linear(x, self.A[t]), self.B[t])

    def flop_cost(self, call: Call) -> Cost:
        """r·in + out·r MACs per row, and the add onto W'x as a bias-like term."""
        r, i = self.A[0].shape
        o = self.B[0].shape[0]
        return Cost(mac=call.rows * r * (i + o), bias=call.rows * o)


class AdaptedLinear(nn.Module):
    """The linear ``base`` at iteration ``t``: W' x (+ b) + B_t A_t x (Bae et al. §2.3).
    A view: it holds the stored linear and adapter, not copies, so a parameter swapped in
    under them (loading, FSDP2's gathers) is what it reads."""

    def __init__(self, base: nn.Linear, adapter: IterationLoRA, t: int):
        super().__init__()
        self.base, self.adapter, self.t = base, adapter, t

    def extra_repr(self) -> str:
        return f"iteration={self.t}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.adapter(x, self.t)

    def flop_cost(self, call: Call) -> Cost:
        return module_cost(self.base, call) + self.adapter.flop_cost(call)


def adapted_linears(module: nn.Module) -> dict[str, nn.Linear]:
    """The linears an adapter attaches to: ``module``'s direct ``nn.Linear`` children (the
    mixer's projections, the FFN's), by attribute name."""
    return {name: child for name, child in module.named_children() if isinstance(child, nn.Linear)}


def build_adapters(module: nn.Module, rank: int, iterations: int, adapts=lambda name: True) -> nn.ModuleDict:
    """One :class:`IterationLoRA` per linear of :func:`adapted_linears` that ``adapts``, keyed by its name."""
    return nn.ModuleDict({name: IterationLoRA(lin.in_features, lin.out_features, rank, iterations)
                          for name, lin in adapted_linears(module).items() if adapts(name)})


def iteration_view(module: nn.Module, adapters: nn.ModuleDict, t: int) -> nn.Module:
    """``module`` as it runs at iteration t: a shallow copy (same parameters, same
    submodules) whose adapted linears are :class:`AdaptedLinear` views. Not registered
    anywhere: the state dict holds ``module`` and ``adapters`` once."""
    view = copy.copy(module)
    children = dict(module._modules)
    for name, adapter in adapters.items():
        children[name] = AdaptedLinear(module._modules[name], adapter, t)
    view.__dict__["_modules"] = children  # the copy's own table; the original keeps its linears
    return view


class BlockLoRA(nn.Module):
    """A core block's adapters: ``attn[k]`` for its k-th mixer layer (one per parameter
    group), ``ffn`` for its FFN; each a ModuleDict linear name -> :class:`IterationLoRA`."""

    def __init__(self, cfg: LoRAConfig, iterations: int, mixer_layers: Sequence[nn.Module], ffn: nn.Module):
        super().__init__()
        self.attn = nn.ModuleList(build_adapters(m, cfg.rank, iterations, cfg.adapts) if cfg.adapts_mixer
                                  else nn.ModuleDict() for m in mixer_layers)
        self.ffn = build_adapters(ffn, cfg.rank, iterations) if "mlp" in cfg.targets else nn.ModuleDict()
        self.iterations = iterations

    def mixer_views(self, views: Sequence[nn.Module], owners: Sequence[int]) -> list[nn.Module]:
        """Iteration t's mixer: the block's view for t (``views``: one, or one per iteration;
        ``owners[t]``: the index of the mixer layer it views) with its linears adapted."""
        if not any(len(table) for table in self.attn):
            return list(views)
        pick = (lambda t: t) if len(views) > 1 else (lambda t: 0)
        return [iteration_view(views[pick(t)], self.attn[owners[pick(t)]], t) for t in range(self.iterations)]

    def ffn_views(self, ffn: nn.Module) -> list[nn.Module]:
        """Iteration t's FFN with its linears adapted (none when it has no adapters)."""
        if not len(self.ffn):
            return []
        return [iteration_view(ffn, self.ffn, t) for t in range(self.iterations)]


def svd_init(residual: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A, B of rank ``rank`` with B A the best rank-r approximation of ``residual`` [out, in]
    (Bae et al. §2.3: truncated SVD of W_l - W', B = U_r Σ_r, A = V_rᵀ); columns beyond
    min(out, in) are zero, so a rank at least min(out, in) gives B A = residual."""
    U, S, Vh = torch.linalg.svd(residual.double(), full_matrices=False)
    k = min(rank, S.shape[0])
    A = residual.new_zeros(rank, residual.shape[1])
    B = residual.new_zeros(residual.shape[0], rank)
    A[:k] = Vh[:k].to(residual.dtype)
    B[:, :k] = (U[:, :k] * S[:k]).to(residual.dtype)
    return A, B

