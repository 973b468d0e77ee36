"""What the fetch engines count: the Prometheus metrics of every engine in the process, and one engine's figures.

The metrics are named ``bootseer_fetch_*``; each labelled metric has its label values made at import,
so a scrape shows them at zero before the first fetch.  :class:`EngineStatistics` is one engine at one
moment (:meth:`Engine.statistics <bootseer.fetch.engine.Engine.statistics>`), counted into a
:class:`~bootseer.counters.Counters` of it.  Both are counted by :mod:`bootseer.fetch.engine` and its
workers (:mod:`bootseer.fetch.workers`) only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import prometheus_client

from bootseer.fetch.source import ProxyStatus

BYTES_FETCHED = prometheus_client.Counter(
    "bootseer_fetch_bytes", "Stripe bytes read from sources (not from the disk cache)"
)
STRIPES = prometheus_client.Counter(
    "bootseer_fetch_stripes",
    "Stripe fetches finished, by outcome (fetched: from the source, cached: from the disk cache, failed)",
    ["outcome"],
)
RETRIES = prometheus_client.Counter("bootseer_fetch_retries", "Failed stripe fetches put back to be retried")
IN_FLIGHT = prometheus_client.Gauge("bootseer_fetch_in_flight_stripes", "Stripe fetches running now")
HELD_BYTES = prometheus_client.Gauge(
    "bootseer_fetch_held_bytes", "Stripe bytes held in memory (in flight and buffered), all engines"
)
EXTENTS = prometheus_client.Counter(
    "bootseer_fetch_extents", "Caller extents finished, by outcome (fetched from the source, failed)", ["outcome"]
)
EXTENT_REQUESTS = prometheus_client.Counter(
    "bootseer_fetch_extent_requests",
    "Range requests for caller extents, by how many extents each carried (single, coalesced)",
    ["kind"],
)
EXTENT_JOINS = prometheus_client.Counter(
    "bootseer_fetch_extents_joined",
    "Extents a more urgent caller asked for while a less urgent fetch of them was on its way (a read meeting a "
    "prefetch), by where that fetch was (in_flight: waited on, queued: its priority raised)",
    ["state"],
)
GAP_BYTES = prometheus_client.Counter(
    "bootseer_fetch_gap_bytes", "Bytes between coalesced extents that were fetched and thrown away"
)
CHUNKS = prometheus_client.Counter(
    "bootseer_fetch_chunks",
    "Chunks of fetched stripes checked against their file's digest list, by outcome (verified; failed: not served, "
    "fetched again or failed with EIO)",
    ["outcome"],
)
DIGEST_LISTS = prometheus_client.Counter(
    "bootseer_fetch_digest_lists",
    "Digest lists found beside files opened, by outcome (used; ignored: of another size or version, malformed, "
    "unreadable, or of a chunk size that does not divide the stripe size)",
    ["outcome"],
)
for _outcome in ("verified", "failed"):
    CHUNKS.labels(_outcome)
for _outcome in ("used", "ignored"):
    DIGEST_LISTS.labels(_outcome)
for _outcome in ("fetched", "cached", "failed"):
    STRIPES.labels(_outcome)
for _outcome in ("fetched", "failed"):
    EXTENTS.labels(_outcome)
for _kind in ("single", "coalesced"):
    EXTENT_REQUESTS.labels(_kind)
for _state in ("in_flight", "queued"):
    EXTENT_JOINS.labels(_state)


@dataclass(frozen=True)
class EngineStatistics:
    """One engine at one moment (:meth:`Engine.statistics <bootseer.fetch.engine.Engine.statistics>`): for status
    answers, metrics samplers, tests and benchmarks.  The engine counts into a
    :class:`~bootseer.counters.Counters` of it, its own."""

    bytes_fetched: int = 0  #: bytes read from the source
    stripes_fetched: int = 0  #: stripes read from the source
    cache_hits: int = 0  #: stripes served by the disk cache
    retries: int = 0  #: failed fetches put back to be retried
    failures: int = 0  #: stripes that failed for good
    evictions: int = 0  #: buffered stripes evicted to make room
    in_flight: int = 0  #: fetches running now
    held_bytes: int = 0  #: stripe bytes in flight or buffered now
    peak_held_bytes: int = 0  #: the most ``held_bytes`` has ever been
    extents_fetched: int = 0  #: caller extents read from the source
    extent_requests: int = 0  #: range requests that fetched extents
    coalesced_requests: int = 0  #: of those, requests that carried more than one extent
    gap_bytes: int = 0  #: bytes between coalesced extents, fetched and dropped (in ``bytes_fetched``)
    discards: int = 0  #: buffered extents and stripes dropped by ``Engine.discard`` and ``Engine.corrupt``
    extents_joined_in_flight: int = 0  #: urgent asks for an extent a less urgent fetch was already fetching
    extents_raised: int = 0  #: urgent asks for an extent queued at a lower priority, which they raised
    extents_read_ahead: int = 0  #: extents queued by ``Engine.readahead_extents``
    chunks_verified: int = 0  #: chunks of fetched stripes that matched their file's digest list
    chunks_failed: int = 0  #: chunks that did not (never served: fetched again once, then EIO)
    digest_lists_used: int = 0  #: files opened with a digest list that reads were verified against
    digest_lists_ignored: int = 0  #: digest lists found but not used (another version, malformed, unreadable...)
    proxy: ProxyStatus | None = None  #: the store proxy the source reads through, if it has one


#: What the engine counts itself (the rest of :class:`EngineStatistics` it asks for when asked).
COUNTED = tuple(field.name for field in dataclasses.fields(EngineStatistics) if field.name != "proxy")
