"""Striped checkpoint mount: checkpoints read from HDFS, S3, HTTP or local files through FUSE with parallel striped range reads."""
