"""A JSON object read from a stream of pieces, its large arrays one bounded element at a time.

The store's sealed objects (layer indexes, hot lists) are one JSON object whose size
lies in a few arrays of small elements.  ``json.loads`` of the whole document holds
the GIL for the whole parse (every other thread of the process waits, the FUSE loop
included) and builds every element before anyone can count them: a small zstd bomb
of tiny rows becomes gigabytes of Python objects.  :func:`read_document` instead

* never holds more than one element's text beyond the current decompressed piece,
* converts each element of a named array as soon as it is parsed (the caller's
  function turns a raw row into its compact object, so the raw lists are freed),
* refuses an array with more elements than its limit before parsing the one too many,
* refuses any single value longer than ``max_value_chars`` (nothing legitimate is),

and parses element by element in Python, so the interpreter switches threads between
elements.  The document must be one object; a key listed twice is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
#: How far before the buffer's end a parsed value must end to be sure it is whole (what of a
#: number a cut can hide past where it parsed short: ".", "e", "e+" and the like).
_NUMBER_TAIL = 16


@dataclass(frozen=True)
class ArrayRule:
    """How one top-level array is read: at most ``limit`` elements, each through ``convert``."""

    limit: int
    convert: Callable[[Any], Any]
    #: what the limit comes from, for the error ("the chain record's files")
    because: str = ""


class _Pieces:
    """The text of the document as it is decompressed: a buffer and a position in it."""

    def __init__(self, pieces: Iterator[bytes], what: str, error_type: type[ValueError]) -> None:
        self._pieces = pieces
        self.what = what
        self.error_type = error_type
        self.text = ""
        self.position = 0
        self.consumed = 0  #: characters dropped from the buffer's front (for error offsets)
        self.ended = False

    def more(self) -> bool:
        """Append the next piece (dropping what was parsed); False at the end."""
        piece = next(self._pieces, None)
        if piece is None:
            self.ended = True
            return False
        try:
            text = piece.decode("ascii")  # every writer escapes non-ASCII (ensure_ascii)
        except UnicodeDecodeError:
            raise self.error_type(f"{self.what} payload is not ASCII JSON") from None
        self.consumed += self.position
        self.text = self.text[self.position :] + text
        self.position = 0
        return True

    def peek(self) -> str:
        """The next character that is not white space ("" at the end), not consumed."""
        while True:
            self.position = _WHITESPACE.match(self.text, self.position).end()  # type: ignore[union-attr]
            if self.position < len(self.text):
                return self.text[self.position]
            if not self.more():
                return ""

    def expect(self, characters: str) -> str:
        # Compact JSON (as every writer writes it) has the separator right here: no regex.
        if self.position < len(self.text) and (found := self.text[self.position]) in characters:
            self.position += 1
            return found
        found = self.peek()
        if not found or found not in characters:
            raise self.error_type(
                f"{self.what} is not a JSON object as written: expected {' or '.join(map(repr, characters))} "
                f"at byte {self.offset}, found {found!r}"
            )
        self.position += 1
        return found

    @property
    def offset(self) -> int:
        return self.consumed + self.position

    def value(self, max_chars: int) -> Any:
        """The next JSON value, parsed on its own; error_type past ``max_chars`` characters."""
        if self.position >= len(self.text) or self.text[self.position] in " \t\n\r":
            self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, self.position)
            except ValueError:
                end = -1
            # A number cut by the piece's end parses short ("1." as 1, "2e" as 2): one that ends
            # near the buffer's end is parsed again with the next piece.
            if end != -1 and (len(self.text) - end > _NUMBER_TAIL or self.ended):
                self.position = end
                return value
            if len(self.text) - self.position > max_chars:
                raise self.error_type(
                    f"{self.what}: the JSON value at byte {self.offset} is not valid or is longer than {max_chars} bytes"
                )
            if not self.more():
                if end != -1:
                    self.position = end
                    return value
                raise self.error_type(f"{self.what}: the JSON value at byte {self.offset} is not valid or is cut short")


def read_document(
    pieces: Iterator[bytes],
    what: str,
    arrays: dict[str, ArrayRule],
    *,
    max_value_chars: int,
    error_type: type[ValueError] = ValueError,
) -> dict[str, Any]:
    """The JSON object whose text ``pieces`` yield, with each array named in ``arrays``
    read element by element through its :class:`ArrayRule` (a list of converted elements).

    ``error_type`` naming ``what`` for a document that is not one object, a repeated
    key, a value longer than ``max_value_chars``, an array over its limit, or text
    after the object; whatever a rule's ``convert`` raises goes through unchanged.
    """
    text = _Pieces(pieces, what, error_type)
    document: dict[str, Any] = {}
    text.expect("{")
    if text.peek() == "}":
        text.position += 1
    else:
        while True:
            key = text.value(max_value_chars)
            if not isinstance(key, str):
                raise error_type(f"{what}: a key at byte {text.offset} is not a string")
            if key in document:
                raise error_type(f"{what}: key {key[:40]!r} is listed twice")
            text.expect(":")
            rule = arrays.get(key)
            if rule is not None and text.peek() == "[":
                document[key] = _read_array(text, key, rule, max_value_chars)
            else:
                document[key] = text.value(max_value_chars)
            if text.expect(",}") == "}":
                break
    if text.peek() != "":
        raise error_type(f"{what}: text after the JSON object at byte {text.offset}")
    return document


def _read_array(text: _Pieces, key: str, rule: ArrayRule, max_value_chars: int) -> list[Any]:
    text.expect("[")
    items: list[Any] = []
    if text.peek() == "]":
        text.position += 1
        return items
    while True:
        if len(items) >= rule.limit:
            because = f" ({rule.because})" if rule.because else ""
            raise text.error_type(f"{text.what} has more than {rule.limit} {key}{because}")
        items.append(rule.convert(text.value(max_value_chars)))
        if text.expect(",]") == "]":
            return items
