"""The layer server's seam for extensions: what an extension may use of the server, and what it offers.

The layer server (:mod:`.layer_server`) knows no extension by name.  Whoever runs it
(the ``bootseer layer-server`` main, :mod:`bootseer.snapshotter.layer_daemon`) hands it
an :data:`ExtensionFactory`; the server calls it once with itself seen as a
:class:`LayerHost` -- the narrow view of the served layers an extension needs -- and then
uses what comes back only as a :class:`ServerExtension`: a read observer of every served
layer, a hook when a layer is mounted, a family of control operations, and the fields
it adds to the server's status answer.  The hot-list service (:mod:`bootseer.hotlist`)
is the one extension today; the import arrows run from it to this module, never back.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import trio

from bootseer.blockstore.datapath.local_blobs import LocalBlob
from bootseer.blockstore.datapath.tree import ReadObserver
from bootseer.blockstore.node.block_cache import BlockCache
from bootseer.blockstore.node.fetcher import BlockFetcher
from bootseer.blockstore.objects.format import LayerIndex
from bootseer.blockstore.objects.signing import SigningKey, TrustPolicy
from bootseer.blockstore.server.layer_table import Layer
from bootseer.blockstore.server.ops import ControlOps
from bootseer.fetch.engine import Engine
from bootseer.fuse.mount import FuseSession
from bootseer.paths import ServerPaths


class LayerHost(Protocol):
    """What an extension may use of the layer server that runs it."""

    paths: ServerPaths  #: where a layer's lower dir is, per data path
    layers: Mapping[str, Layer]  #: the served layers, by ChainID (their slot, store, tree and data path)
    cache: BlockCache | None  #: the node cache (prefetch skips what it holds)
    decode_threads: trio.CapacityLimiter  #: the limiter for CPU work off the FUSE loop
    nursery: trio.Nursery  #: where the extension's tasks run, for the server's lifetime
    session: FuseSession | None  #: the FUSE session (None: no page cache to warm)

    @property
    def trust(self) -> TrustPolicy:
        """The node's trust policy (which keys a store object must be signed by)."""
        ...

    @property
    def sign_key(self) -> SigningKey | None:
        """The node's own signing key (what it publishes is signed with it), or None."""
        ...

    async def fetcher(self, store: str) -> tuple[Engine, BlockFetcher]:
        """The engine and the block fetcher of store ``store``."""
        ...

    def local_blob(self, chain_id: str) -> LocalBlob | None:
        """The local blob of served layer ``chain_id`` on the ``fanotify`` data path (None on the others)."""
        ...

    async def layer_index(self, chain_id: str) -> LayerIndex:
        """The JSON index (the file list) of served layer ``chain_id``, for what needs its files: the layer's tree
        index, or for a layer served from its block table, its index loaded now (the local copy, else the
        store's, verified against the chain record).  LayerServerError, FormatError, FetchError if it cannot be had."""
        ...


class ServerExtension(ReadObserver[Any], Protocol):
    """What the layer server uses of an extension (besides observing every read of its layers)."""

    def layer_mounted(self, chain_id: str) -> None:
        """Layer ``chain_id`` has just been mounted (or restored at start)."""
        ...

    def register_ops(self, control: ControlOps) -> None:
        """Register the extension's control operations (a family under its own prefix)."""
        ...

    def status_fields(self) -> dict[str, Any]:
        """Fields the extension adds to the server's ``status`` answer (no secret in them)."""
        ...


#: Builds the extension, given the server that will run it.
ExtensionFactory = Callable[[LayerHost], ServerExtension]
