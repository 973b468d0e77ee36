"""Asking owners for blocks: the peer client a node's fetchers share.

:class:`PeerClient` (the node asking) and :class:`~bootseer.blockstore.peers.server.PeerServer` (the node answering)
speak the protocol of :mod:`~bootseer.blockstore.peers.wire`.  What keeps a peer from
ever making a start slower or wrong:

* every block from a peer is checked against its SHA-256 and length before it is
  used (a compressed frame, as owners send when they hold the store's, is decompressed
  to at most the block's length first, as a frame from the store is); a bad one is counted (``bootseer_peer_requests_total{outcome="bad_block"}``),
  the peer is skipped, and the block is fetched from the store;
* a peer that sends nothing for ``deadline`` seconds (an owner at work on a store
  fetch sends ``102 Processing`` every :data:`~bootseer.blockstore.peers.wire.KEEPALIVE` seconds) makes the block
  *late*: the store is asked for it too, and whichever answers first is used
  (hedging; the other is cancelled); so does a peer that keeps talking without
  delivering: no block :data:`~bootseer.blockstore.peers.wire.PATIENCE` deadlines after asking however many keepalives
  came, or a body slower than :data:`MIN_BODY_RATE`;
* a peer that fails (refused or reset connection, a wrong token, a bad answer, a bad
  block, late or slow until the store answered, no block in :data:`REQUEST_LIMIT`) is
  skipped for ``skip_seconds``: its blocks go to the next owner in the ranking, which
  is often this node itself (the store).

The client is what the node package's fetchers see as their
:class:`~bootseer.blockstore.node.peers.PeerBlocks`: :meth:`PeerClient.owner` and
:meth:`PeerClient.fetch`.
"""

from __future__ import annotations

import hashlib
import math
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import trio

from bootseer import cpu
from bootseer.blockstore.objects.format import BlockPlace, decode_block, max_stored_length
from bootseer.blockstore.peers.config import PeerConfig, split_address
from bootseer.blockstore.peers.limits import PriorityLimiter
from bootseer.blockstore.peers.membership import Membership
from bootseer.blockstore.peers.ownership import rendezvous_score
from bootseer.blockstore.peers.stats import (
    PEER_BYTES, PEER_FALLBACKS, PEER_REQUESTS, PEER_SKIPPED, PeerCounters, PeerStatistics,
)  # fmt: skip
from bootseer.blockstore.peers.wire import (
    FRAME_ENCODING, PATIENCE, HttpStream, WireError, block_target, client_tls_context, content_length, parse_head,
)  # fmt: skip
from bootseer.fetch.stripes import Priority
from bootseer.log import get_logger

log = get_logger(__name__)

#: The longest a request to a peer lives after it was sent, late or not (then it is given up and the peer skipped).
REQUEST_LIMIT = 60.0
#: Bytes per second a peer's body must at least arrive at (a peer link is a cluster network: far faster).
MIN_BODY_RATE = 1 << 20
#: Idle connections kept per peer.
IDLE_PER_PEER = 4
#: Blocks whose owner ranking is kept (a few hundred bytes each), the oldest computed dropped first.
RANKINGS_KEPT = 1 << 16
#: Blocks at least this large are hashed in a worker thread (below it a thread hop costs more).
OFF_THREAD_BYTES = 256 << 10

_PRIORITY_NAMES = {Priority.DEMAND: "demand", Priority.READAHEAD: "readahead", Priority.PREFETCH: "prefetch"}


@dataclass
class PeerState:
    """What this node knows of one member it asks."""

    address: str
    ok: int = 0
    failures: int = 0
    skipped_until: float = 0.0
    last_error: str = ""
    idle: list[HttpStream] = field(default_factory=list)


