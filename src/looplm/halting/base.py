"""The halting interface: after each macro step the loop shows the halting rule the
solution state; the rule decides which positions keep running and what is read out.

A rule owns its parameters (the halting or Q head) but not its per-forward bookkeeping,
which travels in a :class:`HaltState` so one module serves every forward."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from looplm.accounting.cost import Call, Step
from looplm.mixers.base import MixerContext
from looplm.streams.single import freeze
from looplm.topology.base import LoopState

@dataclasses.dataclass(frozen=True, eq=False)
class Readout:
    """How the model reads a solution state y [B, T, d]: ``norm`` (its final norm) and
    ``head`` (its LM head); calling it gives the logits head(norm(y)) [B, T, V].
    Hashed by identity (``eq=False``): the loop builds one per macro step, and under
    ``torch.compile`` Dynamo hashes the object while tracing its ``__init__``, before the
    fields a field-wise hash would read exist."""

    norm: Callable[[torch.Tensor], torch.Tensor]
    head: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(y))


#: what ``observe`` is handed to read logits of a solution state (final norm and head)
ReadLogits = Readout


@dataclasses.dataclass
class HaltState:
    """Per forward: ``running`` [B, T] bool, the positions the next macro step updates
    (halted ones are frozen); ``halted``, positions whose rule has fired; ``steps`` [B, T],
    the macro steps each position ran while not halted (its realised compute);
    ``readout`` the rule's accumulator; ``valid`` [B, T], real (non-padding) positions;
    ``losses`` the auxiliary losses, already weighted. Under :class:`NoHalting` nothing is
    per position: ``running`` and ``halted`` are None and ``steps`` is one host int."""

    running: Optional[torch.Tensor]
    halted: Optional[torch.Tensor]
    steps: Union[torch.Tensor, int]
    valid: torch.Tensor
    readout: Optional[torch.Tensor] = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # tensors; MoR's FirstStepKV
    losses: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    record: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)

    @property
    def done(self) -> bool:
        """Every position has halted (a host sync; asked only when halting can stop early)."""
        return bool(self.halted.all())


class Halting(nn.Module):
    """No halting: every position runs every step; the readout is the last state."""

    freezes = False  # whether halted positions stop updating (the loop may then stop early)
    #: whether a decoding cache must give positions that stopped early the entries of the
    #: later steps before a new position needs them (``LoopLM._catch_up``); false where the
    #: later steps keep no entries (MoR's recursive KV sharing reads the first step's)
    catches_up = True
    #: whether a full-loop (or static) decoding cache keeps each position's realised steps
    #: (``LoopCache.depth``): MoR's recursion-wise KV hides a cached position's keys from
    #: the steps it did not take
    keeps_depth = False
    #: whether the LM loss of the readout is the task term of the training loss; false where
    #: the rule's own losses hold the task loss (the exit gate's expected objective)
    trains_readout = True
    #: whether training updates the LM (every parameter outside the rule); false where the
    #: rule trains alone on a frozen LM (the exit gate's improvement objective, Ouro's Stage II)
    trains_lm = True
    #: whether the training loss reads the output of every macro step with gradient (a
    #: weighted readout, a per-step loss, a halted position's frozen state), so the backward
    #: reaches every step; false where it reads the last step's output alone. Where a step's
    #: output reaches the next step only through a pass without gradient
    #: (``streams.no_grad_cycles``), the earlier steps then have no backward at all.
    reads_every_step = True

    def reads_logits(self, targets: bool) -> bool:
        """Whether ``observe`` reads the solution's logits (final norm and head; under
        ``torch.no_grad`` unless ``trains_readout`` is false, where they carry the task loss)
        every step, in a forward given targets or not."""
        return False

    def step_calls(self, t: int, call: Call, readout: Readout, targets: bool) -> list[Step]:
        """The module calls of :meth:`observe` after macro step t, in order, as the execution
        plan lists them (``call``: the full forward at iteration t; ``targets``: whether the
        forward is given targets). A call that runs only given targets is ``targets_only``."""
        return []

    def begin(self, h: torch.Tensor, valid: torch.Tensor) -> HaltState:
        """Padding positions count as halted from the start when the rule freezes (they
        never hold the loop open); their logits are meaningless either way."""
        B, T = h.shape[:2]
        halted = ~valid if self.freezes else torch.zeros(B, T, dtype=torch.bool, device=h.device)
        return HaltState(running=~halted, halted=halted, steps=torch.zeros(B, T, dtype=torch.long, device=h.device),
                         valid=valid)

    def step_context(self, state: HaltState, ctx: MixerContext, cache, t: int) -> MixerContext:
        """The mixer context macro step t runs with (``cache``: the decoding cache or None):
        ``ctx`` itself, every position's keys visible. A rule that hides the keys of
        positions not taking the step (MoR's recursion-wise KV) narrows its ``valid``; one
        that shares the first step's keys and values (MoR's recursive KV sharing) sets its
        ``first_step_kv``."""
        return ctx

    def reuses_first_step_kv(self, t: int) -> bool:
        """Whether macro step t's softmax attention reads the keys and values the first step
        computed instead of projecting its own (Mixture-of-Recursions' recursive KV sharing,
        arranged by :meth:`step_context`); the FLOP rule then charges queries only."""
        return False

    def fold(self, state: HaltState, old: LoopState, new: LoopState, t: int) -> LoopState:
        """The loop state after macro step t from the state it read (``old``) and the step's
        output (``new``): halted positions keep ``old`` when the rule freezes. A rule that
        decides per step who takes it, from the state the step read (Mixture-of-Recursions'
        routers), decides and gates the update here; its calls are in ``step_calls``."""
        return freeze(old, new, state.running) if self.freezes else new

    def observe(self, state: HaltState, y: torch.Tensor, t: int, last: bool, read_logits: ReadLogits,
                targets: Optional[torch.Tensor]) -> None:
        """Called after macro step t (0-based) with the solution y [B, T, d]."""
        state.steps = state.steps + state.running.long()
        state.readout = y

    def finish(self, state: HaltState) -> torch.Tensor:
        """The state handed to the coda, [B, T, d]; adds the rule's losses to ``state.losses``."""
        return state.readout

    def reset_parameters(self, init_std: float) -> None:
        """Initialise own parameters (called by the model's init pass)."""


class NoHalting(Halting):
    """``halting: none``: every position runs every step, so the step count is one host
    int shared by all positions: no per-position tensor is made or updated per step (the
    model expands it once, :meth:`LoopLM._recur`)."""

    reads_every_step = False  # the readout is the last step's output

    def begin(self, h: torch.Tensor, valid: torch.Tensor) -> HaltState:
        return HaltState(running=None, halted=None, steps=0, valid=valid)

    def observe(self, state: HaltState, y: torch.Tensor, t: int, last: bool, read_logits: ReadLogits,
                targets: Optional[torch.Tensor]) -> None:
        state.steps += 1
        state.readout = y


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)
