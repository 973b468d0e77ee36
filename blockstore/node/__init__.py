"""A node's blocks: verified fetching from a store (and peers) and the node-local cache.

:mod:`.reader` fetches, verifies and caches blocks for the layers a node serves;
:mod:`.block_cache` is the node cache of verified raw blocks shared by every layer.
"""
