#!/bin/sh
# Stands in for `pip install -r requirements.txt` (the example image is busybox, without Python): a slow
# "download", then packages unpacked into /opt/venv, an entry-point script and a file of the image removed (as an upgrade removes an old version).
set -e
echo "installing (slowly, as a real install would)..."
sleep 3
mkdir -p /opt/venv/bin /opt/venv/lib/site-packages
tar -xf /app/packages.tar -C /opt/venv/lib/site-packages
printf '#!/bin/sh\necho "trainer: $(cat /opt/venv/lib/site-packages/trainer/VERSION)"\n' > /opt/venv/bin/trainer
chmod 755 /opt/venv/bin/trainer
rm -f /app/layer1.txt
