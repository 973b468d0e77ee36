"""containerd remote snapshotter (proxy plugin) serving containerd's Snapshots API.

Layers, each knowing only the one below: :mod:`.grpc_service` maps gRPC calls and error
kinds; :mod:`.snapshots` holds the snapshot logic (one transaction per operation,
metadata and on-disk state changed together); :mod:`.metastore` is the crash-safe
metadata store; :mod:`.layer_backend` is the client of the layer server.  :mod:`.daemon` runs
it all as ``bootseer-snapshotter``.
"""
