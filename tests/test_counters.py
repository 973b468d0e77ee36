"""bootseer/counters.py: the live counters behind a frozen statistics() answer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from bootseer.counters import Counters


@dataclass(frozen=True)
class Seen:
    reads: int = 0
    bytes: int = 0
    held: int = 0  #: not counted: given when asked


def test_counts_go_up_in_place_and_the_snapshot_is_a_frozen_copy():
    counters = Counters(Seen, ("reads", "bytes"))
    counters.reads += 2
    counters.bytes += 4096
    snapshot = counters.frozen(held=7)
    assert snapshot == Seen(reads=2, bytes=4096, held=7)
    counters.reads += 1
    assert snapshot.reads == 2 and counters.frozen(held=0).reads == 3  # the copy does not move
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.reads = 5  # type: ignore[misc]


def test_a_misspelt_or_uncounted_name_is_an_error_not_a_new_counter():
    counters = Counters(Seen, ("reads", "bytes"))
    with pytest.raises(AttributeError, match="counts no 'raeds'"):
        counters.raeds += 1
    with pytest.raises(AttributeError, match="counts no 'held'"):
        counters.held = 1
    with pytest.raises(TypeError, match=r"has no fields \['writes'\]"):
        Counters(Seen, ("reads", "writes"))
