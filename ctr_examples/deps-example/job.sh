#!/bin/sh
# The job itself: uses what the install left behind.
/opt/venv/bin/trainer
ls /opt/venv/lib/site-packages
[ -e /app/layer1.txt ] && echo "layer1.txt still there" || echo "layer1.txt removed by the install"
