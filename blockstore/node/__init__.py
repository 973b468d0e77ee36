"""A node's blocks: verified fetching from a store (and peers) and the node-local cache.

:mod:`.layer_reader` reads a layer's files and blob over :mod:`.fetcher`, which gets, verifies
and caches blocks for every layer of a store: through its memory of recent blocks
(:mod:`.memory`), the node cache (:mod:`.block_cache`, written behind the reads by
:mod:`.cache_writer`), the peer group it asks through the seam of :mod:`.peers`, and the
store's engine with read-ahead (:mod:`.readahead`); :mod:`.metrics` is what it counts.
"""
