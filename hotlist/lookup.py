"""Finding an image's hot list: which served layers make the image, and what the store holds for it.

The hot list of (image top ChainID, profile) is a store object (:mod:`bootseer.hotlist.format`).
It is read through the image's store's fetch engine, bounded by the blocks the image's layers
hold, decoded and checked against the node's trust policy off the FUSE loop.  A list that is
bad (invalid, untrusted) is logged and counted here, once, whoever asked.
"""

from __future__ import annotations

import prometheus_client
import trio

from bootseer.blockstore.objects.format import FormatError
from bootseer.blockstore.objects.signing import Untrusted
from bootseer.blockstore.server.extension import LayerHost
from bootseer.fetch.stripes import FetchError
from bootseer.fetch.source import SourceError
from bootseer.hotlist.format import HotList, HotListError, HotListUntrusted, read_hot_list_object
from bootseer.log import get_logger

log = get_logger(__name__)

IGNORED = prometheus_client.Counter(
    "bootseer_hotlist_ignored", "Hot lists found but not used, by reason (invalid, untrusted, mismatch, store_error)", ["reason"]
)


class HotListLookup:
    """The served images of ``server`` and their hot lists in its stores."""

    def __init__(self, server: LayerHost) -> None:
        self.server = server

    def image_layers(self, top: str) -> list[str] | None:
        """The served chain ending in ``top``, bottom first; None if any of it is not served."""
        chain: list[str] = []
        current = top
        while current:
            layer = self.server.layers.get(current)
            if layer is None or layer.tree is None or current in chain:
                return None
            chain.append(current)
            current = layer.record.parent
        return chain[::-1]

    async def read(self, image: str, profile: str) -> HotList | None:
        """The store's hot list for (image, profile): None if there is none; HotListError if it is bad."""
        from bootseer.blockstore.objects.store import StoreReader

        store = self.server.layers[image].store
        engine, _fetcher = await self.server.fetcher(store)
        # A first boot touches each block at most once: no more rows than the image's layers
        # hold blocks (all served, so their indexes are here; else the format's own bound).
        # A larger object than those rows can take is refused from its size, unread.
        layers = self.image_layers(image)
        max_blocks = None if layers is None else sum(len(self.server.layers[layer].tree.index.blocks) for layer in layers)
        data = await read_hot_list_object(StoreReader(engine), image, profile, max_blocks)
        if data is None:
            return None
        trust = self.server.trust

        def decode_and_check() -> HotList:
            hot = HotList.decode(data, expected_image=image, expected_profile=profile, max_blocks=max_blocks)
            try:
                trust.check("hotlist", hot.signed, f"the hot list of {image} (profile {profile!r})")
            except Untrusted as exc:
                raise HotListUntrusted(str(exc)) from None
            return hot

        # Decompressing, parsing and checking a signature is CPU work proportional to the list:
        # never on the FUSE loop.
        return await trio.to_thread.run_sync(decode_and_check, limiter=self.server.decode_threads)

    async def find(self, image: str, profile: str) -> HotList | None:
        """The hot list; None if absent or the store fails (logged); HotListError (logged) if it is invalid."""
        try:
            return await self.read(image, profile)
        except HotListUntrusted as exc:
            IGNORED.labels("untrusted").inc()
            log.warning("hot list ignored: not signed by a trusted writer key; no prefetch", image=image,
                        profile=profile, error=str(exc))  # fmt: skip
            raise
        except HotListError as exc:
            IGNORED.labels("invalid").inc()
            log.warning("hot list ignored: invalid (bootseer hotlist clear removes it)", image=image, profile=profile, error=str(exc))
            raise
        except (FetchError, SourceError, FormatError, OSError) as exc:
            IGNORED.labels("store_error").inc()
            log.warning("cannot read the hot list; no prefetch", image=image, profile=profile, error=str(exc))
            return None


__all__ = ["IGNORED", "HotListLookup"]
