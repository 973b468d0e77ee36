"""How a layer's tree reaches overlayfs: the data paths and the kernel checks they rest on.

:mod:`.choice` picks the node's data path once (``erofs``, ``loop`` or ``tree``) and keeps
its mounts; :mod:`.erofs_image` builds a layer's EROFS image from its index;
:mod:`.erofs_mount` mounts one; :mod:`.tree` serves a layer as a per-file FUSE tree;
:mod:`.overlay` builds overlayfs mount options.
"""
