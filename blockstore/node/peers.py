"""The node's seam to its peer group: what a fetcher asks of other nodes, and hedging a fetch between them and the store.

The node package does not know the peers package (``blockstore.peers``): it defines what it
needs as protocols, and the layer server hands it an implementation.  :class:`PeerBlocks`
is the other nodes that may hold a block (``blockstore.peers.client.PeerClient``);
:class:`PeerAllowance` is what one peer's request may make this node fetch from the store
(``blockstore.peers.limits.PeerBudgets.allowance``).

:func:`fetch_hedged` gets blocks each from its owner in the peer group or, where this node
owns it or the owner is late or fails, from the store; both may run for one block, and the
first answer wins (docs/peers.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple, Protocol

import trio

from bootseer.blockstore.objects.format import BlockPlace, max_stored_length
from bootseer.fetch.stripes import FetchError, Priority


class PeerPayload(NamedTuple):
    """What an owner sends a peer for one block: the store's compressed frame of it, or its raw bytes.

    ``compressed``: ``body`` is a zstd frame the owner verified (it decompresses to the block and
    hashes to its digest), the one the store sent; the asker decompresses and verifies it as a
    frame from the store.  Otherwise ``body`` is the raw block (an owner holding no frame of it).
    """

    body: bytes
    compressed: bool


class PeerAllowance(Protocol):
    """What one peer's request may make this node fetch from the store (``blockstore.peers.server.PeerServer``)."""

    def charge(self, store_bytes: int) -> None:
        """Count ``store_bytes`` about to be fetched from the store for the peer; raises to refuse them."""


class _Uncharged:
    """The allowance of a peer's request nobody counts (a caller without a per-peer budget)."""

    def charge(self, store_bytes: int) -> None:
        pass


#: The allowance of a peer's request nobody counts.
UNCHARGED: PeerAllowance = _Uncharged()


class PeerBlocks(Protocol):
    """Other nodes that may hold a block (``blockstore.peers.client.PeerClient``), asked before the store."""

    def owner(self, digest: str) -> str | None:
        """The member to ask for block ``digest``, or None when this node gets it from the store itself."""

    async def fetch(self, store: str, places: Sequence[BlockPlace], priority: Priority,
                    deliver: Callable[[str, bytes], None], late: Callable[[str], None]) -> None:  # fmt: skip
        """``deliver`` each block a peer served and this node verified; name each one to get from the store
        too ``late`` (every block is one or both); never raises for what a peer does."""


async def fetch_hedged(
    peers: PeerBlocks,
    store: str,
    places: Sequence[BlockPlace],
    priority: Priority,
    from_store: Callable[[list[BlockPlace]], Awaitable[list[bytes]]],
    ready: Callable[[str, bytes], None],
    from_peer: Callable[[], None],
) -> list[bytes]:
    """Distinct stored blocks ``places``, verified, each from its owner among ``peers`` or from the store.

    ``store`` is the name the peer group gives the store.  A block this node owns, and one
    whose owner is late or fails, comes from ``from_store`` (a batch at a time: every block
    late by then goes in one call, so neighbours coalesce; it raises FetchError); the first
    answer wins and the other is cancelled.  ``ready`` is told each block (digest, verified
    bytes) as soon as it is had, before the others; ``from_peer`` counts each a peer served.
    Raises the store's FetchError when a block neither answered.
    """
    # A block stored larger than zstd's worst case for it (only a hand-made index has one) is
    # never asked of a peer: owners refuse such a request (peers.wire), and it would cost a skip.
    theirs = [place for place in places
              if place.clen <= max_stored_length(place.rlen) and peers.owner(place.digest) is not None]  # fmt: skip
    if not theirs:
        return await from_store(list(places))
    got: dict[str, bytes] = {}
    asked_store: set[str] = set()
    failures: list[FetchError] = []
    complete = trio.Event()
    by_digest = {place.digest: place for place in places}
    late_send, late_receive = trio.open_memory_channel[str](len(places) + 1)
    theirs_digests = {place.digest for place in theirs}
    for place in places:
        if place.digest not in theirs_digests:
            late_send.send_nowait(place.digest)  # this node owns it: the store, at once

    def deliver(digest: str, data: bytes) -> None:
        if digest in by_digest and digest not in got:
            got[digest] = data
            ready(digest, data)
            from_peer()
            if len(got) == len(by_digest):
                complete.set()

    def late(digest: str) -> None:
        if digest in by_digest and digest not in got and digest not in asked_store:
            asked_store.add(digest)
            late_send.send_nowait(digest)

    async def store_batch(batch: list[BlockPlace]) -> None:
        try:
            fetched = await from_store(batch)
        except FetchError as exc:
            if any(place.digest not in got for place in batch):
                failures.append(exc)
                complete.set()
            return
        for place, data in zip(batch, fetched):
            if place.digest not in got:
                got[place.digest] = data
                ready(place.digest, data)
        if len(got) == len(by_digest):
            complete.set()

    async def store_when_late(nursery: trio.Nursery) -> None:
        async for digest in late_receive:
            batch = [digest]
            while True:  # every block late by now goes in one call (neighbours coalesce)
                try:
                    batch.append(late_receive.receive_nowait())
                except trio.WouldBlock:
                    break
            wanted = [by_digest[digest] for digest in dict.fromkeys(batch) if digest not in got]
            if wanted:
                nursery.start_soon(store_batch, wanted)

    async def from_peers() -> None:
        await peers.fetch(store, theirs, priority, deliver, late)
        for place in theirs:  # the client names every block it did not deliver; in case it did not:
            late(place.digest)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(store_when_late, nursery)
        nursery.start_soon(from_peers)
        await complete.wait()
        nursery.cancel_scope.cancel()
    if failures and len(got) < len(by_digest):
        raise failures[0]
    return [got[place.digest] for place in places]
