"""The timed readers of the checkpoint benchmark, one per method, each run in a fresh process.

``python -m bench.readers METHOD ARGS...`` reads once, the way the method reads,
and prints one JSON object: ``bytes`` read, ``seconds`` the read took (the clock
starts after imports, before the first byte is asked for, and stops when the last
byte is in memory, before any verification) and ``digest`` of what was read, which
the driver compares with the digest taken when the data was written.  A fresh
process per measurement gives every method a cold engine and cold connections.

Digests: raw files are hashed with xxh3-128 as they stream by (it runs at memory
speed, so it costs the reader nothing measurable); a safetensors checkpoint's digest
covers every tensor's name, dtype, shape and raw bytes, see :func:`tensors_digest`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

import xxhash

CHUNK = 1 << 20  #: bytes per read() call of the sequential readers


def tensors_digest(tensors: Mapping[str, Any]) -> str:
    """One digest of a checkpoint's tensors (numpy arrays), bit-exact, NaNs included."""
    digest = xxhash.xxh3_128()
    for name in sorted(tensors):
        array = tensors[name]
        digest.update(f"{name}\0{array.dtype.str}\0{tuple(array.shape)}\0".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _http_get(url: str, limit: int | None, sink: Callable[[bytes], None]) -> int:
    """Stream ``url`` (its first ``limit`` bytes, or all of it) over one plain connection."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=60)
    try:
        headers = {"Range": f"bytes=0-{limit - 1}"} if limit else {}
        connection.request("GET", parts.path or "/", headers=headers)
        response = connection.getresponse()
        if response.status not in ((206,) if limit else (200,)):
            raise RuntimeError(f"GET {url}: HTTP {response.status} {response.reason}")
        total = 0
        while chunk := response.read(CHUNK):
            sink(chunk)
            total += len(chunk)
        return total
    finally:
        connection.close()


def http_stream(url: str, limit: int | None) -> dict[str, Any]:
    """The baseline: one sequential GET, as curl or urllib would do it."""
    digest = xxhash.xxh3_128()
    start = time.perf_counter()
    total = _http_get(url, limit, digest.update)
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "digest": digest.hexdigest()}


def file_read(path: str) -> dict[str, Any]:
    """Sequential ``read()`` of a whole file (through the mount), 1 MiB at a time."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            digest.update(view[:count])
            total += count
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "digest": digest.hexdigest()}


def mmap_walk(path: str) -> dict[str, Any]:
    """``mmap`` of a whole file (through the mount), copied out in order 1 MiB at a time.

    What ``safetensors``' default loader and ``torch.load(mmap=True)`` do: the kernel
    reads the file by page faults, not by ``read()`` calls.
    """
    import mmap

    digest = xxhash.xxh3_128()
    total = 0
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        with mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as mapping, memoryview(mapping) as view:
            for offset in range(0, size, CHUNK):
                digest.update(view[offset : offset + CHUNK])
                total += min(CHUNK, size - offset)
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "digest": digest.hexdigest()}


def _engine_config(streams: int, stripe_size: int, readahead_max: int) -> Any:
    from bootseer.fetch.engine import EngineConfig

    return EngineConfig(streams=streams, stripe_size=stripe_size, readahead_max=readahead_max)


def api_read_bytes(url: str, streams: int, stripe_size: int, readahead_max: int) -> dict[str, Any]:
    """``bootseer.fetch.read_bytes(url)``: the whole file into memory with striped reads."""
    import bootseer.fetch.api as api

    config = _engine_config(streams, stripe_size, readahead_max)
    start = time.perf_counter()
    data = api.read_bytes(url, config=config)
    seconds = time.perf_counter() - start
    return {"bytes": len(data), "seconds": seconds, "digest": xxhash.xxh3_128_hexdigest(data)}


def api_open_read(url: str, streams: int, stripe_size: int, readahead_max: int) -> dict[str, Any]:
    """``bootseer.fetch.open(url)`` read sequentially, 1 MiB at a time, like a file."""
    import bootseer.fetch.api as api

    config = _engine_config(streams, stripe_size, readahead_max)
    digest = xxhash.xxh3_128()
    total = 0
    start = time.perf_counter()
    with api.open(url, config=config) as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
            total += len(chunk)
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "digest": digest.hexdigest()}


