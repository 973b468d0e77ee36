"""Striped checkpoint mount: checkpoints read from HDFS, S3, HTTP or local files through
FUSE with parallel striped range reads.

* :mod:`bootseer.ckptmount.tree` -- the source's tree as FUSE nodes: cached listings,
  one engine reader per open file.
* :mod:`bootseer.ckptmount.mount` -- the engine and the FUSE session in one trio run.
* :mod:`bootseer.ckptmount.cli` -- ``bootseer ckpt mount SOURCE MOUNTPOINT``.
"""
