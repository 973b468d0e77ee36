"""Shared FUSE plumbing: a read-only pyfuse3 filesystem served under a trio lifecycle."""
