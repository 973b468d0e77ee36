"""Peer-assisted block sharing: a group of nodes fetches each block from the store about once.

Every node of a group (a training job's nodes, a node pool) runs a layer server with
the same members (:mod:`~bootseer.blockstore.peers.membership`).  For each block a
node must fetch, one member is its *owner*: the member with the highest rendezvous
score ``blake2b(member, digest)`` among those not being skipped.  A node that owns
a block fetches it from the store itself; any other node asks the owner, which
serves it from memory or its node cache, or fetches it from the store once however
many members ask (its :class:`~bootseer.blockstore.node.fetcher.BlockFetcher` joins
concurrent requests), and then serves it.  So in a group of N nodes each block
crosses the store's link about once, and rendezvous hashing moves only the blocks
of a member that comes or goes.

:class:`PeerClient` (the node asking) and :class:`PeerServer` (the node answering)
speak the protocol of :mod:`~bootseer.blockstore.peers.wire`.  What keeps a peer from
ever making a start slower or wrong:

* every block from a peer is checked against its SHA-256 and length before it is
  used; a bad one is counted (``bootseer_peer_requests_total{outcome="bad_block"}``),
  the peer is skipped, and the block is fetched from the store;
* a peer that sends nothing for ``deadline`` seconds (an owner at work on a store
  fetch sends ``102 Processing`` every :data:`KEEPALIVE` seconds) makes the block
  *late*: the store is asked for it too, and whichever answers first is used
  (hedging; the other is cancelled); so does a peer that keeps talking without
  delivering: no block :data:`PATIENCE` deadlines after asking however many keepalives
  came, or a body slower than :data:`MIN_BODY_RATE`;
* a peer that fails (refused or reset connection, a wrong token, a bad answer, a bad
  block, late or slow until the store answered, no block in :data:`REQUEST_LIMIT`) is
  skipped for ``skip_seconds``: its blocks go to the next owner in the ranking, which
  is often this node itself (the store).

The owner serves only blocks it has verified (memory, its verifying node cache, or
just fetched and checked), ``max_uploads`` at once and at most ``upload_rate``
bytes per second in all, so serving never starves the node's own start; a request
beyond what it can queue is answered ``503`` at once, and one whose block it has not
got within :data:`BUSY_AFTER` deadlines ``503 Busy`` (the asker goes to the store and
does not skip it: an owner busy with its own reads is not a peer that never delivers).
What a member can make an owner do is bounded (docs/peers.md, "What a member can
make an owner do"): a request names at most the bytes its block can take
(``peer_wire``), a block no larger than the blocks of the layers this node serves,
and is fetched once (a made-up digest is refused, not fetched again); its store
fetch runs below the node's own reads (a peer's ``demand`` is this node's
READAHEAD), at most ``max_uploads`` at once, its buffers held within
:func:`peer_memory_share` of ``memory_limit``; and each asking peer may make the
node fetch at most ``fetch_budget`` store bytes per :data:`BUDGET_WINDOW` seconds
(``503`` beyond it, counted as ``over_budget``).
Requests must carry the group's token (``Authorization: Bearer``) unless the
server listens on loopback only; the token is read from a file and never logged.
A connection must send its request head within :data:`HEAD_DEADLINE`, at most
``max_connections`` are open (those that never authenticated are dropped first), and
a wrong token closes its connection and holds off its address (:class:`PeerServer`).
What a peer learns and what the network can get is in docs/peers.md.

:class:`PeerService` ties them to a layer server: the membership watch and the
listener run in the server's nursery, ``peers.status`` is one of its control
operations, and each store's fetcher is given the client (:meth:`PeerService.client`).
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import hmac
import itertools
import math
import os
import resource
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
import trio

from bootseer.blockstore.peers.membership import DnsMembers, FileMembers, Membership, StaticMembers
from bootseer.blockstore.peers.wire import (
    BLOCKS_PATH, PING_PATH, PROCESSING, HttpStream, WireError, block_target, client_tls_context,
    content_length, parse_block_target, parse_head, response_head, server_tls_context,
)  # fmt: skip
from bootseer.blockstore.objects.format import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, BlockPlace, max_stored_length
from bootseer.blockstore.node.peers import PeerAllowance
from bootseer.blockstore.peers.config import (
    BUDGET_WINDOW, PeerConfig, PeerConfigError, parse_address, read_token_file, split_address,
)  # fmt: skip
from bootseer.fetch.engine import EngineConfig, Priority
from bootseer.log import get_logger

log = get_logger(__name__)

#: An owner fetching a block from the store tells its asker it is at work this often.
KEEPALIVE = 0.1
#: The longest a request to a peer lives after it was sent, late or not (then it is given up and the peer skipped).
REQUEST_LIMIT = 60.0
#: Deadlines a peer that keeps talking may take before the store is asked too: to answer (its
#: ``102 Processing`` keepalives do not extend it), and to send a body beyond its length at MIN_BODY_RATE.
PATIENCE = 4
#: Bytes per second a peer's body must at least arrive at (a peer link is a cluster network: far faster).
MIN_BODY_RATE = 1 << 20
#: Deadlines an owner may take to get a peer's block and an upload slot for it before it answers
#: ``503 Busy`` instead (the asker then uses its store and does not skip it): fewer than PATIENCE, so
#: that an owner honestly at work below its own reads answers before its asker's patience runs out
#: (which would skip it as a peer that keeps talking without delivering).  Members share ``deadline``.
BUSY_AFTER = PATIENCE - 1
#: Idle connections kept per peer.
IDLE_PER_PEER = 4
#: An idle incoming connection is closed after this many seconds.
SERVER_IDLE = 60.0
#: A request head (and a TLS handshake before the first) must be whole this many seconds after the
#: connection was accepted, or, on a kept-alive connection, after the head's first byte.
HEAD_DEADLINE = 5.0
#: A failed authentication refuses its address's new connections this long, doubled for each failure
#: in a row up to AUTH_BACKOFF_MAX (a failure after a quiet AUTH_BACKOFF_MAX starts over).
AUTH_BACKOFF = 1.0
AUTH_BACKOFF_MAX = 60.0
#: Addresses whose failed authentications are remembered (the least recent beyond it are forgotten).
AUTH_ADDRESSES = 4096
#: Failed authentications are logged at most once in this many seconds (with how many there were).
AUTH_LOG_INTERVAL = 10.0
#: An accept that fails for want of file descriptors or memory is retried after this many seconds.
ACCEPT_RETRY = 0.1
#: Block requests an owner queues beyond those it serves before answering 503.
QUEUE_PER_UPLOAD = 8
#: Blocks at least this large are hashed in a worker thread (below it a thread hop costs more).
OFF_THREAD_BYTES = 256 << 10

#: Asking peers whose budget is tracked at once (beyond it, those with a full budget are forgotten).
BUDGET_PEERS = 1024
#: The part of ``memory_limit`` peer serving may hold (the rest is the store engines'): 1/4.
PEER_MEMORY_PART = 4

_PRIORITY_NAMES = {Priority.DEMAND: "demand", Priority.READAHEAD: "readahead", Priority.PREFETCH: "prefetch"}
#: The priority an owner fetches a peer's block at: below the node's own reads whatever the peer
#: says (a peer's demand read is this node's read-ahead; its read-ahead and prefetch, prefetch).
_SERVED_AT = {"demand": Priority.READAHEAD, "readahead": Priority.PREFETCH, "prefetch": Priority.PREFETCH}

PEER_BYTES = prometheus_client.Counter(
    "bootseer_peer_bytes",
    "Raw block bytes exchanged with peers, by direction (received: from peers and verified, served: to peers)",
    ["direction"],
)
PEER_REQUESTS = prometheus_client.Counter(
    "bootseer_peer_requests",
    "Block requests this node made to peers, by outcome (ok, missing: the owner had no way to it, refused: busy, "
    "error: connection or protocol failure, unauthorized, bad_block: failed verification, late: past the deadline, "
    "slow: kept talking without delivering, 102 Processing or a body too slow, past its patience)",
    ["outcome"],
)
PEER_FALLBACKS = prometheus_client.Counter(
    "bootseer_peer_fallbacks",
    "Blocks a peer was asked for that the store was asked for too, by why (late, slow, error, bad_block, missing, "
    "refused)",
    ["reason"],
)
PEER_SERVED = prometheus_client.Counter(
    "bootseer_peer_served",
    "Block requests peers made of this node, by outcome (ok, missing, unauthorized, busy: its queue full or its "
    "block not got within BUSY_AFTER deadlines, bad_request, "
    "over_budget: the asking peer's fetch_budget is spent, too_large: a block larger than any this node serves)",
    ["outcome"],
)
PEER_BUDGET_REFUSED = prometheus_client.Counter(
    "bootseer_peer_budget_refused_bytes",
    "Store bytes peers asked this node to fetch beyond their fetch_budget (refused with 503)",
)
PEER_HELD_BYTES = prometheus_client.Gauge(
    "bootseer_peer_held_bytes", "Bytes held for peers' requests now (compressed and raw), within the peers' memory"
)
PEER_CONNECTIONS = prometheus_client.Counter(
    "bootseer_peer_connections",
    "Connections to this node's peer listener, by what became of them (accepted; evicted: unauthenticated, dropped "
    "for a newer one at the connection cap; refused: at the cap with every connection authenticated; throttled: "
    "from an address refused after a failed authentication; head_timeout: no whole request head in time; "
    "accept_failed: an accept that failed for want of file descriptors or memory)",
    ["outcome"],
)
PEER_SKIPPED = prometheus_client.Gauge("bootseer_peer_skipped", "Peers being skipped after a failure")
PEER_MEMBERS = prometheus_client.Gauge("bootseer_peer_members", "Members of this node's peer group, itself included")


def peer_store_id(url_shown: str) -> str:
    """The name peers give a store: a hash of its URL as shown (credentials and query left out).

    Nodes of a group configured with one store agree on it; a hash of the whole URL
    would hand every peer a hash of the store's credentials.
    """
    return hashlib.sha256(b"bootseer peer store\0" + url_shown.encode()).hexdigest()[:32]


def rendezvous_score(member: str, digest: str) -> int:
    """The member's score for a block: the highest-scoring member owns it."""
    return int.from_bytes(hashlib.blake2b(member.encode() + b"\0" + digest.encode(), digest_size=8).digest(), "big")


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


