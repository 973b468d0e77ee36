"""The end of a hot-list recording: discarded, or sealed into a hot list and published to the store.

A recording that found a list in the store (or an invalid one) is discarded: nothing is
written.  One that ran to its seal becomes a signed hot list, put in its store only if
absent (the first node to publish wins; a later one's outcome is ``lost_race``); its summary
is logged, counted, kept and handed to the start-up profiler.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import prometheus_client
import trio

from bootseer.blockstore.objects.signing import SigningKey
from bootseer.hotlist.format import hotlist_object
from bootseer.hotlist.recorder import Recording
from bootseer.log import get_logger
from bootseer.profile import hooks as profile_hooks

log = get_logger(__name__)

RECORDINGS = prometheus_client.Counter(
    "bootseer_hotlist_recordings",
    "Hot-list recordings ended, by outcome (published, lost_race: another node published first, empty, failed, discarded)",
    ["outcome"],
)
RECORDED_BLOCKS = prometheus_client.Counter("bootseer_hotlist_recorded_blocks", "First touches recorded")


def discard(active: dict[str, Recording], recording: Recording, why: str) -> None:
    """End ``recording`` without a hot list (and take it out of ``active``, by container)."""
    if active.get(recording.container) is recording:
        del active[recording.container]
    recording.outcome = "discarded"
    recording.seal("seal")
    recording.done.set()
    log.debug("recording discarded", container=recording.container, why=why)


async def publish(active: dict[str, Recording], recording: Recording, sign_key: SigningKey | None,
                  finished: collections.deque[dict[str, Any]]) -> None:  # fmt: skip
    """Take the sealed ``recording`` out of ``active``, publish its hot list (signed with ``sign_key``),
    and append its summary to ``finished``."""
    from bootseer.blockstore.objects.store import StoreError

    if active.get(recording.container) is recording:
        del active[recording.container]
    hot = recording.hot_list()
    outcome = "empty"
    error = ""
    if hot.blocks:
        url = recording.publish_to
        name = hotlist_object(hot.image, hot.profile)
        try:
            if not url:
                raise StoreError("the image's layers have no store and no --publish-store is set")
            published = await trio.to_thread.run_sync(functools.partial(_publish_blocking, url, name, hot.encode(sign_key)))
            outcome = "published" if published else "lost_race"
        except (StoreError, ValueError, OSError) as exc:
            outcome, error = "failed", str(exc)
    recording.outcome = outcome
    RECORDINGS.labels(outcome).inc()
    RECORDED_BLOCKS.inc(len(hot.blocks))
    summary = {
        "kind": "recording", "container": recording.container, "image": hot.image, "profile": hot.profile,
        "sealed_by": hot.sealed_by, "blocks": len(hot.blocks), "bytes": hot.total_bytes, "span_s": round(hot.span, 3),
        "duration_s": round(hot.duration, 3), "unattributed": hot.unattributed, "outcome": outcome,
    }  # fmt: skip
    if error:
        summary["error"] = error
    finished.append(summary)
    level = log.error if outcome == "failed" else log.info
    level("hot-list recording sealed", **summary)
    profile_hooks.hotlist_sealed(summary)  # start-up profiler
    recording.done.set()


def _publish_blocking(url: str, name: str, data: bytes) -> bool:
    from bootseer.blockstore.objects.store import open_store_writer

    with open_store_writer(url) as writer:
        return writer.put_if_absent(name, data)  # first writer wins


__all__ = ["RECORDED_BLOCKS", "RECORDINGS", "discard", "publish"]
