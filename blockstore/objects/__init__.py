"""The block store's objects and where they live: format, stores, signatures.

:mod:`.format` is the one definition of ``docs/FORMAT.md`` (blocks, layer indexes,
chain records); :mod:`.jsonstream` decodes large JSON documents within bounds;
:mod:`.store` reads and writes a store (file, S3, HDFS, HTTP); :mod:`.signing` signs and
checks what a store holds (``docs/trust.md``).  Nothing here knows a node, a daemon or
a mount.
"""
