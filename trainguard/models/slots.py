"""Kernel slots: several techniques change how one module computes, and they compose.

A module with a slot (``Attention.kernel``, ``FeedForward.kernel``) runs ``slot(module, default, *args)``
instead of its own body when the slot holds anything. The slot holds

* at most one **replacement** (``replaces=True``): computes the module's output itself and never calls
  the default body (ABFT's protected attention);
* any number of **wrappers** (``replaces=False``): get a ``call_next(*args)`` and decide how to call what
  is underneath (MeCeFO's skip-connection in backward wraps whatever attention runs, protected or not).

Wrappers run outermost-first in the order they were pushed; the replacement (or the default body) is
innermost. A second replacement is refused with a one-line error instead of silently overwriting the
first. ``push`` returns a remover. Relies on nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainguard.errors import TrainguardError

# replacement: fn(module, *args) -> out;  wrapper: fn(module, call_next, *args) -> out
KernelFn = Callable[..., Any]


@dataclass(frozen=True)
class _Entry:
    name: str
    fn: KernelFn
    replaces: bool


class KernelSlot:
    def __init__(self) -> None:
        self._entries: list[_Entry] = []

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __repr__(self) -> str:
        return f"KernelSlot({', '.join(e.name + ('*' if e.replaces else '') for e in self._entries)})"

    @property
    def names(self) -> list[str]:
        return [e.name for e in self._entries]

    def replacement(self) -> str | None:
        """The name of the installed replacement, if any."""
        return next((e.name for e in self._entries if e.replaces), None)

    def push(self, fn: KernelFn, *, name: str, replaces: bool = False) -> Callable[[], None]:
        """Install ``fn``; returns a function that removes exactly this entry."""
        if replaces and (current := self.replacement()) is not None:
            raise TrainguardError(f"kernel slot already holds the replacement {current!r}; cannot also install {name!r}")
        entry = _Entry(name, fn, replaces)
        self._entries.append(entry)
        return lambda: self._entries.remove(entry) if entry in self._entries else None

    def __call__(self, module: Any, default: Callable[..., Any], *args: Any) -> Any:
        wrappers = [e.fn for e in self._entries if not e.replaces]
        inner = next((e.fn for e in self._entries if e.replaces), None)

        def call(level: int, *a: Any) -> Any:
            if level < len(wrappers):
                return wrappers[level](module, lambda *b: call(level + 1, *b), *a)
            return inner(module, *a) if inner is not None else default(*a)

        return call(0, *args)
