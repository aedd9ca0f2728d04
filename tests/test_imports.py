"""The import graph runs one way: the model's config composes the axes from above.

Read from the source with ``ast`` (nothing is imported), so the checks see imports under
``if TYPE_CHECKING:`` and inside functions as well as the ordinary ones; only the
core-install check imports every module, in a fresh interpreter without the extras.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import looplm

ROOT = Path(looplm.__file__).parent

#: Packages below the model: they are handed what they need (``BlockShape``, widths,
#: iteration counts) and never reach up to the model or its config.
LOWER = ("ops", "modules", "mixers", "topology", "halting", "streams", "resolution", "head_loop", "depth")
UPWARD = ("looplm.model_config", "looplm.model")
#: The model's side: the axes, the model and what it decodes and is measured with, its data.
#: Evaluation (``looplm.eval``) and the Hugging Face import and export (``looplm.hf``) read
#: a model from above.
MODEL_SIDE = (*LOWER, "model_config", "model", "cache", "generation", "init", "accounting", "data", "tasks")
#: Modules that need an extra, each refusing to import without it (``MissingExtra``).
NEEDS_EXTRA = ("looplm.hf.export", "looplm.eval.lm_eval")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, in_functions: bool) -> set[str]:
    """The looplm modules ``name`` imports (``from a.b import c`` names a.b.c when c is a
    module, else a.b); with ``in_functions`` also those imported inside functions."""
    found: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if inside and not in_functions:
                continue
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    found.add(target if target in MODULES else base)
            elif isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            visit(child, inside)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return {m for m in found if m in MODULES and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def _imports_upward(importers: tuple[str, ...], above: Callable[[str], bool]) -> list[str]:
    """"A imports B" for every module A of ``looplm.<importer>`` (a package or a module) and
    every module B that A imports, inside functions too, which ``above`` places above it."""
    return sorted(
        f"{name} imports {target}"
        for name, path in MODULES.items()
        if name.split(".")[1:2] and name.split(".")[1] in importers
        for target in _imports(name, path, in_functions=True)
        if above(target)
    )


def test_lower_layers_never_import_the_model_or_its_config():
    assert _imports_upward(LOWER, lambda target: target in UPWARD) == []


def test_the_model_side_never_imports_evaluation_or_hf():
    assert _imports_upward(MODEL_SIDE, lambda target: target.split(".")[1:2] in (["eval"], ["hf"])) == []


def test_a_core_install_imports_every_module_but_the_extras():
    """With transformers and lm-eval unimportable (a ``pip install looplm``), every module
    imports (the Hugging Face checkpoint import included) except those under
    :data:`NEEDS_EXTRA`, which name their extra."""
    names = sorted(n for n in MODULES if n != "looplm.__main__")
    script = (
        "import importlib, sys\n"
        "sys.modules['transformers'] = sys.modules['lm_eval'] = None\n"
        "from looplm.errors import MissingExtra\n"
        f"for name in {names!r}:\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except MissingExtra as err:\n        print('extra', name, err)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    refused = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("extra ")}
    expected = {n for n in names if n.startswith(NEEDS_EXTRA)}
    assert refused == expected, result.stdout
    assert all("pip install" in line for line in result.stdout.splitlines() if line.startswith("extra ")), result.stdout


def test_no_import_cycles():
    """No cycle among imports, those inside functions and under ``if TYPE_CHECKING:``
    included: a function-level import that closes a loop still ties two packages into one
    (the study runs the ladder; the ladder never reaches up to the study). The mixer kinds
    reach their base's dispatch table without one: the registry writes it
    (``looplm.mixers.config.KINDS``)."""
    graph = {name: _imports(name, path, in_functions=True) for name, path in MODULES.items()}
    cycles = [sorted(c) for c in _cycles(graph)]
    assert cycles == []


def test_the_checks_see_an_upward_import_and_a_cycle():
    """The graph reader is not vacuous: the model imports its config, a two-module loop is
    found, and the probes' in-function import of run loading counts as an upward import."""
    assert "looplm.model_config" in _imports("looplm.model", MODULES["looplm.model"], in_functions=False)
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]
    assert "looplm.probes imports looplm.eval.load" in _imports_upward(("probes",), lambda t: t.startswith("looplm.eval"))
