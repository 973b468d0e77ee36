"""The benchmarks: each script a module run from the checkout's root (``python -m bench.lazy_bench``).

Shared parts are modules of their own (:mod:`bench.common`, :mod:`bench.node`, :mod:`bench.image_build`,
:mod:`bench.nodestats`, :mod:`bench.netcap`, :mod:`bench.readers`, the checkpoint benchmark's timed child
program, whose digest its driver shares, and the lazy-layers benchmark's scenarios and report,
:mod:`bench.lazy_scenarios` and :mod:`bench.lazy_report`, and its yardstick of the layer server's CPU,
:mod:`bench.hot_set_cost`); no benchmark script imports another, and the machinery they share with the tests
(containerd, registry, processes, OCI layouts) is ``tests.support``'s.
"""
