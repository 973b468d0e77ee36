"""INTERIM, test-only: stands in for blockstore/reader.py and blockstore/cache.py until they land.

Put on PYTHONPATH of a layer server started by the tests; installs
:mod:`tests.support.interim_reader` as ``bootseer.blockstore.reader`` and
``bootseer.blockstore.cache`` only where those modules do not exist yet.
"""

import importlib.util
import sys

sys.path.insert(0, __file__.rsplit("/tests/support/interim/", 1)[0])
for _name in ("reader", "cache"):
    if importlib.util.find_spec(f"bootseer.blockstore.{_name}") is None:
        from tests.support import interim_reader

        sys.modules[f"bootseer.blockstore.{_name}"] = interim_reader
