"""The parallel range-fetch engine: bounded, prioritised, retrying range reads.

Layers, each knowing only the one below:

* :mod:`bootseer.fetch.source` -- the contract every storage backend implements
  (:class:`RangeSource`: stat, list and range reads over pooled connections).
* :mod:`bootseer.fetch.sources` -- the backends: local/NFS/Lustre paths, HTTP(S),
  S3, HDFS (native protocol) and WebHDFS; :func:`open_source` picks one by URL.
* :mod:`bootseer.fetch.engine` -- stripes files, detects sequential reads and grows a
  read-ahead window (:mod:`bootseer.fetch.reader`), runs a prioritised pool of parallel
  streams (:mod:`bootseer.fetch.queue`, :mod:`bootseer.fetch.workers`), retries failed
  stripes on fresh connections and bounds memory.
* :mod:`bootseer.fetch.api` -- the same engine for plain Python code, without FUSE.
* :mod:`bootseer.fetch.digests` -- digest lists stored beside checkpoint files: SHA-256 per
  chunk of one version of a file, which the engine verifies every stripe of it against.
"""

from bootseer.fetch.api import Client, open, read_bytes, write_digests
from bootseer.fetch.engine import EngineConfig

__all__ = ["Client", "EngineConfig", "open", "read_bytes", "write_digests"]
