"""Without lm-eval installed, the adapter is one clean error naming the extra."""

from __future__ import annotations

import sys

import pytest

from looplm.cli import main
from looplm.errors import MissingExtra


def test_missing_lm_eval_names_the_extra(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what a core install sees: no lm_eval to import
    monkeypatch.delitem(sys.modules, "looplm.eval.lm_eval", raising=False)
    with pytest.raises(MissingExtra, match=r"pip install 'looplm\[eval\]'"):
        import looplm.eval.lm_eval  # noqa: F401
    monkeypatch.delitem(sys.modules, "looplm.eval.lm_eval", raising=False)
    assert main(["lm-eval", "runs/x", "--tasks", "hellaswag"]) == 2
    assert "pip install 'looplm[eval]'" in caplog.text
