"""Layout notation of looped models, as the papers write it.

* ``4+8R2+4`` (MeSH, §B): a 4-block prelude, an 8-block core looped 2 times, a 4-block coda.
* ``2+4x{1,1}+2`` (SpiralFormer, §3): the same with one resolution per iteration; the
  number of entries is the iteration count T.
* ``12``: a dense 12-block transformer (no recurrence). ``8R4`` is a loop with no
  prelude or coda.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

from looplm.config_base import ConfigError

_RECURRENT = re.compile(
    r"^(?:(?P<pre>\d+)\+)?(?P<core>\d+)"
    r"(?:R(?P<reps>\d+)|x\{(?P<res>[^}]*)\})"
    r"(?:\+(?P<coda>\d+))?$"
)
_DENSE = re.compile(r"^(?P<n>\d+)$")
_ALLOWED = "'N' (dense), 'P+CRT+Q' (e.g. 4+8R2+4) or 'P+Cx{r_1,...,r_T}+Q' (e.g. 2+4x{1,1}+2)"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Block counts of prelude, core and coda; iterations T; one resolution per iteration."""

    prelude: int
    core: int
    coda: int
    resolutions: tuple[Fraction, ...]

    @property
    def iterations(self) -> int:
        return len(self.resolutions)

    @property
    def is_looped(self) -> bool:
        return self.core > 0 and self.iterations > 0

    @property
    def unrolled_depth(self) -> int:
        """Blocks on the unrolled computation path (N_compute of MeSH Appendix B)."""
        return self.prelude + self.core * self.iterations + self.coda

    def __str__(self) -> str:
        if not self.is_looped:
            return str(self.prelude + self.coda)
        if all(r == 1 for r in self.resolutions):
            middle = f"{self.core}R{self.iterations}"
        else:
            middle = f"{self.core}x{{{','.join(str(r) for r in self.resolutions)}}}"
        parts = ([str(self.prelude)] if self.prelude else []) + [middle] + ([str(self.coda)] if self.coda else [])
        return "+".join(parts)


def _fraction(text: str, field: str, layout: str) -> Fraction:
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise ConfigError(field, layout, f"resolution {text!r} is not a number like 1, 1/2 or 0.25") from None
    if not 0 < value <= 1:
        raise ConfigError(field, layout, f"resolution {text!r} must lie in (0, 1]")
    return value


def parse_layout(text: str, field: str = "model.layout") -> Layout:
    """Parse a layout string; raise ConfigError naming ``field`` if it does not parse."""
    compact = text.replace(" ", "") if isinstance(text, str) else text
    if not isinstance(compact, str):
        raise ConfigError(field, text, _ALLOWED)
    if dense := _DENSE.match(compact):
        n = int(dense["n"])
        if n < 1:
            raise ConfigError(field, text, "a dense layout needs at least 1 block")
        return Layout(prelude=n, core=0, coda=0, resolutions=())
    match = _RECURRENT.match(compact)
    if match is None:
        raise ConfigError(field, text, _ALLOWED)
    core = int(match["core"])
    if core < 1:
        raise ConfigError(field, text, "the looped core needs at least 1 block")
    if match["reps"] is not None:
        reps = int(match["reps"])
        if reps < 1:
            raise ConfigError(field, text, "the iteration count T must be >= 1")
        resolutions = (Fraction(1),) * reps
    else:
        entries = [e for e in match["res"].split(",")]
        if not entries or any(not e.strip() for e in entries):
            raise ConfigError(field, text, "x{...} needs one resolution per iteration, e.g. x{1,1}")
        resolutions = tuple(_fraction(e, field, text) for e in entries)
    return Layout(
        prelude=int(match["pre"] or 0),
        core=core,
        coda=int(match["coda"] or 0),
        resolutions=resolutions,
    )
