"""OCI images from a registry or a layout, and pulling them into containerd lazily.

:mod:`.registry` reads images (manifests, configs, layer blobs; ChainIDs from diff IDs)
from a registry or an ``oci:`` layout; :mod:`.rpull` pulls an image into containerd so
that the remote snapshotter prepares its layers lazily; :mod:`.rpull_cli` is
``bootseer rpull``.
"""
