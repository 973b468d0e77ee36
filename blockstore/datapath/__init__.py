"""How a layer's tree reaches overlayfs: the data paths and the kernel checks they rest on.

:mod:`.choice` picks the node's data path once (``fanotify``, ``erofs``, ``loop`` or ``tree``) and keeps
its mounts and their images (the store's, or built from the index by
:mod:`bootseer.blockstore.objects.erofs_image`); :mod:`.erofs_check` checks a store's image
before the kernel sees it; :mod:`.erofs_mount` mounts one; :mod:`.tree` serves a layer as a per-file FUSE tree;
:mod:`.overlay` builds overlayfs mount options; :mod:`.fanotify`, :mod:`.event_holder` and
:mod:`.local_blobs` are the ``fanotify`` path (local blobs filled on the kernel's pre-access events).
"""
