"""Real-component tests (containerd, registry, runc, overlay mounts), containerd's conformance suite and the demo, all driven by :mod:`.harness`."""
