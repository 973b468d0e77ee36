"""Who owns a block in a peer group, and the name the group gives a store: plain hashing, free of trio.

Every node of a group runs a layer server with the same members
(:mod:`~bootseer.blockstore.peers.membership`).  For each block a node must fetch, one member is
its *owner*: the member with the highest :func:`rendezvous_score` among those not being
skipped.  A node that owns a block fetches it from the store itself; any other node asks the
owner (:mod:`~bootseer.blockstore.peers.client`), which serves it from memory or its node cache,
or fetches it from the store once however many members ask, and then serves it
(:mod:`~bootseer.blockstore.peers.server`).  So in a group of N nodes each block crosses the
store's link about once, and rendezvous hashing moves only the blocks of a member that comes or
goes.  Members name a store by :func:`peer_store_id`, the same on every node configured with it.
"""

from __future__ import annotations

import hashlib


def peer_store_id(url_shown: str) -> str:
    """The name peers give a store: a hash of its URL as shown (credentials and query left out).

    Nodes of a group configured with one store agree on it; a hash of the whole URL
    would hand every peer a hash of the store's credentials.
    """
    return hashlib.sha256(b"bootseer peer store\0" + url_shown.encode()).hexdigest()[:32]


def rendezvous_score(member: str, digest: str) -> int:
    """The member's score for a block: the highest-scoring member owns it."""
    return int.from_bytes(hashlib.blake2b(member.encode() + b"\0" + digest.encode(), digest_size=8).digest(), "big")
