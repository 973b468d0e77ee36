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

``~=`` compiles its value with RE2 (the ``google-re2`` binding), the engine Go's
``regexp`` follows: the same syntax (no backreferences or lookarounds) and matching in
time linear in the input, so a filter such as ``(a+)+$`` cannot stall the daemon.
As Go's parser, an expression that nests deeper than :data:`MAX_REGEX_NESTING` is
refused ("expression nests too deeply").

Matching asks an *adaptor*, ``fieldpath -> (value, present)``, for each field; an
absent field reads as ``""``, so ``parent!=""`` selects snapshots that have a parent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import re2

from .errors import InvalidArgument
from .types import Info, Kind

#: Go's ``regexp/syntax`` limit on the height of a parse tree (``maxHeight``).
MAX_REGEX_NESTING = 1000

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # the error goes back to the caller, not to stderr
_RE2_OPTIONS.never_capture = True  # only "does it match" is ever asked

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
    regex: "re2._Regexp | None" = None

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
            regex = self._compile(value)
        return Selector(fieldpath, operator, value, regex)

    def _compile(self, pattern: str) -> "re2._Regexp":
        def invalid(why: str) -> InvalidArgument:
            shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
            return InvalidArgument(f"filters: invalid regular expression {shown!r}: {why}")

        if _nesting(pattern) > MAX_REGEX_NESTING:
            raise invalid("expression nests too deeply")
        try:
            return re2.compile(pattern, _RE2_OPTIONS)
        except re2.error as exc:
            reason = exc.args[0] if exc.args else exc
            raise invalid(reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)) from None

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


def _nesting(pattern: str) -> int:
    """The deepest nesting of groups in ``pattern``, escapes and character classes skipped.

    RE2 itself accepts far deeper nesting than Go; counting groups is what keeps the
    two in step for the expressions that matter (a tree this tall is all groups).
    """
    depth = deepest = 0
    in_class = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "^":
                i += 1
            if pattern[i + 1 : i + 2] == "]":  # a leading "]" is a literal
                i += 1
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


_KIND_NAMES = {Kind.ACTIVE: "active", Kind.VIEW: "view", Kind.COMMITTED: "committed"}


def snapshot_adaptor(info: Info) -> Adaptor:
    """The filter fields of a snapshot, as containerd's ``adaptSnapshot`` exposes them."""

    def field(fieldpath: Sequence[str]) -> tuple[str, bool]:
        if not fieldpath:
            return "", False
        head = fieldpath[0]
        if head == "kind":
            return (_KIND_NAMES[info.kind], True) if info.kind in _KIND_NAMES else ("", False)
        if head == "name":
            return info.name, True
        if head == "parent":
            return info.parent, True
        if head == "labels":
            label = ".".join(fieldpath[1:])
            if label in info.labels:
                return info.labels[label], True
        return "", False

    return field
