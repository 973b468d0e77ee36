"""The fetch engines' Prometheus metrics, one set for every engine in the process.

Named ``bootseer_fetch_*``; each labelled metric has its label values made at import, so a scrape
shows them at zero before the first fetch.  Counted by :mod:`bootseer.fetch.engine` only.
"""

from __future__ import annotations

import prometheus_client

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
for _outcome in ("fetched", "cached", "failed"):
    STRIPES.labels(_outcome)
for _outcome in ("fetched", "failed"):
    EXTENTS.labels(_outcome)
for _kind in ("single", "coalesced"):
    EXTENT_REQUESTS.labels(_kind)
for _state in ("in_flight", "queued"):
    EXTENT_JOINS.labels(_state)
