"""containerd's filter syntax, parsed and matched the way containerd does it.

containerd clients filter listings (``ctr snapshots ls``, the snapshot GC's walk)
with strings such as::

    kind==committed,labels."containerd.io/gc.root"
    name~=/^sha256:/,parent!=""

The grammar (containerd ``filters/parser.go``)::

    selectors := selector ("," selector)*          -- all must match (AND)
    selector  := fieldpath [operator value]        -- no operator: "field is present"
    fieldpath := field ("." field)*
    field     := quoted | [A-Za-z0-9_]+
    operator  := "==" | "!=" | "~="                -- "~=" is an unanchored regex search
    value     := quoted | run of printable non-space characters except ","
    quoted    := "..." with Go escapes; "~=" also accepts /.../ and |...|

A list of filter strings matches when any of them matches (OR); an empty list or an
empty string matches everything.  Bad syntax raises :class:`InvalidArgument` naming
the position, as containerd does.  Unlike containerd, an invalid regular expression is
rejected while parsing instead of silently matching nothing.

Matching asks an *adaptor*, ``fieldpath -> (value, present)``, for each field; an
absent field reads as ``""``, so ``parent!=""`` selects snapshots that have a parent.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

from .errors import InvalidArgument

#: Looks up a field path (``["labels", "a.b"]``) on one object: ``(value, present)``.
Adaptor = Callable[[Sequence[str]], tuple[str, bool]]


class Filter(Protocol):
    def match(self, adaptor: Adaptor) -> bool: ...


class Operator(enum.Enum):
    PRESENT = "?"
    EQUAL = "=="
    NOT_EQUAL = "!="
    MATCHES = "~="


@dataclass(frozen=True)
class Selector:
    """One ``<fieldpath><operator><value>`` term."""

    fieldpath: tuple[str, ...]
    operator: Operator
    value: str = ""
    regex: re.Pattern[str] | None = None

    def match(self, adaptor: Adaptor) -> bool:
        value, present = adaptor(self.fieldpath)
        if self.operator is Operator.PRESENT:
            return present
        if self.operator is Operator.EQUAL:
            return present and value == self.value
        if self.operator is Operator.NOT_EQUAL:
            return value != self.value
        assert self.regex is not None
        return self.regex.search(value) is not None


@dataclass(frozen=True)
class All:
    """Matches when every filter matches (the ``,`` of one filter string)."""

    filters: tuple[Filter, ...]

    def match(self, adaptor: Adaptor) -> bool:
        return all(f.match(adaptor) for f in self.filters)


@dataclass(frozen=True)
class Any:
    """Matches when some filter matches (a list of filter strings)."""

    filters: tuple[Filter, ...]

    def match(self, adaptor: Adaptor) -> bool:
        return any(f.match(adaptor) for f in self.filters)


class _Always:
    def match(self, adaptor: Adaptor) -> bool:
        return True

    def __repr__(self) -> str:
        return "ALWAYS"


ALWAYS: Filter = _Always()


def parse(text: str) -> Filter:
    """Parse one filter string; ``""`` matches everything."""
    if text == "":
        return ALWAYS
    return _Parser(text).parse()


def parse_all(texts: Iterable[str] | None) -> Filter:
    """Parse several filter strings into their OR; none at all matches everything."""
    filters = tuple(parse(text) for text in texts or ())
    if not filters:
        return ALWAYS
    return Any(filters)


_FIELD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_OPERATOR_CHARS = frozenset("=!~")
_QUOTES = frozenset('"/|')  # "/" and "|" quote regular expressions (only after "~=")
_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\"}
_HEX_ESCAPE_DIGITS = {"x": 2, "u": 4, "U": 8}


class _Parser:
    """Recursive descent over one filter string; ``pos`` is the next character."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def parse(self) -> Filter:
        selectors = [self._selector()]
        while True:
            ch = self._peek()
            if ch == "":
                return All(tuple(selectors))
            if ch != ",":
                raise self._error(f"unexpected input {ch!r}; expected ',' or the end")
            self.pos += 1
            selectors.append(self._selector())

    def _selector(self) -> Selector:
        fieldpath = self._fieldpath()
        if self._peek() in ("", ","):
            return Selector(fieldpath, Operator.PRESENT)
        operator = self._operator()
        value = self._value(regex_quotes=operator is Operator.MATCHES)
        regex = None
        if operator is Operator.MATCHES:
            try:
                regex = re.compile(value)
            except re.error as exc:
                raise InvalidArgument(f"filters: invalid regular expression {value!r} in {self.text!r}: {exc}") from None
        return Selector(fieldpath, operator, value, regex)

    def _fieldpath(self) -> tuple[str, ...]:
        fields = [self._field()]
        while self._peek() == ".":
            self.pos += 1
            fields.append(self._field())
        return tuple(fields)

    def _field(self) -> str:
        ch = self._peek()
        if ch == '"':
            return self._quoted()
        if ch in _QUOTES:
            raise self._error(f"a field may only be quoted with '\"', not {ch!r}")
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _FIELD_CHARS:
            self.pos += 1
        if self.pos == start:
            raise self._error("expected a field name ([A-Za-z0-9_]+) or a quoted field")
        return self.text[start : self.pos]

    def _operator(self) -> Operator:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _OPERATOR_CHARS:
            self.pos += 1
        symbol = self.text[start : self.pos]
        for operator in (Operator.EQUAL, Operator.NOT_EQUAL, Operator.MATCHES):
            if symbol == operator.value:
                return operator
        if symbol:
            raise self._error(f"unsupported operator {symbol!r}; expected '==', '!=' or '~='", start)
        raise self._error("expected an operator ('==', '!=' or '~=')", start)

    def _value(self, regex_quotes: bool) -> str:
        ch = self._peek()
        if ch in _QUOTES:
            if ch != '"' and not regex_quotes:
                raise self._error(f"{ch!r} quotes only a regular expression (after '~=')")
            return self._quoted()
        if ch in ("", ",", ".") or ch in _OPERATOR_CHARS:
            raise self._error("expected a value or a quoted value")
        start = self.pos
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if ch == "," or ch.isspace() or not ch.isprintable():
                break
            self.pos += 1
        return self.text[start : self.pos]

    def _quoted(self) -> str:
        """Decode the quoted string at ``pos`` (Go escapes), leaving ``pos`` after it."""
        start = self.pos
        quote = self.text[start]
        self.pos += 1
        out: list[str] = []
        while True:
            if self.pos >= len(self.text) or self.text[self.pos] == "\n":
                raise self._error("quoted literal not terminated", start)
            ch = self.text[self.pos]
            if ch == quote:
                self.pos += 1
                return "".join(out)
            if ch != "\\":
                out.append(ch)
                self.pos += 1
                continue
            out.append(self._escape(quote))

    def _escape(self, quote: str) -> str:
        start = self.pos
        code = self.text[self.pos + 1 : self.pos + 2]
        self.pos += 2
        if code in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[code]
        if code == quote:
            return quote
        if code in _HEX_ESCAPE_DIGITS:
            digits = self.text[self.pos : self.pos + _HEX_ESCAPE_DIGITS[code]]
            self.pos += len(digits)
            if len(digits) == _HEX_ESCAPE_DIGITS[code] and all(c in "0123456789abcdefABCDEF" for c in digits):
                value = int(digits, 16)
                if value <= 0x10FFFF:
                    return chr(value)
            raise self._error("illegal numeric escape sequence", start)
        if code and code in "01234567":
            digits = code + self.text[self.pos : self.pos + 2]
            self.pos += 2
            if len(digits) == 3 and all(c in "01234567" for c in digits) and int(digits, 8) <= 255:
                return chr(int(digits, 8))
            raise self._error("illegal octal escape sequence", start)
        raise self._error(f"illegal escape sequence '\\{code}'", start)

    def _peek(self) -> str:
        """The next non-space character ('' at the end), skipping the spaces."""
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1
        return self.text[self.pos : self.pos + 1]

    def _error(self, message: str, pos: int | None = None) -> InvalidArgument:
        pos = self.pos if pos is None else pos
        if pos < len(self.text):
            where = f"{self.text[:pos]} >|{self.text[pos]}|< {self.text[pos + 1:]}"
        else:
            where = f"{self.text} >|<end>|<"
        return InvalidArgument(f"filters: parse error at position {pos}: [{where}]: {message}")
