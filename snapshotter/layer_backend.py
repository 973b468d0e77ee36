"""The daemon's :class:`~.backend.LayerBackend`: the store's chain records and the FUSE layer server.

``lookup`` reads the chain record straight from the store through the fetch engine
(:class:`bootseer.blockstore.objects.store.StoreReader`), so the snapshot logic can check the
parent before anything is mounted, and keeps its bytes for the layer's ``mount``, which hands
them to the layer server: a layer's record is read from the store once per Prepare, not once
here and again in the server (which decodes and trust-checks what it is handed as its own read).
``mount``/``check``/``unmount``/``mounted`` go to the long-lived layer server (``bootseer layer-server``) over its control socket
(:mod:`bootseer.blockstore.server.client`), which the daemon starts at start-up with
:func:`~bootseer.blockstore.server.client.ensure_server` and finds again after its own
restart.  A server that died is started again by the next call that finds it gone
(once per call), so new containers work again without a daemon restart.

Each layer-server error kind maps to a :class:`~.errors.LayerUnavailable` reason; a
store that fails is never read as "not converted".
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import prometheus_client
import trio

from bootseer.blockstore.server import client as control
from bootseer.paths import ServerPaths
from bootseer.blockstore.objects.format import ChainRecord, FormatError
from bootseer.blockstore.objects.signing import TrustPolicy, Untrusted
from bootseer.blockstore.objects.store import open_store
from bootseer.fetch.engine import EngineConfig
from bootseer.fetch.source import SourceError
from bootseer.fetch.sources import redact_url
from bootseer.log import get_logger

from .backend import ControlRequest, RemoteLayer
from .errors import LayerUnavailable

log = get_logger(__name__)

#: A chain-record lookup gives up after this long (the fetch's retries included): a
#: store that does not answer makes Prepare fall back to downloading soon, not after
#: the mount's full retry timeout.
LOOKUP_TIMEOUT = 10.0

#: Chain records kept from look-ups for the mounts that follow them (a look-up whose layer is not mounted, a
#: parent mismatch say, leaves its record until this many newer ones push it out).
KEPT_RECORDS = 64

#: The store's health as the snapshotter sees it: each lookup that gets an answer (a chain
#: record or its absence) sets 1, each one the store fails sets 0, so a store that cannot be
#: read shows here (and in the store_error fallbacks), never as "not converted".
STORE_UP = prometheus_client.Gauge(
    "bootseer_snapshotter_store_up", "1 while the store of layers answers look-ups, 0 after one it failed"
)

_REASONS: dict[type[control.LayerServerError], str] = {
    control.LayerNotConverted: "not_converted",
    control.StoreUnavailable: "store_error",
    control.LayerCorrupt: "corrupt",
    control.LayerUntrusted: "untrusted",
    control.LayerNotMounted: "not_mounted",
    control.ServerUnavailable: "server_unavailable",
    control.ServerStartError: "server_unavailable",
}

T = TypeVar("T")


class LayerServerBackend:
    """Remote layers of the store ``store_url``, served by the layer server under ``root``."""

    def __init__(
        self,
        root: Path,
        store_url: str,
        server: control.ServerSettings,
        engine: EngineConfig = EngineConfig(),
        lookup_timeout: float = LOOKUP_TIMEOUT,
        call_timeout: float = control.DEFAULT_TIMEOUT,
        trust: TrustPolicy = TrustPolicy(),
    ) -> None:
        self.root = root
        self.trust = trust  #: checked here at lookup (a clear reason early) and by the layer server at mount
        self.store_url = store_url
        #: did the store answer the last look-up (None: none yet); what ``bootseer_snapshotter_store_up`` shows
        self.store_up: bool | None = None
        self.server = server
        self.lookup_timeout = lookup_timeout
        self._engine = dataclasses.replace(engine, retry_timeout=min(engine.retry_timeout, lookup_timeout))
        #: every call but mount (which waits up to control.MOUNT_TIMEOUT) waits ``call_timeout`` for its answer
        self._client = control.LayerServerClient(ServerPaths(root).socket, timeout=call_timeout)
        #: the bytes of the chain records look-ups read, by ChainID, until their mount hands them over (gRPC threads)
        self._records: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._records_lock = threading.Lock()

    def start(self) -> None:
        """Find the running layer server or start one (daemon start-up); ServerStartError if it cannot."""
        control.ensure_server(self.root, self.server)  # a client of the socket self._client already calls

    def ensure_running(self) -> bool:
        """Start the layer server again if it died; True if it had to (the daemon's watch calls this).

        A new server restores its saved table: the same layers in the same slots, so
        the lower dirs recorded in the metadata stay right.
        """
        try:
            self._client.status()
            return False
        except control.ServerTimedOut as exc:
            # Running but slow: another server could not take its root; the next check asks again.
            log.warning("the layer server is slow to answer", error=str(exc))
            return False
        except control.ServerUnavailable as exc:
            log.warning("the layer server is gone; starting it again", error=str(exc))
        self.start()
        return True

    # -- LayerBackend ------------------------------------------------------------------------

    def lookup(self, chain_id: str) -> RemoteLayer | None:
        try:
            found = trio.run(self._read_chain, chain_id)
        except FormatError as exc:
            self.store_up = True  # the store answered: with a bad object
            STORE_UP.set(1)
            raise LayerUnavailable("corrupt", f"the store's chain record of {chain_id} is invalid: {exc}") from None
        except trio.TooSlowError:
            self._store_failed()
            raise LayerUnavailable(
                "store_error", f"the store did not answer for {chain_id} in {self.lookup_timeout:g}s"
            ) from None
        except (OSError, SourceError) as exc:  # FetchError is an OSError
            self._store_failed()
            raise LayerUnavailable("store_error", f"the store failed looking up {chain_id}: {exc}") from None
        if self.store_up is False:  # back after a failure: say so once
            log.info("the store answers look-ups again", store=redact_url(self.store_url))
        self.store_up = True
        STORE_UP.set(1)
        if found is None:
            return None
        record, data = found
        try:
            self.trust.check("chain", record.signature_check(), f"the store's chain record of {chain_id}")
        except Untrusted as exc:
            raise LayerUnavailable("untrusted", str(exc)) from None
        with self._records_lock:
            self._records[chain_id] = data
            self._records.move_to_end(chain_id)
            while len(self._records) > KEPT_RECORDS:
                self._records.popitem(last=False)
        return RemoteLayer(
            chain_id=record.chain_id,
            parent=record.parent,
            diff_id=record.diff_id,
            digest=record.digest,
            size=record.size,
            files=record.files,
        )

    def mount(self, chain_id: str, deps_index: str | None = None) -> str:
        """See :meth:`LayerBackend.mount`; ``deps_index``: a dependency layer's index, from a trusted deps record.
        The chain record :meth:`lookup` read of ``chain_id`` goes with it (once: a later mount reads its own)."""
        with self._records_lock:
            record = self._records.pop(chain_id, None)
        return self._call(lambda client: client.mount(chain_id, deps_index=deps_index, record=record).lower_dir)

    def warm(self, chain_ids: Sequence[str]) -> None:
        try:
            self._client.warm(chain_ids)
        except control.LayerServerError as exc:  # an older server, one gone or slow: the mounts load as before
            log.info("the layer server did not take the layers to load ahead", layers=len(chain_ids), error=str(exc))

    def check(self, chain_id: str) -> str:
        return self._call(lambda client: client.check(chain_id).lower_dir)

    def serves(self, lower_dir: str) -> bool:
        """See :meth:`LayerBackend.serves`: an EROFS mount at ``lower_dir`` (the ``erofs``, ``loop`` and ``fanotify``
        data paths: the kernel's mount outlives a server restart, and the new server restores its table into the
        same slots), or a slot directory of the server's FUSE mount while that answers (``tree``).  A layer the
        restarted server could not restore is not told apart here: its reads fail as its image layers' do."""
        paths = ServerPaths(self.root)
        path = Path(lower_dir)
        try:
            if path.parent == paths.erofs_lowers:
                return os.path.ismount(path)
            return path.parent == paths.mountpoint and os.path.ismount(paths.mountpoint) and path.is_dir()
        except OSError:  # a FUSE mount whose server is gone: ENOTCONN
            return False

    def send(self, requests: Sequence[ControlRequest]) -> list[dict[str, Any] | LayerUnavailable]:
        timeout = max((request.timeout for request in requests), default=self._client.timeout)

        def round_trip(client: control.LayerServerClient) -> list[dict[str, Any] | control.LayerServerError]:
            if len(requests) != 1:
                return client.batch([request.fields for request in requests], timeout=timeout)
            try:  # one alone goes as itself
                return [client.call(requests[0].fields, timeout=timeout)]
            except control.ServerUnavailable:
                raise
            except control.LayerServerError as exc:
                return [exc]

        if not requests:
            return []
        try:
            answers = self._call(round_trip)
        except LayerUnavailable as exc:
            return [exc] * len(requests)
        return [_unavailable(answer) if isinstance(answer, control.LayerServerError) else answer for answer in answers]

    def unmount(self, chain_id: str) -> None:
        try:
            self._call(lambda client: client.unmount(chain_id))
        except LayerUnavailable as exc:
            if exc.reason != "not_mounted":
                raise

    def mounted(self) -> Sequence[str]:
        status = self._call(lambda client: client.status())
        return [str(layer["chain_id"]) for layer in status.get("layers", [])]

    # -- helpers ------------------------------------------------------------------------------

    def _store_failed(self) -> None:
        self.store_up = False
        STORE_UP.set(0)

    async def _read_chain(self, chain_id: str) -> tuple[ChainRecord, bytes] | None:
        with trio.fail_after(self.lookup_timeout + 5):  # the engine's own bound, plus its shutdown
            async with open_store(self.store_url, self._engine) as store:
                return await store.chain_and_bytes(chain_id)

    def _call(self, operation: Callable[[control.LayerServerClient], T]) -> T:
        """Run ``operation``; a server found gone is started again once, then the call retried.

        One that is running but did not answer in time (:class:`~bootseer.blockstore.server.client.ServerTimedOut`)
        is not asked again: that would double the caller's wait, and a second server cannot start.
        """
        try:
            try:
                return operation(self._client)
            except control.ServerTimedOut:
                raise
            except control.ServerUnavailable as exc:
                log.warning("the layer server is gone; starting it again", error=str(exc))
                self.start()
                return operation(self._client)
        except control.LayerServerError as exc:
            raise _unavailable(exc) from None


def _unavailable(exc: control.LayerServerError) -> LayerUnavailable:
    """The layer server's error ``exc`` as the snapshot logic's failure (its reason by the error's kind)."""
    reason = next((r for kind, r in _REASONS.items() if isinstance(exc, kind)), "mount_failed")
    return LayerUnavailable(reason, f"layer server: {exc}")
