"""The one base class of expected failures.

An expected failure is caused by what the user gave (a config value, a data file, a
checkpoint on disk, a command-line argument, hyper-parameters that make training
diverge), not by a bug in looplm. Its message names what is wrong and what to change, so
the command line prints it as a single ``error:`` line and exits 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations


class LoopLMError(Exception):
    """Base of every expected failure; ``str(err)`` is the whole message a user needs.

    ``cli_hint``: the same advice in command-line terms, where it differs from the Python
    one (``--resume`` instead of ``resume=True``); the CLI shows it instead of the Python
    wording.
    """

    def __init__(self, message: str, cli_hint: str | None = None):
        super().__init__(message)
        self.cli_hint = cli_hint

    def for_cli(self) -> str:
        return str(self) if self.cli_hint is None else self.cli_hint


class TrainingDiverged(LoopLMError, RuntimeError):
    """Training stopped: too many consecutive steps had a non-finite loss or gradient norm."""


class MissingExtra(LoopLMError, ImportError):
    """An optional dependency is not installed; the message names the pip extra that brings it."""

