"""Shared test support: build layer tars and OCI image layouts for BootSeer's tests.

Import what you need from the two modules (or from here, which re-exports both)::

    from tests.support import layers, oci
    from tests.support.layers import Dir, File, Hardlink, Layer, layer_tar
    from tests.support.oci import build_oci_layout, busybox_layer, demo_layers, rich_layers

* :mod:`tests.support.layers` -- entry specs for every kind of tar entry (files with
  modes, owners, ns mtimes and xattrs; directories; symlinks, absolute ones included;
  hardlinks; character/block devices; fifos; whiteouts and opaque markers; GNU sparse
  files; raw headers for hostile tars) and :func:`~tests.support.layers.layer_tar` /
  :func:`~tests.support.layers.write_layer_tar` to write them, deterministically (same
  specs, same bytes, same digests).
* :mod:`tests.support.oci` -- :func:`~tests.support.oci.build_oci_layout` (an OCI image
  layout: ``oci-layout``, ``index.json``, manifest, config with ``diff_ids``, layer blobs
  gzip, zstd or uncompressed), the busybox base layer (runnable with ``busybox-static``),
  the three-layer demo image the integration tests run, and :func:`~tests.support.oci.rich_layers`,
  a multi-layer image with one entry of every kind for format round trips;
  :class:`~tests.support.oci.RawBlob` puts exact blob bytes (truncated, corrupt) in a layout.
* :mod:`tests.support.trees` -- compare a converted layer with a plain extraction:
  :func:`~tests.support.trees.extract_with_tar` (GNU tar as root, xattrs kept),
  :func:`~tests.support.trees.disk_tree` (lstat only, in overlayfs lower-dir form),
  :func:`~tests.support.trees.index_tree` and :func:`~tests.support.trees.read_file`
  (contents from a local store's packs, every block verified; symlinks never followed).

Everything here is plain files and bytes: no registry, no containerd, no root (except
where a test extracts device nodes itself).
"""

from tests.support import layers, oci  # noqa: F401

__all__ = ["layers", "oci"]
