"""What bounds the peers' work: a priority limiter, a token bucket, a byte limiter, and per-peer store budgets.

:class:`PriorityLimiter` admits a client's requests to peers ``fetch_concurrency`` at a time,
this node's demand reads first; :class:`TokenBucket` paces a server's uploads to
``upload_rate`` and, one per asking peer, is :class:`PeerBudgets`: the store bytes each peer
may make this node fetch per :data:`~bootseer.blockstore.peers.config.BUDGET_WINDOW`;
:class:`ByteLimiter` holds a server's buffers within :func:`peer_memory_share` of
``memory_limit``.  What a limit refuses is a :class:`PeerRefused`, the answer the server sends.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass

import trio

from bootseer.blockstore.peers.config import BUDGET_WINDOW
from bootseer.blockstore.peers.stats import PEER_BUDGET_REFUSED, PEER_HELD_BYTES
from bootseer.fetch.engine import EngineConfig
from bootseer.log import get_logger

log = get_logger(__name__)

#: Asking peers whose budget is tracked at once (beyond it, those with a full budget are forgotten).
BUDGET_PEERS = 1024
#: The part of ``memory_limit`` peer serving may hold (the rest is the store engines'): 1/4.
PEER_MEMORY_PART = 4


class PriorityLimiter:
    """At most ``total`` holders at once; waiters admitted by priority (lower first), then in arrival order."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.busy = 0
        self._waiting: list[tuple[int, int, trio.Event]] = []
        self._order = itertools.count()

    async def acquire(self, priority: int) -> None:
        if self.busy < self.total and not self._waiting:
            self.busy += 1
            return
        entry = (priority, next(self._order), trio.Event())
        heapq.heappush(self._waiting, entry)
        try:
            await entry[2].wait()
        except BaseException:
            if entry[2].is_set():
                self.release()  # admitted and cancelled at once: pass the slot on
            else:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
            raise

    def release(self) -> None:
        if self._waiting:
            heapq.heappop(self._waiting)[2].set()  # the slot goes to the waiter: busy stays
        else:
            self.busy -= 1


class TokenBucket:
    """``rate`` bytes per second, in bursts of at most ``burst`` bytes (default: a second's worth; rate 0:
    unlimited).  :meth:`take` waits for the bytes; :meth:`try_take` takes them only if they are there."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = float(rate if burst is None else burst)
        self._level = self.burst
        self._stamp = time.monotonic()
        self._lock = trio.Lock()

    def level(self, now: float) -> float:
        """The bytes available at ``now`` (a :func:`time.monotonic` reading)."""
        return min(self.burst, self._level + (now - self._stamp) * self.rate)

    def _refill(self, now: float) -> None:
        self._level, self._stamp = self.level(now), now

    def try_take(self, amount: int, now: float) -> bool:
        """Take ``amount`` if the bucket holds it at ``now``; False (nothing taken) if not."""
        if self.rate <= 0:
            return True
        self._refill(now)
        if self._level < amount:
            return False
        self._level -= amount
        return True

    async def take(self, amount: int) -> None:
        if self.rate <= 0:
            return
        async with self._lock:  # one sender at a time: first come, first served
            self._refill(time.monotonic())
            self._level -= amount
            if self._level < 0:
                await trio.sleep(-self._level / self.rate)


def peer_memory_share(engine: EngineConfig) -> int:
    """Bytes of ``engine.memory_limit`` that serving peers may hold (fetched and raw blocks on their way to
    a peer): a :data:`PEER_MEMORY_PART` of it, less if the store's engine would keep less than a stripe.

    With peers on, each store's engine gets the rest (``memory_limit`` minus this), so the
    node's buffers stay within ``memory_limit`` (one store) however many peers ask.
    """
    return max(0, min(engine.memory_limit // PEER_MEMORY_PART, engine.memory_limit - engine.stripe_size))


class PeerRefused(Exception):
    """A peer's request this node will not serve: ``status``/``reason`` answer it, ``outcome`` counts it."""

    def __init__(self, status: int, reason: str, outcome: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.outcome = outcome


@dataclass
class _Budget:
    bucket: TokenBucket
    logged: float = -BUDGET_WINDOW


class PeerBudgets:
    """Store bytes each asking peer (by its address) may make this node fetch: ``budget`` bytes per
    :data:`BUDGET_WINDOW` seconds, refilled evenly, a window's worth at most (0: no limit) — a
    :class:`TokenBucket` per peer.

    Only store fetches are charged (a block served from memory or the node cache costs
    the store nothing).  A charge beyond what is left raises :class:`PeerRefused` (503),
    and the first refusal of a peer in a window is logged.
    """

    def __init__(self, budget: int, window: float = BUDGET_WINDOW) -> None:
        self.budget = budget
        self.window = window
        self._peers: dict[str, _Budget] = {}
        self.refused_bytes = 0

    def _state(self, peer: str, now: float) -> _Budget:
        state = self._peers.get(peer)
        if state is None:
            if len(self._peers) >= BUDGET_PEERS:  # forget the peers whose budget is whole again
                for other in [p for p, b in self._peers.items() if b.bucket.level(now) >= self.budget]:
                    del self._peers[other]
            state = self._peers[peer] = _Budget(TokenBucket(self.budget / self.window, burst=self.budget))
        return state

    def charge(self, peer: str, store_bytes: int) -> None:
        """Count ``store_bytes`` for ``peer``, or PeerRefused (503) if its budget has not that much left."""
        if self.budget <= 0:
            return
        now = time.monotonic()
        state = self._state(peer, now)
        if not state.bucket.try_take(store_bytes, now):
            self.refused_bytes += store_bytes
            PEER_BUDGET_REFUSED.inc(store_bytes)
            if now - state.logged >= self.window:
                state.logged = now
                log.warning("a peer asked for more store bytes than its budget; refusing them", peer=peer,
                            budget=self.budget, window=self.window)  # fmt: skip
            raise PeerRefused(503, f"Over Budget: this peer's {self.budget} store bytes per {self.window:g} s are spent",
                              "over_budget")  # fmt: skip

    def allowance(self, peer: str) -> _PeerAllowance:
        """What one request of ``peer`` may fetch (a :class:`~bootseer.blockstore.node.peers.PeerAllowance`)."""
        return _PeerAllowance(self, peer)


@dataclass(frozen=True)
class _PeerAllowance:
    budgets: PeerBudgets
    peer: str

    def charge(self, store_bytes: int) -> None:
        self.budgets.charge(self.peer, store_bytes)


class ByteLimiter:
    """At most ``total`` bytes held at once: :meth:`acquire` waits until ``length`` more fit."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.held = 0
        self.peak = 0
        self._changed = trio.Event()

    async def acquire(self, length: int) -> None:
        """Hold ``length`` bytes (PeerRefused (503) for more than ``total`` can ever hold)."""
        if length > self.total:
            raise PeerRefused(503, f"Busy: a block of {length} bytes is more than the {self.total} bytes peers may hold",
                              "busy")  # fmt: skip
        while self.held + length > self.total:
            await self._changed.wait()
        self.held += length
        self.peak = max(self.peak, self.held)
        PEER_HELD_BYTES.inc(length)

    def release(self, length: int) -> None:
        self.held -= length
        PEER_HELD_BYTES.dec(length)
        self._changed.set()
        self._changed = trio.Event()
