"""What a study's cached measures are keyed by: the source of the measuring code itself.

A run's measures are stored in its ``study.json`` and read back while the code that took
them is unchanged. That code is the measure function and what it reaches inside
``looplm.study``: the functions and classes it names (directly, through a nested function
or comprehension, or as ``module.name``), their own references in turn, and the plain data
constants they read. An edit elsewhere in the same module (a study's sizes, notes or wall
times beside the measure) leaves the fingerprint, and so the cached measures, as they are.
Library code outside the package (a metric in ``looplm.eval``) is not followed: the
measure's own arithmetic is what a re-measure protects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import sys
import types
from typing import Any, Callable, Iterator, Optional

#: where the measuring code lives: references into it are followed, others are not
PACKAGE = "looplm.study"
_DATA = (type(None), bool, int, float, complex, str, bytes)


def code_fingerprint(fn: Callable[..., Any], package: str = PACKAGE) -> str:
    """sha256 (16 hex digits) of ``fn``'s source, the sources of the functions and classes of
    ``package`` it reaches, and the values of the data constants they read."""
    parts: list[str] = []
    seen: set[int] = set()
    seen_data: set[tuple[str, int]] = set()

    def visit(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        source = _source(obj)
        parts.append(source or getattr(obj, "__qualname__", repr(obj)))
        if source is None:
            return
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        scope = vars(module) if module is not None else {}
        names = sorted(set(_names(obj)))
        for name in names:
            for value in _resolve(name, names, scope):
                if _inside(value, package):
                    visit(value)
                elif _is_data(value) and (name, id(value)) not in seen_data:
                    seen_data.add((name, id(value)))
                    parts.append(f"{name} = {_stable_repr(value)}")

    visit(fn)
    return _digest("\n".join(parts))


def _source(obj: Any) -> Optional[str]:
    """``obj``'s source, or None where it has none (a builtin, an interactive definition)."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _names(obj: Any) -> Iterator[str]:
    """Global and attribute names the code of a function (or of a class's methods) uses."""
    if inspect.isclass(obj):
        for member in vars(obj).values():
            member = getattr(member, "__func__", member)  # classmethod / staticmethod
            if isinstance(member, property):
                member = member.fget
            if inspect.isfunction(member):
                yield from _names(member)
        return
    stack = [getattr(obj, "__code__", None)]
    while stack:
        code = stack.pop()
        if code is None:
            continue
        yield from code.co_names
        stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]


def _resolve(name: str, names: list[str], scope: dict[str, Any]) -> Iterator[Any]:
    """What ``name`` is in the defining module; for a module, its members the code also names
    (``measures.lm`` appears as the names ``measures`` and ``lm``)."""
    value = scope.get(name)
    if isinstance(value, types.ModuleType):
        yield from (getattr(value, other) for other in names if hasattr(value, other))
    elif value is not None:
        yield value


def _inside(value: Any, package: str) -> bool:
    return ((inspect.isfunction(value) or inspect.isclass(value))
            and (value.__module__ == package or value.__module__.startswith(package + ".")))


def _is_data(value: Any) -> bool:
    if isinstance(value, _DATA):
        return True
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_is_data(v) for v in value)
    if isinstance(value, dict):
        return all(_is_data(k) and _is_data(v) for k, v in value.items())
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and all(
        _is_data(getattr(value, f.name)) for f in dataclasses.fields(value))


def _stable_repr(value: Any) -> str:
    """repr with sets sorted: a set of strings iterates in a per-process order."""
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({sorted(map(_stable_repr, value))})"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({[_stable_repr(v) for v in value]})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_stable_repr(k)}: {_stable_repr(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={_stable_repr(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    return repr(value)