class PeerClient:
    """Asks owners for blocks (see the module docstring); one per layer server, shared by its stores' fetchers."""

    def __init__(self, config: PeerConfig, membership: Membership, token: str | None,
                 threads: trio.CapacityLimiter, *, counters: PeerCounters | None = None) -> None:  # fmt: skip
        self.config = config
        self.deadline = config.deadline
        self.self_address = config.self_address
        self.membership = membership
        self._token = token
        self._threads = threads
        self._limiter = PriorityLimiter(config.fetch_concurrency)
        self._peers: dict[str, PeerState] = {}
        self._tls = client_tls_context(config.ca) if config.ca else None
        self._counters = counters if counters is not None else PeerCounters()
        self._rankings: dict[str, tuple[str, ...]] = {}  #: digest -> its ranking, for ``_ranked_members``
        self._ranked_members: tuple[str, ...] | None = None

    def statistics(self) -> PeerStatistics:
        """What this client counted (with a service's server, what both counted), as a frozen copy."""
        return self._counters.frozen()

    def _state(self, address: str) -> PeerState:
        state = self._peers.get(address)
        if state is None:
            state = self._peers[address] = PeerState(address)
        return state

    def _skipped(self, address: str, now: float) -> bool:
        state = self._peers.get(address)
        return state is not None and state.skipped_until > now

    def ranking(self, digest: str) -> tuple[str, ...]:
        """The members by their rendezvous score for block ``digest``, highest first, computed once per
        block and membership (a fetch asks for a block's owner several times: before, during and
        after the fetch; the scores are hashes)."""
        members = self.membership.members()
        if members is not self._ranked_members:
            self._ranked_members = members
            self._rankings.clear()
        ranking = self._rankings.get(digest)
        if ranking is None:
            if len(self._rankings) >= RANKINGS_KEPT:
                del self._rankings[next(iter(self._rankings))]  # the oldest computed
            ranking = self._rankings[digest] = tuple(
                sorted(members, key=lambda member: rendezvous_score(member, digest), reverse=True)
            )
        return ranking

    def owner(self, digest: str) -> str | None:
        """The member to ask for block ``digest``; None when this node owns it (fetch it from the store).

        The highest rendezvous score among the members not being skipped; this node
        is always a candidate (never skipped), so with every peer failing it owns all.
        """
        now = time.monotonic()
        for member in self.ranking(digest):
            if member == self.self_address:
                return None
            if not self._skipped(member, now):
                return member
        return None

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
                self._counters.fallbacks += 1
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
                        body, compressed = await self._answer(stream, place, fallback)
                    except (OSError, WireError, trio.BrokenResourceError) if reused else ():
                        # A kept-alive connection the peer has closed meanwhile: once more on a new one.
                        stream.close_now()
                        stream = await self._connect(state, fresh=True)
                        await stream.send(self._request(store, place, priority))
                        body, compressed = await self._answer(stream, place, fallback)
                except trio.TooSlowError:  # no connection within the deadline
                    self._counters.errors += 1
                    self._outcome("error")
                    self._failed(state, "no connection in time")
                    fallback("late")
                    return
                except (OSError, WireError, ssl.SSLError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self._counters.errors += 1
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
                    self._counters.errors += 1
                    self._outcome("error")
                    log.error("asking a peer failed", peer=state.address, exc_info=True)
                    self._failed(state, f"{type(exc).__name__}: {exc}")
                    fallback("error")
                    return
                data = await self._verified(place, body, compressed)
                if data is not None:
                    reusable = True
                    state.ok += 1
                    self._counters.received_blocks += 1
                    self._counters.received_bytes += len(body)
                    PEER_BYTES.labels("received").inc(len(body))
                    self._outcome("ok")
                    deliver(place.digest, data)
                else:
                    self._counters.bad_blocks += 1
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
        return f"GET {target} HTTP/1.1\r\nHost: bootseer-peer\r\nAccept-Encoding: {FRAME_ENCODING}\r\n{auth}\r\n".encode()

    async def _answer(self, stream: HttpStream, place: BlockPlace,
                      on_late: Callable[[str], None]) -> tuple[bytes, bool]:  # fmt: skip
        """The body of a 200 answer to ``place``'s request, and whether it is a compressed frame
        (1xx skipped; _Refused for another status).

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
                        self._counters.late += 1
                if scope.cancelled_caught:
                    on_late("slow")
                    self._counters.slow += 1
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
        encoding = headers.get("content-encoding", "")
        compressed = encoding == FRAME_ENCODING
        if compressed:
            length = content_length(headers, max_stored_length(place.rlen))
        elif encoding:
            raise WireError(f"answered in an encoding not asked for: {encoding[:40]!r}")
        else:
            length = content_length(headers, place.rlen)
            if length != place.rlen:
                raise WireError(f"answered {length} bytes for a block of {place.rlen}")
        body = await patiently(lambda timeout: stream.read_exact(length, timeout),
                               answer_patience + length / MIN_BODY_RATE)  # fmt: skip
        return body, compressed

    def _late_why(self, reason: str) -> str:
        """What a peer the store beat did, for its ``last_error`` (``reason`` as given to the fallback)."""
        if reason == "slow":
            return (f"kept talking without delivering: no block {PATIENCE} deadlines ({PATIENCE * self.deadline:g} s) "
                    f"after asking, or a body slower than {MIN_BODY_RATE >> 10} KiB/s")  # fmt: skip
        return f"silent for more than the {self.deadline} s deadline"

    async def _verified(self, place: BlockPlace, body: bytes, compressed: bool) -> bytes | None:
        """The raw block ``body`` is, or is the frame of, verified; None if it is not that block.

        A frame is decompressed (to at most the block's length) and hashed in one worker-thread
        call (zstd and hashlib release the GIL), a small one on this thread."""
        if len(body) != place.rlen and not compressed:
            return None
        if place.rlen < OFF_THREAD_BYTES:
            return _decoded(place, body, compressed)
        return await trio.to_thread.run_sync(_decoded, place, body, compressed, limiter=self._threads)

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


def _decoded(place: BlockPlace, body: bytes, compressed: bool) -> bytes | None:
    """The raw block ``body`` is (or is the frame of), verified; None if it is not that block."""
    with cpu.stage("decode"):
        if compressed:
            return decode_block(_Frame(place.digest, len(body), place.rlen), body)
        return body if hashlib.sha256(body).hexdigest() == place.digest else None


class _Frame(NamedTuple):
    """A peer's frame of a block, as :func:`~bootseer.blockstore.objects.format.decode_block` checks it."""

    digest: str
    clen: int
    rlen: int


class _Refused(Exception):
    def __init__(self, outcome: str, reusable: bool) -> None:
        super().__init__(outcome)
        self.outcome = outcome
        self.reusable = reusable
