"""The one support package of the tests, the integration tests and the benchmarks.

Everything the three share lives here, one idea per module, and this package imports nothing
back from ``tests/<package>/``, ``integration/`` or ``bench/`` (only the product, ``bootseer``, and
itself; ``tests/test_architecture.py`` checks it). Import from the module that holds a name::

    from tests.support.oci import build_oci_layout, demo_layers
    from tests.support.stack import Stack

* Images: :mod:`~tests.support.layers` (entry specs of every kind, a deterministic tar writer),
  :mod:`~tests.support.oci` (the one OCI layout writer, the demo and rich images),
  :mod:`~tests.support.layer_store`, :mod:`~tests.support.packed_layers` (converted layers in a store),
  :mod:`~tests.support.trees` (a converted layer against a plain extraction), :mod:`~tests.support.wheels`.
* Processes and components: :mod:`~tests.support.processes` (a managed child, a command run to completion),
  :mod:`~tests.support.registry` (``docker-registry``), :mod:`~tests.support.containerd` (which containerd,
  and a private one), :mod:`~tests.support.stack` (registry + daemon + containerd: a node),
  :mod:`~tests.support.daemon` (the daemon as unit tests meet it), :mod:`~tests.support.layer_servers`,
  :mod:`~tests.support.mounts` (FUSE mount programs), :mod:`~tests.support.peernodes`,
  :mod:`~tests.support.peers`, :mod:`~tests.support.netns` (network namespaces, shaped links).
* Servers a test reads from: :mod:`~tests.support.http`, :mod:`~tests.support.nginx`,
  :mod:`~tests.support.s3`, :mod:`~tests.support.webhdfs`, :mod:`~tests.support.tls`.
* Hostile input: :mod:`~tests.support.bombs`, :mod:`~tests.support.forgery`, :mod:`~tests.support.sealed`.
* Time and measurement: :mod:`~tests.support.waiting` (the one ``wait_until``, ``free_port``),
  :mod:`~tests.support.autojump` (trio's mock clock), :mod:`~tests.support.memory`,
  :mod:`~tests.support.chromium`, :mod:`~tests.support.snapshots`.
"""
