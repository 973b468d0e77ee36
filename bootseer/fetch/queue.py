"""The fetch engine's queue: which stripe a worker fetches next, and which neighbours ride with it.

:class:`StripeQueue` holds the stripes (and caller extents) waiting for a worker of an
:class:`~bootseer.fetch.engine.Engine`:

* one priority queue, most urgent first (:class:`~bootseer.fetch.stripes.Priority`), first come,
  first served within a priority.  A stripe queued again more urgently gets a new entry; the old
  one goes stale and is skipped, as is the entry of a stripe no longer ``QUEUED`` (cancelled,
  taken as a neighbour);
* the stripes backing off after a failed fetch, by the time they are due again;
* the queued extents of each object version, by offset: where :meth:`StripeQueue.coalesce`
  finds the neighbours one range request fetches with the extent at the head;
* the wake-up of the workers waiting in :meth:`StripeQueue.take` (the queue, the memory or the
  evictable stripes changed).

It moves stripes between ``QUEUED`` and ``FETCHING`` only; whether a stripe's bytes fit in memory
is the engine's, asked through the ``reserve`` that :meth:`StripeQueue.take` is given, and what
happens to a stripe once fetched is the workers' (:mod:`bootseer.fetch.workers`) and the engine's.
All of it runs in the engine's trio thread.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable

import trio

from bootseer.fetch.stripes import Priority, Stripe, StripeState, span


class StripeQueue:
    """The stripes waiting for a fetch worker, their retries and their neighbours (see the module)."""

    def __init__(self, *, stripe_size: int, coalesce_gap: int, readahead_join: int) -> None:
        """``stripe_size``: the most one range request of coalesced extents spans; ``coalesce_gap``: the
        largest gap between extents it bridges; ``readahead_join``: the most READAHEAD bytes a DEMAND
        extent's request carries (:class:`~bootseer.fetch.engine.EngineConfig`)."""
        self.stripe_size = stripe_size
        self.coalesce_gap = coalesce_gap
        self.readahead_join = readahead_join
        self._queue: list[tuple[int, int, Stripe]] = []  # (priority, seq, stripe); stale entries skipped
        self._backoff: list[tuple[float, int, Stripe]] = []  # (due time, seq, stripe)
        self._seq = itertools.count()
        self._changed = trio.Event()
        self._starved = False  # a worker waits for memory that evictions could not free
        # The queued extents of each object version, by offset: where workers find neighbours to coalesce.
        self._queued_extents: dict[tuple[str, str], list[tuple[int, int, Stripe]]] = {}

    def enqueue(self, stripe: Stripe, priority: Priority) -> None:
        """Queue ``stripe`` at ``priority`` (again, more urgently: its older entry goes stale)."""
        stripe.state = StripeState.QUEUED
        stripe.queued_priority = priority
        heapq.heappush(self._queue, (priority, next(self._seq), stripe))
        if stripe.extent is not None and not stripe.indexed:
            bisect.insort(self._queued_extents.setdefault(stripe.object(), []), (stripe.offset, id(stripe), stripe))
            stripe.indexed = True
        self.notify()

    def back_off(self, stripe: Stripe, due: float) -> None:
        """``stripe`` (``BACKOFF``, after a failed fetch) is queued again at trio time ``due``, if it still is then."""
        heapq.heappush(self._backoff, (due, next(self._seq), stripe))
        self.notify()

    def unindex(self, stripe: Stripe) -> None:
        """Take a queued extent out of the table of neighbours (it is taken, cancelled or failed)."""
        if not stripe.indexed:
            return
        stripe.indexed = False
        queued = self._queued_extents[stripe.object()]
        position = bisect.bisect_left(queued, (stripe.offset, id(stripe)))
        assert queued[position][2] is stripe
        del queued[position]
        if not queued:
            del self._queued_extents[stripe.object()]

    def coalesce(self, head: Stripe) -> list[Stripe]:
        """``head`` and the queued extents beside it that one range request fetches with it, in offset order.

        Only extents queued at ``head``'s priority join it, and READAHEAD ones a
        DEMAND head, up to ``readahead_join`` bytes of them: a demand read must not
        wait for the prefetch of its neighbours, nor for much read-ahead.  Extents
        that overlap are not joined (each keeps a buffer of its own); gaps up to
        ``coalesce_gap`` are, and the request spans at most ``stripe_size`` bytes.
        """
        if head.extent is None or not head.indexed:
            return [head]
        queued = self._queued_extents[head.object()]
        at = bisect.bisect_left(queued, (head.offset, id(head)))
        cap, gap = self.stripe_size, self.coalesce_gap
        own = head.queued_priority
        riders = self.readahead_join if own is Priority.DEMAND else 0  # READAHEAD bytes still allowed

        def joins(stripe: Stripe) -> bool:
            nonlocal riders
            if stripe.queued_priority == own:
                return True
            if stripe.queued_priority is Priority.READAHEAD and stripe.length <= riders:
                riders -= stripe.length
                return True
            return False

        start, end = head.offset, head.offset + head.length
        after: list[Stripe] = []
        for _, _, stripe in queued[at + 1 :]:
            if not end <= stripe.offset <= end + gap or stripe.offset + stripe.length - start > cap:
                break
            if not joins(stripe):
                break
            after.append(stripe)
            end = stripe.offset + stripe.length
        before: list[Stripe] = []
        for _, _, stripe in reversed(queued[:at]):
            stripe_end = stripe.offset + stripe.length
            if not start - gap <= stripe_end <= start or end - stripe.offset > cap:
                break
            if not joins(stripe):
                break
            before.append(stripe)
            start = stripe.offset
        return [*reversed(before), head, *after]

    def notify(self) -> None:
        """Wake the workers waiting in :meth:`take`: the queue, memory or evictable stripes changed."""
        self._starved = False
        self._changed.set()
        self._changed = trio.Event()

    def evictable_changed(self) -> None:
        """A stripe lost a holder or a waiter, so it may be evictable now: wake a worker starved of memory."""
        if self._starved:
            self.notify()

    async def take(self, reserve: Callable[[Stripe, int | None], bool]) -> list[Stripe]:
        """The most urgent queued stripe whose bytes fit in memory, marked FETCHING; for
        an extent, with the neighbours one range request fetches with it (in offset order).

        ``reserve(stripe, length)`` counts ``length`` bytes (None: the stripe's) as held if they fit; the
        wait for room ends when :meth:`evictable_changed` or :meth:`notify` says memory may be free."""
        while True:
            now = trio.current_time()
            while self._backoff and self._backoff[0][0] <= now:
                _, _, stripe = heapq.heappop(self._backoff)
                if stripe.state is StripeState.BACKOFF:
                    held = stripe.priority()
                    self.enqueue(stripe, stripe.queued_priority if held is None else held)
            while self._queue and self._queue[0][2].state is not StripeState.QUEUED:
                heapq.heappop(self._queue)  # stale: cancelled, or queued again more urgently
            if self._queue:
                head = self._queue[0][2]
                group = self.coalesce(head)
                if len(group) > 1 and not reserve(head, span(group)):
                    group = [head]  # no room for its neighbours now: the head alone, like any stripe
                if len(group) > 1 or reserve(head, None):
                    heapq.heappop(self._queue)  # the others' entries go stale: they are no longer QUEUED
                    for stripe in group:
                        self.unindex(stripe)
                        stripe.state = StripeState.FETCHING
                    return group
                self._starved = True  # wake me when a buffered stripe may have become evictable
            with trio.move_on_at(self._backoff[0][0] if self._backoff else float("inf")):
                await self._changed.wait()


__all__ = ["StripeQueue"]
