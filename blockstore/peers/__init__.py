"""Peer-assisted block sharing between the nodes of a job (``docs/peers.md``).

:mod:`.config` is its settings, free of trio; :mod:`.options` the layer server's ``--peer-*``
options; :mod:`.ownership` who owns a block; :mod:`.membership` the peer group; :mod:`.wire`
the HTTP/1.1 wire format; :mod:`.client` asks owners, :mod:`.server` answers members, within
:mod:`.limits`, counting into :mod:`.stats`; :mod:`.service` wires them for a layer server.
"""
