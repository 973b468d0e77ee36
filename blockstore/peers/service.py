"""Peer-assisted block sharing, wired for a layer server: a group of nodes fetches each block from the store about once.

The parts, one idea a module: who owns a block (:mod:`~bootseer.blockstore.peers.ownership`),
the member list (:mod:`~bootseer.blockstore.peers.membership`), the wire
(:mod:`~bootseer.blockstore.peers.wire`), the node asking (:mod:`~bootseer.blockstore.peers.client`)
and the node answering (:mod:`~bootseer.blockstore.peers.server`), the limits on both
(:mod:`~bootseer.blockstore.peers.limits`) and what they count (:mod:`~bootseer.blockstore.peers.stats`).

:class:`PeerService` ties them to a layer server: the membership watch and the
listener run in the server's nursery, ``peers.status`` is one of its control
operations, and each store's fetcher is given the client (:attr:`PeerService.client`).
What it reports is :meth:`PeerService.statistics` (a frozen
:class:`~bootseer.blockstore.peers.stats.PeerStatistics`), which ``peers.status`` builds on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from bootseer.blockstore.objects.format import DEFAULT_BLOCK_SIZE, max_stored_length
from bootseer.blockstore.peers.client import PeerClient
from bootseer.blockstore.peers.config import PeerConfig, read_token_file
from bootseer.blockstore.peers.membership import DnsMembers
from bootseer.blockstore.peers.server import BlockGetter, PeerServer, largest_format_block
from bootseer.blockstore.peers.stats import PEER_MEMBERS, PeerCounters, PeerStatistics
from bootseer.log import get_logger

log = get_logger(__name__)


class PeerService:
    """A layer server's peer sharing: membership, client, server and the ``peers.status`` operation.

    ``get_block`` finds a block for a peer (the layer server's, through its stores'
    fetchers); ``threads`` bounds hashing with the fetchers' own work.
    """

    def __init__(self, config: PeerConfig, get_block: BlockGetter, threads: trio.CapacityLimiter, *,
                 memory: int = 256 << 20, largest_block: Callable[[], int] = largest_format_block) -> None:  # fmt: skip
        self.config = config
        self.membership = config.check()
        token = read_token_file(config.token_file) if config.token_file else None
        counters = PeerCounters()  # the client's and the server's, read through statistics()
        self.client = PeerClient(config, self.membership, token, threads, counters=counters)
        self.server = PeerServer(config, token, get_block, counters=counters, memory=memory,
                                 largest_block=largest_block)  # fmt: skip
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

    def statistics(self) -> PeerStatistics:
        """The node's peer sharing now: what its client and server counted, what it holds, its connections."""
        return self.server.statistics()

    async def status(self) -> dict[str, Any]:
        """The ``peers status`` answer: the settings, each member as this node sees it, and :meth:`statistics`."""
        stats = self.statistics()
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
            "held_for_peers": {"bytes": stats.held_bytes, "peak": stats.held_peak, "limit": stats.held_limit},
            "connections": {"open": stats.connections_open, "authenticated": stats.connections_authenticated,
                            "limit": stats.connections_limit},
            "auth_failures": stats.auth_failures,
        }
