#!/bin/sh
# A job's entry point with a dependency snapshot.  The one guard line: on a hit the snapshotter has
# stacked the captured install under this container (and made /.bootseer/deps-hit), so the install is
# skipped; on a miss the job installs, says so (/.bootseer/deps-done) and waits until the snapshotter
# has captured the writable layer (/.bootseer/deps-captured: a tree that changes during the capture
# is never published).  A Python image writes `pip install --no-cache-dir -r /app/requirements.txt`
# where this one runs /app/install.sh.
[ -e /.bootseer/deps-hit ] || { sh /app/install.sh && touch /.bootseer/deps-done && until ls /.bootseer | grep -qx deps-captured; do sleep 0.2; done; echo "capture: $(cat /.bootseer/deps-captured)"; }
exec sh /app/job.sh