def st_load_file(path: str, backend: str) -> dict[str, Any]:
    """``safetensors.numpy.load_file`` of a checkpoint in the mount.

    ``backend`` is safetensors' own: ``mmap`` (its default: tensors are copied out of
    a mapping, so the kernel reads the file by page faults) or ``pread``.
    """
    import safetensors.numpy

    start = time.perf_counter()
    tensors = safetensors.numpy.load_file(path, backend=backend)
    seconds = time.perf_counter() - start
    return {"bytes": sum(a.nbytes for a in tensors.values()), "seconds": seconds, "digest": tensors_digest(tensors)}


def st_read_load(path: str) -> dict[str, Any]:
    """One sequential ``read()`` of the whole file (through the mount), then ``safetensors.numpy.load``."""
    import safetensors.numpy

    start = time.perf_counter()
    with open(path, "rb") as file:
        tensors = safetensors.numpy.load(file.read())
    seconds = time.perf_counter() - start
    return {"bytes": sum(a.nbytes for a in tensors.values()), "seconds": seconds, "digest": tensors_digest(tensors)}


def st_load_api(url: str, streams: int, stripe_size: int, readahead_max: int) -> dict[str, Any]:
    """``safetensors.numpy.load(bootseer.fetch.read_bytes(url))``."""
    import safetensors.numpy

    import bootseer.fetch.api as api

    config = _engine_config(streams, stripe_size, readahead_max)
    start = time.perf_counter()
    tensors = safetensors.numpy.load(api.read_bytes(url, config=config))
    seconds = time.perf_counter() - start
    return {"bytes": sum(a.nbytes for a in tensors.values()), "seconds": seconds, "digest": tensors_digest(tensors)}


def st_load_plain(url: str) -> dict[str, Any]:
    """The plain way: download with one stream, then ``safetensors.numpy.load``."""
    import safetensors.numpy

    chunks: list[bytes] = []
    start = time.perf_counter()
    _http_get(url, None, chunks.append)
    tensors = safetensors.numpy.load(b"".join(chunks))
    seconds = time.perf_counter() - start
    return {"bytes": sum(a.nbytes for a in tensors.values()), "seconds": seconds, "digest": tensors_digest(tensors)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One timed read for bench/ckpt_bench.py; prints JSON.")
    sub = parser.add_subparsers(dest="method", required=True)
    stream = sub.add_parser("http-stream")
    stream.add_argument("url")
    stream.add_argument("--limit", type=int, help="read only the first LIMIT bytes (a Range request)")
    for name in ("file-read", "mmap-walk", "st-load-file", "st-read-load"):
        sub.add_parser(name).add_argument("path")
    sub.choices["st-load-file"].add_argument("--backend", choices=("mmap", "pread"), default="mmap")
    sub.add_parser("st-load-plain").add_argument("url")
    for name in ("api-read-bytes", "api-open-read", "st-load-api"):
        api = sub.add_parser(name)
        api.add_argument("url")
        api.add_argument("--streams", type=int, required=True)
        api.add_argument("--stripe-size", type=int, required=True)
        api.add_argument("--readahead-max", type=int, required=True)
    args = parser.parse_args(argv)
    engine = lambda: (args.streams, args.stripe_size, args.readahead_max)  # noqa: E731
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        "http-stream": lambda: http_stream(args.url, args.limit),
        "file-read": lambda: file_read(args.path),
        "mmap-walk": lambda: mmap_walk(args.path),
        "st-load-file": lambda: st_load_file(args.path, args.backend),
        "st-read-load": lambda: st_read_load(args.path),
        "st-load-plain": lambda: st_load_plain(args.url),
        "api-read-bytes": lambda: api_read_bytes(args.url, *engine()),
        "api-open-read": lambda: api_open_read(args.url, *engine()),
        "st-load-api": lambda: st_load_api(args.url, *engine()),
    }
    json.dump(runs[args.method](), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
