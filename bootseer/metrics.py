"""The Prometheus endpoint shared by BootSeer's daemons.

Each package defines its own metrics with ``prometheus_client`` in the default
registry, prefixed ``bootseer_``; a daemon started with ``--metrics-address`` calls
:func:`serve_metrics` once to expose them all on ``/metrics``.
"""

from __future__ import annotations

import prometheus_client


def parse_address(address: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:PORT`` for IPv6) into its parts, with a clear error."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"metrics address must be HOST:PORT, not {address!r}")
    return host.strip("[]"), int(port)


def serve_metrics(address: str) -> tuple[str, int]:
    """Serve ``/metrics`` on ``address`` from a daemon thread; returns the bound (host, port)."""
    host, port = parse_address(address)
    server, _thread = prometheus_client.start_http_server(port, addr=host)
    bound_host, bound_port = server.server_address[:2]
    return bound_host, bound_port
