"""Peer-assisted block sharing between the nodes of a job (``docs/peers.md``).

:mod:`.wire` is the HTTP/1.1 wire format; :mod:`.membership` the peer group;
:mod:`.service` the client, server and service a layer server runs; :mod:`.cli` is
``bootseer peers``.
"""
