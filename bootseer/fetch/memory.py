"""The engine's memory bound: how many stripe bytes a fetch may hold, and whom it evicts.

Every stripe byte the :class:`~bootseer.fetch.engine.Engine` has in flight or
buffered counts against ``memory_limit``.  :class:`MemoryBound` says how much of
it a fetch at a given priority may fill: read-ahead and prefetch leave one stripe
to demand reads (when at least four stripes fit), so read-ahead yields to demand.
:func:`eviction_candidates` ranks the buffered stripes a fetch may evict to make
room, least wanted first (loose, then prefetched, then read ahead, then a long
read's later stripes, which only a demand fetch may evict), least recently used
first among equals.  The engine keeps the count of held bytes and does the
evicting; this module only decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bootseer.fetch.stripes import Priority, Stripe


@dataclass(frozen=True)
class MemoryBound:
    """The bytes fetches may hold: ``limit`` for demand, ``limit - demand_reserve`` for the rest."""

    limit: int  #: stripe bytes held (in flight + buffered), all files together
    demand_reserve: int  #: bytes read-ahead and prefetch leave to demand reads

    @classmethod
    def for_stripes(cls, memory_limit: int, stripe_size: int) -> MemoryBound:
        """Reserve one stripe for demand reads if at least four stripes fit in ``memory_limit``."""
        return cls(memory_limit, stripe_size if memory_limit // stripe_size >= 4 else 0)

    def limit_for(self, priority: Priority) -> int:
        """The held bytes a fetch at ``priority`` may bring the total up to."""
        return self.limit - (0 if priority is Priority.DEMAND else self.demand_reserve)


def eviction_candidates(buffered: Iterable[Stripe], priority: Priority) -> list[Stripe]:
    """The ``buffered`` stripes a fetch at ``priority`` may evict, least wanted and least recently used first.

    Nobody evicts a stripe a task is waiting on.  Only demand fetches evict
    stripes held for a read in progress, which that read will soon take.  Any
    fetch may evict speculative stripes (loose, prefetched, read ahead): were
    read-ahead and prefetch unable to evict each other, a prefetch could wait
    forever on memory held by the windows of idle open files.
    """
    loose = len(Priority)  # ranks below every hold
    ranked = []
    for stripe in buffered:
        if stripe.waiters:
            continue
        held = stripe.priority()
        rank = loose if held is None else int(held)
        if rank > Priority.DEMAND or priority is Priority.DEMAND:
            ranked.append((-rank, stripe.last_used, stripe))
    ranked.sort(key=lambda item: item[:2])
    return [stripe for _, _, stripe in ranked]
