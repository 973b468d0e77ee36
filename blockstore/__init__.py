"""Lazily served image layers: the block format up to the layer-server daemon.

Each folder one idea, each knowing only the ones below it (``docs/architecture.md``):

* :mod:`.objects` -- the store's objects (block format, layer indexes, chain records),
  reading and writing stores, and signatures;
* :mod:`.convert` -- turning an image's layer tars into blocks and indexes;
* :mod:`.node` -- a node's block fetching: verified blocks from a store, the node cache;
* :mod:`.datapath` -- how a layer's tree reaches overlayfs: EROFS images and mounts, the
  per-file FUSE tree, overlay options, the kernel checks made once;
* :mod:`.peers` -- block sharing between a job's nodes;
* :mod:`.server` -- the layer-server daemon and both ends of its control protocol.
"""
