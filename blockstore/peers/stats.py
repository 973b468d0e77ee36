"""What the peers count: the Prometheus metrics, and the counters behind :meth:`PeerService.statistics`.

The client and the server of one :class:`~bootseer.blockstore.peers.service.PeerService` count
into one :class:`PeerCounters`, which stays inside this package; callers read a
:class:`PeerStatistics`, a frozen copy (``PeerService.statistics()``), and never the live counters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import prometheus_client

from bootseer.counters import Counters

PEER_BYTES = prometheus_client.Counter(
    "bootseer_peer_bytes",
    "Block bytes exchanged with peers as they crossed (compressed frames or raw blocks), by direction (received: from peers and verified, served: to peers)",
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


@dataclass(frozen=True)
class PeerCounts:
    """What a node's peer sharing counted: the part of :class:`PeerStatistics` that only goes up."""

    received_blocks: int = 0  #: blocks peers served this node, verified
    received_bytes: int = 0  #: the bytes that crossed: compressed frames, or raw blocks
    served_blocks: int = 0  #: blocks this node served peers
    served_bytes: int = 0  #: the bytes sent: compressed frames, or raw blocks
    late: int = 0  #: receives from a peer that waited past the deadline (the store asked too)
    slow: int = 0  #: requests whose peer kept talking without delivering (the store asked too)
    fallbacks: int = 0  #: blocks asked of a peer that the store was asked for too
    bad_blocks: int = 0  #: blocks from peers that failed verification
    errors: int = 0  #: requests to peers that failed on the connection or the protocol
    over_budget: int = 0  #: requests of peers refused because their fetch_budget was spent
    busy: int = 0  #: requests of peers answered 503 Busy: the queue full, or their block not got in BUSY_AFTER deadlines
    auth_failures: int = 0  #: requests to this node with a wrong or no token


@dataclass(frozen=True)
class PeerStatistics(PeerCounts):
    """A node's peer sharing at one moment (:meth:`PeerService.statistics
    <bootseer.blockstore.peers.service.PeerService.statistics>`): what it counted, and what it holds.

    A :class:`~bootseer.blockstore.peers.client.PeerClient` alone reports its counts and
    zeros for what only a server holds.
    """

    held_bytes: int = 0  #: bytes held for peers' requests now (fetched and raw)
    held_peak: int = 0  #: the most held at once
    held_limit: int = 0  #: the most that may be held (the peers' share of memory_limit)
    connections_open: int = 0  #: connections open to this node's peer listener
    connections_authenticated: int = 0  #: of them, those that made a request with the group's token
    connections_limit: int = 0  #: the cap on open connections in force


class PeerCounters(Counters[PeerStatistics]):
    """The live :class:`PeerCounts` of a node's client and server, counted up in place.

    This package's own: callers read a frozen :class:`PeerStatistics` (:meth:`frozen`, given the
    fields beyond the counts: what is held now).
    """

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(PeerStatistics, (counted.name for counted in dataclasses.fields(PeerCounts)))