@dataclass
class PeerState:
    """What this node knows of one member it asks."""

    address: str
    ok: int = 0
    failures: int = 0
    skipped_until: float = 0.0
    last_error: str = ""
    idle: list[HttpStream] = field(default_factory=list)


@dataclass
class PeerStats:
    received_blocks: int = 0
    received_bytes: int = 0
    served_blocks: int = 0
    served_bytes: int = 0
    late: int = 0
    slow: int = 0
    fallbacks: int = 0
    bad_blocks: int = 0
    errors: int = 0
    over_budget: int = 0  #: requests of peers refused because their fetch_budget was spent
    busy: int = 0  #: requests of peers answered 503 Busy: the queue full, or their block not got in BUSY_AFTER deadlines
    auth_failures: int = 0  #: requests to this node with a wrong or no token


class PeerClient:
    """Asks owners for blocks (see the module docstring); one per layer server, shared by its stores' fetchers."""

    def __init__(self, config: PeerConfig, membership: Membership, token: str | None,
                 threads: trio.CapacityLimiter, stats: PeerStats) -> None:  # fmt: skip
        self.config = config
        self.deadline = config.deadline
        self.self_address = config.self_address
        self.membership = membership
        self._token = token
        self._threads = threads
        self._limiter = PriorityLimiter(config.fetch_concurrency)
        self._peers: dict[str, PeerState] = {}
        self._tls = client_tls_context(config.ca) if config.ca else None
        self.stats = stats

    def _state(self, address: str) -> PeerState:
        state = self._peers.get(address)
        if state is None:
            state = self._peers[address] = PeerState(address)
        return state

    def _skipped(self, address: str, now: float) -> bool:
        state = self._peers.get(address)
        return state is not None and state.skipped_until > now

    def owner(self, digest: str) -> str | None:
        """The member to ask for block ``digest``; None when this node owns it (fetch it from the store).

        The highest rendezvous score among the members not being skipped; this node
        is always a candidate (never skipped), so with every peer failing it owns all.
        """
        now = time.monotonic()
        best, best_score = None, -1
        for member in self.membership.members():
            if member != self.self_address and self._skipped(member, now):
                continue
            score = rendezvous_score(member, digest)
            if score > best_score:
                best, best_score = member, score
        if best is None or best == self.self_address:
            return None
        return best

    def _failed(self, state: PeerState, why: str) -> None:
        state.failures += 1
        was_skipped = state.skipped_until > time.monotonic()
        if not was_skipped:  # the failure that started the skip, not what requests in flight met since
            state.last_error = why
        state.skipped_until = time.monotonic() + self.config.skip_seconds
        for stream in state.idle:  # connections to a failing peer are not reused
            stream.close_now()
        state.idle.clear()
        if not was_skipped:
            log.warning("peer failed; skipping it for a while", peer=state.address, error=why,
                        seconds=self.config.skip_seconds)  # fmt: skip
        PEER_SKIPPED.set(sum(1 for peer in self._peers.values() if peer.skipped_until > time.monotonic()))

    async def _connect(self, state: PeerState, *, fresh: bool = False) -> HttpStream:
        if state.idle and not fresh:
            return state.idle.pop()
        host, port = split_address(state.address)
        with trio.fail_after(self.deadline):
            stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
            if self._tls is not None:
                stream = trio.SSLStream(stream, self._tls, server_hostname=host, https_compatible=True)
                await stream.do_handshake()
        return HttpStream(stream)

    async def fetch(self, store: str, places: Sequence[BlockPlace], priority: Priority,
                    deliver: Callable[[str, bytes], None], late: Callable[[str], None]) -> None:  # fmt: skip
        """Ask each block's owner for it; ``deliver`` each verified block, ``late`` each one to get from the store too.

        Every block of ``places`` is either delivered or named late (possibly both: a
        late block may still be delivered).  Never raises for what a peer does;
        cancelled by the caller once it has every block.
        """
        async with trio.open_nursery() as nursery:
            for place in places:
                owner = self.owner(place.digest)
                if owner is None:
                    late(place.digest)  # this node owns it now (its owner is being skipped)
                    continue
                nursery.start_soon(self._ask, self._state(owner), store, place, priority, deliver, late)

    async def _ask(self, state: PeerState, store: str, place: BlockPlace, priority: Priority,
                   deliver: Callable[[str, bytes], None], late: Callable[[str], None]) -> None:  # fmt: skip
        told_late = ""  # why the store was asked too, once it was

        def fallback(reason: str) -> None:
            nonlocal told_late
            if not told_late:
                told_late = reason
                self.stats.fallbacks += 1
                PEER_FALLBACKS.labels(reason).inc()
                late(place.digest)

        await self._limiter.acquire(int(priority))
        stream: HttpStream | None = None
        reusable = False
        try:
            with trio.move_on_after(REQUEST_LIMIT):
                try:
                    reused = bool(state.idle)
                    stream = await self._connect(state)
                    try:
                        await stream.send(self._request(store, place, priority))
                        data = await self._answer(stream, place, fallback)
                    except (OSError, WireError, trio.BrokenResourceError) if reused else ():
                        # A kept-alive connection the peer has closed meanwhile: once more on a new one.
                        stream.close_now()
                        stream = await self._connect(state, fresh=True)
                        await stream.send(self._request(store, place, priority))
                        data = await self._answer(stream, place, fallback)
                except trio.TooSlowError:  # no connection within the deadline
                    self.stats.errors += 1
                    self._outcome("error")
                    self._failed(state, "no connection in time")
                    fallback("late")
                    return
                except (OSError, WireError, ssl.SSLError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self.stats.errors += 1
                    self._outcome("error")
                    self._failed(state, f"{type(exc).__name__}: {exc}")
                    fallback("error")
                    return
                except _Refused as refused:
                    self._outcome(refused.outcome)
                    if refused.outcome == "unauthorized":
                        self._failed(state, "the peer refused this node's token")
                    reusable = refused.reusable
                    fallback(refused.outcome)
                    return
                except Exception as exc:  # noqa: BLE001 - what a peer does must never fail a read
                    self.stats.errors += 1
                    self._outcome("error")
                    log.error("asking a peer failed", peer=state.address, exc_info=True)
                    self._failed(state, f"{type(exc).__name__}: {exc}")
                    fallback("error")
                    return
                if await self._verified(place, data):
                    reusable = True
                    state.ok += 1
                    self.stats.received_blocks += 1
                    self.stats.received_bytes += len(data)
                    PEER_BYTES.labels("received").inc(len(data))
                    self._outcome("ok")
                    deliver(place.digest, data)
                else:
                    self.stats.bad_blocks += 1
                    self._outcome("bad_block")
                    log.warning("a peer served a block that fails verification; getting it from the store",
                                peer=state.address, block=place.digest)  # fmt: skip
                    self._failed(state, "served a block that fails verification")
                    fallback("bad_block")
                return
            fallback("late")  # REQUEST_LIMIT passed (the store is failing too): this peer is failing
            self._outcome(told_late)
            self._failed(state, f"no block within {REQUEST_LIMIT:g} s")
        except trio.Cancelled:
            if told_late:  # the store answered first while this peer stayed silent or slow: it is failing
                self._outcome(told_late)
                self._failed(state, self._late_why(told_late))
            raise
        finally:
            self._limiter.release()
            if stream is not None:
                if reusable and len(state.idle) < IDLE_PER_PEER and state.skipped_until <= time.monotonic():
                    state.idle.append(stream)
                else:
                    await stream.aclose()

    def _request(self, store: str, place: BlockPlace, priority: Priority) -> bytes:
        target = block_target(store, place, _PRIORITY_NAMES.get(priority, "demand"))
        auth = f"Authorization: Bearer {self._token}\r\n" if self._token else ""
        return f"GET {target} HTTP/1.1\r\nHost: bootseer-peer\r\n{auth}\r\n".encode()

    async def _answer(self, stream: HttpStream, place: BlockPlace, on_late: Callable[[str], None]) -> bytes:
        """The body of a 200 answer to ``place``'s request (1xx skipped; _Refused for another status).

        A receive that waits more than the deadline calls ``on_late("late")`` (the store
        is asked meanwhile: hedged) and goes on waiting; so does a peer that keeps talking
        without delivering, with ``on_late("slow")``: no answer but ``102 Processing``
        :data:`PATIENCE` deadlines after the request, or a body slower than
        :data:`MIN_BODY_RATE` (beyond :data:`PATIENCE` deadlines).  The caller's
        REQUEST_LIMIT, or the store's answer, ends it.
        """

        slow = False  # found slow once: not again for this request

        async def patiently(read: Callable[[float], Awaitable[Any]], patience: float) -> Any:
            nonlocal slow
            while True:
                with trio.move_on_at(math.inf if slow else trio.current_time() + patience) as scope:
                    try:  # a read cut by the scope keeps what came (peer_wire)
                        return await read(self.deadline)
                    except trio.TooSlowError:
                        on_late("late")
                        self.stats.late += 1
                if scope.cancelled_caught:
                    on_late("slow")
                    self.stats.slow += 1
                    slow = True

        answer_patience = PATIENCE * self.deadline
        answered = trio.current_time() + answer_patience  # 1xx answers do not move it
        while True:
            head = await patiently(stream.read_head, answered - trio.current_time())
            if head is None:
                raise WireError("connection closed before an answer")
            _, status, headers = parse_head(head, request=False)
            if status.startswith("1"):
                continue
            break
        if status != "200":
            length = content_length(headers, 4096)
            if length:
                await patiently(lambda timeout: stream.read_exact(length, timeout), answer_patience)
            outcome = {"404": "missing", "503": "refused", "401": "unauthorized"}.get(status)
            if outcome is None:
                raise WireError(f"answered {status}")
            raise _Refused(outcome, headers.get("connection", "") != "close")
        length = content_length(headers, place.rlen)
        if length != place.rlen:
            raise WireError(f"answered {length} bytes for a block of {place.rlen}")
        return await patiently(lambda timeout: stream.read_exact(length, timeout),
                               answer_patience + length / MIN_BODY_RATE)  # fmt: skip

    def _late_why(self, reason: str) -> str:
        """What a peer the store beat did, for its ``last_error`` (``reason`` as given to the fallback)."""
        if reason == "slow":
            return (f"kept talking without delivering: no block {PATIENCE} deadlines ({PATIENCE * self.deadline:g} s) "
                    f"after asking, or a body slower than {MIN_BODY_RATE >> 10} KiB/s")  # fmt: skip
        return f"silent for more than the {self.deadline} s deadline"

    async def _verified(self, place: BlockPlace, data: bytes) -> bool:
        if len(data) != place.rlen:
            return False
        if len(data) < OFF_THREAD_BYTES:
            return hashlib.sha256(data).hexdigest() == place.digest
        digest = await trio.to_thread.run_sync(lambda: hashlib.sha256(data).hexdigest(), limiter=self._threads)
        return digest == place.digest

    @staticmethod
    def _outcome(outcome: str) -> None:
        PEER_REQUESTS.labels(outcome).inc()

    def status(self) -> list[dict[str, Any]]:
        """Each member as this node sees it."""
        now = time.monotonic()
        out = []
        for member in self.membership.members():
            if member == self.self_address:
                out.append({"address": member, "state": "self"})
                continue
            state = self._peers.get(member)
            entry: dict[str, Any] = {"address": member, "state": "ok"}
            if state is not None:
                entry.update(ok=state.ok, failures=state.failures)
                if state.skipped_until > now:
                    entry.update(state="skipped", skipped_for=round(state.skipped_until - now, 1),
                                 last_error=state.last_error)  # fmt: skip
            out.append(entry)
        return out

    async def aclose(self) -> None:
        for state in self._peers.values():
            for stream in state.idle:
                await stream.aclose()
            state.idle.clear()


class _Refused(Exception):
    def __init__(self, outcome: str, reusable: bool) -> None:
        super().__init__(outcome)
        self.outcome = outcome
        self.reusable = reusable


#: Finds the verified raw bytes of a block for a peer: (store id, place, priority, allowance) -> bytes,
#: or None when this node has no store of that id, the store fails (FetchError) or its bytes there
#: are not that block; a store fetch is charged to the allowance first (which raises PeerRefused).
BlockGetter = Callable[[str, BlockPlace, Priority, PeerAllowance], Awaitable[bytes | None]]


def _largest_format_block() -> int:
    return MAX_BLOCK_SIZE


#: Why an accept fails when the process or the system is out of file descriptors or memory.
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def connection_cap(wanted: int) -> int:
    """``wanted``, or half the process's file descriptor limit if that is less (the layer server needs the rest)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft // 2))


class AuthThrottle:
    """Failed authentications by source address: each refuses the address's new connections for a while.

    :data:`AUTH_BACKOFF` seconds after a first failure, doubled for each failure in a row
    up to :data:`AUTH_BACKOFF_MAX`; a success, or a quiet :data:`AUTH_BACKOFF_MAX` after the
    refusal ends, starts over.  At most :data:`AUTH_ADDRESSES` addresses are remembered.
    """

    def __init__(self) -> None:
        self._failed: dict[str, tuple[int, float]] = {}  #: address -> (failures in a row, refused until)

    def refused(self, host: str, now: float) -> bool:
        entry = self._failed.get(host)
        return entry is not None and entry[1] > now

    def failed(self, host: str, now: float) -> float:
        """Count a failure of ``host``; the seconds its new connections are refused from now."""
        failures, until = self._failed.pop(host, (0, 0.0))
        if now > until + AUTH_BACKOFF_MAX:
            failures = 0
        seconds = min(AUTH_BACKOFF * 2**min(failures, 16), AUTH_BACKOFF_MAX)
        self._failed[host] = (failures + 1, now + seconds)  # (re)inserted last: the most recent
        while len(self._failed) > AUTH_ADDRESSES:
            del self._failed[next(iter(self._failed))]
        return seconds

    def succeeded(self, host: str) -> None:
        self._failed.pop(host, None)


@dataclass(eq=False)
class _Connection:
    """A connection to the peer listener, while it is open."""

    stream: HttpStream
    host: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    authenticated: bool = False  #: it made a request with the group's token (or there is no token)
    evicted: bool = False  #: dropped at the connection cap (its socket is closed already)


class PeerServer:
    """Serves verified blocks to peers over HTTP(S) (see the module docstring).

    What a connection may hold: its request head must be whole :data:`HEAD_DEADLINE`
    seconds after the accept (after its first byte on a kept-alive connection), and at
    most ``max_connections`` are open (fewer if the file descriptor limit is low): at the
    cap a new connection evicts the oldest one that has not authenticated, or is answered
    503 and closed if every one has.  A request with a wrong token is answered 401 and its
    connection closed, and its address's new connections are answered 401 unread and
    closed for a while (:class:`AuthThrottle`).  An accept that fails for want of file
    descriptors is logged once, then counted, and drops the oldest unauthenticated
    connection to make room.

    ``memory`` bounds the bytes held for peers' requests at once (:func:`peer_memory_share`);
    ``largest_block`` says the largest block a request may name (the block size of the
    layers this node serves).
    """

    def __init__(self, config: PeerConfig, token: str | None, get_block: BlockGetter, stats: PeerStats, *,
                 memory: int = 256 << 20, largest_block: Callable[[], int] = _largest_format_block) -> None:  # fmt: skip
        self.config = config
        self._token = token.encode() if token else None
        self._get_block = get_block
        self._largest_block = largest_block
        self.budgets = PeerBudgets(config.fetch_budget)
        self.memory = ByteLimiter(memory)  #: bytes held for peers' requests (fetched and raw), all peers together
        self._getting = trio.CapacityLimiter(config.max_uploads)  # blocks got for peers at once
        self._uploads = trio.CapacityLimiter(config.max_uploads)
        self._bucket = TokenBucket(config.upload_rate)
        self._tls = server_tls_context(config.tls_cert, config.tls_key) if config.tls_cert and config.tls_key else None
        self.stats = stats
        self.address: tuple[str, int] | None = None  #: where it listens, once listening
        self._queued = 0
        self._connections: dict[HttpStream, _Connection] = {}  #: open ones, oldest first
        self.max_connections = connection_cap(config.max_connections)  #: the cap in force
        self._throttle = AuthThrottle()
        self._out_of_fds_logged = False
        self._auth_logged_at = -math.inf
        self._auth_unlogged = 0

    async def run(self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``config.listen`` and serve until cancelled (OSError if the address cannot be bound)."""
        assert self.config.listen is not None
        host, port = split_address(parse_address(self.config.listen))
        try:
            listeners: Sequence[trio.abc.Listener[Any]] = await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:
            raise ValueError(f"peers: cannot listen on {self.config.listen}: {exc.strerror or exc}") from None
        self.address = listeners[0].socket.getsockname()[:2]  # type: ignore[attr-defined]
        if self._tls is not None:
            listeners = [trio.SSLListener(listener, self._tls, https_compatible=True) for listener in listeners]
        log.info("serving blocks to peers", address=f"{self.address[0]}:{self.address[1]}",
                 tls=self._tls is not None, token=self._token is not None,
                 max_connections=self.max_connections)  # fmt: skip
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept, listener, nursery)
            task_status.started(self.address)

    def connections(self) -> dict[str, int]:
        """Open connections, those of them authenticated, and the cap."""
        authenticated = sum(1 for connection in self._connections.values() if connection.authenticated)
        return {"open": len(self._connections), "authenticated": authenticated, "limit": self.max_connections}

    async def _accept(self, listener: trio.abc.Listener[Any], nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    raw = await listener.accept()
                except OSError as exc:
                    if exc.errno not in _OUT_OF_DESCRIPTORS:
                        raise
                    if not self._out_of_descriptors(exc):
                        await trio.sleep(ACCEPT_RETRY)  # nothing to drop: wait for descriptors to come free
                    continue
                stream = HttpStream(raw)
                connection = self._admitted(stream)
                if isinstance(connection, _Connection):
                    nursery.start_soon(self._connection, connection)
                else:
                    await self._turn_away(stream, *connection)

    def _admitted(self, stream: HttpStream) -> _Connection | tuple[int, str]:
        """The accepted ``stream`` as an open connection, or the answer it is closed with at once: 401 when its
        address is held off after a failed authentication, 503 at the cap with no unauthenticated connection
        to evict."""
        host = stream.remote_host()
        if self._throttle.refused(host, time.monotonic()):
            PEER_CONNECTIONS.labels("throttled").inc()
            return 401, "Unauthorized: held off after a failed authentication"
        if len(self._connections) >= self.max_connections and not self._evict_one():
            PEER_CONNECTIONS.labels("refused").inc()
            return 503, "Busy: too many connections"
        PEER_CONNECTIONS.labels("accepted").inc()
        connection = _Connection(stream, host)
        self._connections[stream] = connection
        return connection

    async def _turn_away(self, stream: HttpStream, status: int, reason: str) -> None:
        """Answer ``status`` without reading the request (so that a member learns why: a bare close reads as a
        broken peer) and close the connection; over TLS, just close it (no handshake for it)."""
        if self._tls is None:
            body = reason.encode() + b"\n"
            with trio.move_on_after(ACCEPT_RETRY):  # a new connection's send buffer takes it at once
                try:
                    await stream.send(response_head(status, reason, len(body), close=True) + body)
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # it went away already
        stream.close_now()

    def _evict_one(self) -> bool:
        """Drop the oldest connection that has not authenticated; False if there is none."""
        victim = next((c for c in self._connections.values() if not c.authenticated), None)
        if victim is None:
            return False
        victim.evicted = True
        victim.scope.cancel()
        victim.stream.close_now()  # its descriptor is free now, not when its task next runs
        del self._connections[victim.stream]
        PEER_CONNECTIONS.labels("evicted").inc()
        return True

    def _out_of_descriptors(self, exc: OSError) -> bool:
        """Count and (once) log an accept that failed for want of descriptors; whether a connection was dropped."""
        PEER_CONNECTIONS.labels("accept_failed").inc()
        if not self._out_of_fds_logged:
            self._out_of_fds_logged = True
            log.warning("cannot accept peer connections: dropping unauthenticated ones to make room (logged once; "
                        "counted in bootseer_peer_connections_total{outcome=\"accept_failed\"})",
                        error=errno.errorcode.get(exc.errno or 0, "?"), reason=os.strerror(exc.errno or 0),
                        open=len(self._connections))  # fmt: skip
        return self._evict_one()

    async def _connection(self, connection: _Connection) -> None:
        stream = connection.stream
        try:
            with connection.scope:
                since: float | None = trio.current_time()  # the first head's deadline runs from the accept
                while True:
                    try:
                        head = await stream.read_head(HEAD_DEADLINE if since is not None else SERVER_IDLE,
                                                      whole=HEAD_DEADLINE, since=since)  # fmt: skip
                    except trio.TooSlowError:
                        if since is not None or stream.buffered():
                            PEER_CONNECTIONS.labels("head_timeout").inc()
                        return
                    since = None
                    if head is None:
                        return
                    if not await self._request(stream, head):
                        return
        except (WireError, OSError, ssl.SSLError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("peer connection ended", error=str(exc))  # it went away or broke the protocol
        except Exception:  # a bug here must cost one peer connection, never the layer server
            log.error("serving a peer failed", exc_info=True)
        finally:
            if not connection.evicted:
                del self._connections[stream]
                await stream.aclose()

    def _authorized(self, stream: HttpStream, headers: dict[str, str]) -> bool:
        """Whether a request carries the group's token (always true without one).

        A failure is counted, logged now and then (the address, never what it sent) and
        refuses its address's new connections for a while; the caller closes the connection.
        """
        connection = self._connections.get(stream)
        host = connection.host if connection is not None else ""
        if self._token is not None:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._token):
                self.stats.auth_failures += 1
                now = time.monotonic()
                refused_for = self._throttle.failed(host, now)
                self._auth_unlogged += 1
                if now - self._auth_logged_at >= AUTH_LOG_INTERVAL:
                    log.warning("a peer request failed authentication; its address is refused for a while",
                                address=host, refused_for=refused_for, failures=self._auth_unlogged,
                                interval=AUTH_LOG_INTERVAL)  # fmt: skip
                    self._auth_logged_at, self._auth_unlogged = now, 0
                return False
        self._throttle.succeeded(host)
        if connection is not None:
            connection.authenticated = True
        return True

    async def _reply(self, stream: HttpStream, status: int, reason: str, outcome: str, close: bool = False) -> None:
        PEER_SERVED.labels(outcome).inc()
        body = reason.encode() + b"\n"
        await stream.send(response_head(status, reason, len(body), close=close) + body)

    async def _request(self, stream: HttpStream, head: bytes) -> bool:
        """Answer one request; False when the connection must close after it."""
        try:
            method, target, headers = parse_head(head, request=True)
            if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
                raise WireError("a request has no body")
        except WireError:
            await self._reply(stream, 400, "Bad Request", "bad_request", close=True)
            return False
        keep = headers.get("connection", "").lower() != "close"
        if method != "GET":
            await self._reply(stream, 405, "Method Not Allowed", "bad_request", close=True)
            return False
        if target == PING_PATH:
            await stream.send(response_head(200, "OK", 3) + b"ok\n")
            return keep
        if not self._authorized(stream, headers):
            await self._reply(stream, 401, "Unauthorized", "unauthorized", close=True)
            return False
        if not target.startswith(BLOCKS_PATH):
            await self._reply(stream, 404, "Not Found", "bad_request")
            return keep
        try:
            store, place, priority = parse_block_target(target)
        except ValueError as exc:
            await self._reply(stream, 400, f"Bad Request: {exc}", "bad_request")
            return keep
        if place.rlen > self._largest_block():
            await self._reply(stream, 404, f"Not Found: no layer this node serves has blocks of {place.rlen} bytes",
                              "too_large")  # fmt: skip
            return keep
        if self._queued >= self.config.max_uploads * QUEUE_PER_UPLOAD:
            self.stats.busy += 1
            await self._reply(stream, 503, "Busy", "busy")
            return keep
        held = place.clen + place.rlen  # the most a request holds: the fetched bytes and the raw block
        taken = uploading = False

        async def get() -> bytes | None:
            """The block, with an upload slot taken for it; PeerRefused 503 if that takes BUSY_AFTER deadlines."""
            nonlocal taken, uploading
            with trio.move_on_after(BUSY_AFTER * self.config.deadline):
                await self.memory.acquire(held)
                taken = True
                async with self._getting:
                    allowance = self.budgets.allowance(_peer_host(stream))
                    data = await self._get_block(store, place, _SERVED_AT[priority], allowance)
                if data is not None:
                    await self._uploads.acquire_on_behalf_of(stream)
                    uploading = True  # (no checkpoint between: a cancel cannot leave the slot taken unnoted)
                return data
            raise PeerRefused(503, "Busy: the block is not at hand in time", "busy")

        self._queued += 1
        try:
            try:
                data = await self._block_with_keepalive(stream, get)
            finally:
                self._queued -= 1
            if isinstance(data, PeerRefused):
                if data.outcome == "over_budget":
                    self.stats.over_budget += 1
                elif data.outcome == "busy":
                    self.stats.busy += 1
                await self._reply(stream, data.status, data.reason, data.outcome)
                return keep
            if data is None:
                await self._reply(stream, 404, "Not Found", "missing")
                return keep
            await stream.send(response_head(200, "OK", len(data), kind="application/octet-stream"))
            view = memoryview(data)
            for start in range(0, len(view), 256 << 10):
                piece = view[start : start + (256 << 10)]
                await self._bucket.take(len(piece))
                await stream.send(piece)
        finally:
            if uploading:
                self._uploads.release_on_behalf_of(stream)
            if taken:
                self.memory.release(held)
        PEER_SERVED.labels("ok").inc()
        PEER_BYTES.labels("served").inc(len(data))
        self.stats.served_blocks += 1
        self.stats.served_bytes += len(data)
        return keep

    async def _block_with_keepalive(self, stream: HttpStream,
                                    get: Callable[[], Awaitable[bytes | None]]) -> bytes | PeerRefused | None:  # fmt: skip
        """What ``get`` gives (the block's bytes, None, or the PeerRefused it raised), telling the asker
        ``102 Processing`` every KEEPALIVE seconds meanwhile.

        WireError when the asker goes away meanwhile (the fetch for it is then cancelled).
        """
        result: list[bytes | PeerRefused | None] = []
        done = trio.Event()
        gone: BaseException | None = None

        async def run_get() -> None:
            try:
                result.append(await get())
            except PeerRefused as refused:
                result.append(refused)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_get)
            try:
                with trio.move_on_after(KEEPALIVE / 4):  # a block at hand needs no interim answer
                    await done.wait()
                while not done.is_set():
                    # Whole or not at all: a send cut by the block's arrival would garble the answer.
                    with trio.CancelScope(shield=True):
                        with trio.move_on_after(SERVER_IDLE) as scope:
                            await stream.send(PROCESSING)
                        if scope.cancelled_caught:
                            raise WireError("the asker reads nothing")
                    with trio.move_on_after(KEEPALIVE):
                        await done.wait()
            except (WireError, OSError, ssl.SSLError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                gone = exc  # raised below, outside the nursery, as itself rather than in an exception group
                nursery.cancel_scope.cancel()
        if gone is not None:
            raise WireError(f"the asker went away: {gone}")
        return result[0] if result else None


def _peer_host(stream: HttpStream) -> str:
    """The address a peer's connection comes from (its host: a member's port is a new one each connection)."""
    inner: object = stream.stream
    while hasattr(inner, "transport_stream"):
        inner = inner.transport_stream  # type: ignore[attr-defined]
    sock = getattr(inner, "socket", None)
    try:
        return str(sock.getpeername()[0]) if sock is not None else "?"
    except OSError:
        return "?"


class PeerService:
    """A layer server's peer sharing: membership, client, server and the ``peers.status`` operation.

    ``get_block`` finds a block for a peer (the layer server's, through its stores'
    fetchers); ``threads`` bounds hashing with the fetchers' own work.
    """

    def __init__(self, config: PeerConfig, get_block: BlockGetter, threads: trio.CapacityLimiter, *,
                 memory: int = 256 << 20, largest_block: Callable[[], int] = _largest_format_block) -> None:  # fmt: skip
        self.config = config
        self.membership = config.check()
        token = read_token_file(config.token_file) if config.token_file else None
        self.stats = PeerStats()
        self.client = PeerClient(config, self.membership, token, threads, self.stats)
        self.server = PeerServer(config, token, get_block, self.stats, memory=memory, largest_block=largest_block)
        if memory < DEFAULT_BLOCK_SIZE + max_stored_length(DEFAULT_BLOCK_SIZE):
            log.warning("memory_limit leaves serving peers less than one 1 MiB block: larger ones are answered 503",
                        peer_memory=memory)  # fmt: skip

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch the membership and serve peers until cancelled; started once listening."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch)
                await nursery.start(self.server.run)
                log.info("peer sharing on", node=self.client.self_address, **self.membership.describe())
                task_status.started()
        finally:
            await self.client.aclose()

    async def _watch(self) -> None:
        if isinstance(self.membership, DnsMembers):
            await self.membership.resolve()
        listed = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.membership.run)
            while True:
                members = self.membership.members()
                PEER_MEMBERS.set(len(members))
                if listed and not self.listed():  # once each time it goes missing
                    log.warning("this node is not in its member list: it owns no block and asks the members for "
                                "every one (docs/peers.md)", node=self.client.self_address,
                                **self.membership.describe())  # fmt: skip
                listed = self.listed()
                await trio.sleep(1)

    def listed(self) -> bool:
        """Whether this node's own address (``advertise``) is among its members."""
        return self.client.self_address in self.membership.members()

    def received_bytes(self) -> int:
        """Raw block bytes received from peers so far (verified)."""
        return self.stats.received_bytes

    async def status(self) -> dict[str, Any]:
        stats = self.stats
        listening = self.server.address
        return {
            "self": self.client.self_address,
            "self_listed": self.listed(),
            "listen": f"{listening[0]}:{listening[1]}" if listening else None,
            "membership": self.membership.describe(),
            "members": self.client.status(),
            "deadline": self.config.deadline,
            "fetch_budget": self.config.fetch_budget,
            "token": self.config.token_file is not None,
            "tls": self.config.tls_cert is not None,
            "received": {"blocks": stats.received_blocks, "bytes": stats.received_bytes},
            "served": {"blocks": stats.served_blocks, "bytes": stats.served_bytes},
            "late": stats.late,
            "slow": stats.slow,
            "fallbacks": stats.fallbacks,
            "bad_blocks": stats.bad_blocks,
            "errors": stats.errors,
            "over_budget": stats.over_budget,
            "busy": stats.busy,
            "held_for_peers": {"bytes": self.server.memory.held, "peak": self.server.memory.peak,
                               "limit": self.server.memory.total},
            "connections": self.server.connections(),
            "auth_failures": stats.auth_failures,
        }


__all__ = [
    "BlockGetter",
    "PeerClient",
    "PeerConfig",
    "PeerConfigError",
    "PeerServer",
    "PeerService",
    "PeerBudgets",
    "PeerRefused",
    "PeerStats",
    "PriorityLimiter",
    "TokenBucket",
    "peer_memory_share",
    "peer_store_id",
    "read_token_file",
    "rendezvous_score",
]
