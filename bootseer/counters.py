"""Live counters behind a typed, frozen ``statistics()`` answer.

A part that counts (the fetch engine, the peers) declares what it counts once, as a frozen
dataclass whose fields are what callers read and document them.  It counts into a
:class:`Counters` of that dataclass, which stays its own: attributes of the same names, counted
up (or down, for a level such as bytes in flight) in place, and nothing else (a misspelt counter
is an :class:`AttributeError`, not a new attribute nobody reads).  Its ``statistics()`` returns
:meth:`Counters.frozen`: a copy of the counts in the dataclass, with whatever else the
dataclass holds beyond them (a proxy's state, bytes held now) filled in by the caller.

Callers therefore read a snapshot that cannot change under them and cannot be written to, and
never the live counters (trio's ``statistics()`` habit).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, Iterable, TypeVar

S = TypeVar("S")


class Counters(Generic[S]):
    """The live counts of the frozen dataclass ``of``: one int attribute per counted field, from 0.

    ``counted``: the names of the fields counted here (default: all of them); the others are
    given to :meth:`frozen` by the caller.
    """

    __slots__ = ("_of", "_names", "_values")

    def __init__(self, of: type[S], counted: Iterable[str] | None = None) -> None:
        names = tuple(counted) if counted is not None else tuple(field.name for field in dataclasses.fields(of))
        known = {field.name for field in dataclasses.fields(of)}
        unknown = sorted(set(names) - known)
        if unknown:
            raise TypeError(f"{of.__name__} has no fields {unknown}")
        object.__setattr__(self, "_of", of)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_values", dict.fromkeys(names, 0))

    def __getattr__(self, name: str) -> int:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"{self._of.__name__} counts no {name!r}") from None

    def __setattr__(self, name: str, value: int) -> None:
        if name not in self._values:
            raise AttributeError(f"{self._of.__name__} counts no {name!r}")
        self._values[name] = value

    def __repr__(self) -> str:
        return f"<Counters of {self._of.__name__} {self._values}>"

    def counts(self) -> dict[str, int]:
        """A copy of the counts now, by name."""
        return dict(self._values)

    def frozen(self, **beyond: Any) -> S:
        """The dataclass of the counts now, with ``beyond`` (its fields that are not counted here)."""
        return self._of(**self._values, **beyond)
