"""BootSeer: cut the start-up time of large training jobs.

Shared parts live here: the command line (:mod:`bootseer.cli`), structured logging
(:mod:`bootseer.log`), the Prometheus endpoint (:mod:`bootseer.metrics`), the parallel
range-fetch engine (:mod:`bootseer.fetch`) and the FUSE plumbing (:mod:`bootseer.fuse`).
Each capability is its own package: ``bootseer.snapshotter``, ``bootseer.blockstore``,
``bootseer.hotlist``, ``bootseer.depsnap`` and ``bootseer.ckptmount``.
"""

__version__ = "0.1.0"
