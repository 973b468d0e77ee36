"""The layer-server daemon and its control protocol, both ends.

:mod:`.client` is the callers' end (a blocking client, ``ensure_server``, the paths and
settings under a node root); :mod:`.ops` dispatches control operations in the server;
:mod:`.layer_server` is the daemon; :mod:`.layer_table` its crash-safe table of mounted
layers; :mod:`.store_registry` its engines and fetchers per store; :mod:`.cli` is
``bootseer layer-server``.
"""
