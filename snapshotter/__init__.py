"""The node's daemons: the containerd remote snapshotter (proxy plugin) and the layer server's main.

Layers, each knowing only the one below: :mod:`.grpc_service` maps gRPC calls and error
kinds; :mod:`.snapshots` holds the snapshot logic (one transaction per operation,
metadata and on-disk state changed together) and tells its lifecycle observers
(:mod:`.observers`: the profiler, hot lists, :mod:`.deps_hooks` for dependency
snapshots) when containers come and go; :mod:`.metastore` is the crash-safe metadata
store; :mod:`.mounts` describes the mounts; :mod:`.layer_backend` is the client of the
layer server.  :mod:`.daemon` runs it all as ``bootseer-snapshotter`` from
:mod:`.config`; :mod:`.layer_daemon` is ``bootseer layer-server``, which wires the layer
server with its extension (the hot-list service).
"""
