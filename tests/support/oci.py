"""OCI image layouts for tests, and the images BootSeer's tests use.

:func:`build_oci_layout` writes an OCI image layout (``oci-layout``, ``index.json``,
manifest, config with ``rootfs.diff_ids``, layer blobs) from :class:`~tests.support.layers.Layer`
specs, no docker needed.  Layers are streamed through temp files, so a multi-GB layer
costs disk, not memory.  Blobs are gzip (the default), zstd or uncompressed tar, each
with its OCI media type; the same specs give the same digests.  Push a layout to a
registry with ``skopeo copy oci:DIR:TAG docker://...`` (:class:`tests.support.registry.Registry` does).

Images:

* :func:`busybox_layer` -- a runnable base (static busybox and its applet symlinks).
* :func:`demo_layers` -- the three-layer image the integration tests run: busybox, app
  files, then a whiteout and an opaque directory (constants below say what is where).
* :func:`rich_layers` -- three layers holding an entry of every kind (hardlinks, xattrs,
  ns mtimes, devices, fifos, sparse and empty files, long and non-UTF-8 names, absolute
  symlinks, whiteouts, opaque dirs, a file replaced by a later entry), for format round trips.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Sequence

import zstandard

from tests.support.layers import (
    EPOCH,
    OPAQUE_MARKER,
    Device,
    Dir,
    Entry,
    Fifo,
    File,
    Hardlink,
    Layer,
    Opaque,
    Sparse,
    Symlink,
    Whiteout,
    layer_tar,
    write_layer_tar,
)

#: Media types of an OCI image (image-spec v1.0).
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
MEDIA_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_MEDIA = {"gzip": MEDIA_LAYER_GZIP, "zstd": MEDIA_LAYER_ZSTD, "none": MEDIA_LAYER_TAR}


class BuildError(RuntimeError):
    """A test image could not be built (a missing tool); the message says what to install."""


@dataclass(frozen=True)
class BuiltImage:
    """What :func:`build_oci_layout` wrote: enough to check what containerd or a converter reports."""

    layout: Path
    tag: str
    manifest_digest: str
    config_digest: str
    layer_digests: tuple[str, ...]  #: sha256 of each blob as stored (compressed), lowest layer first
    diff_ids: tuple[str, ...]  #: sha256 of each uncompressed tar, lowest layer first
    layer_sizes: tuple[int, ...] = ()  #: bytes of each blob
    media_types: tuple[str, ...] = ()  #: media type of each layer blob

    @property
    def ref(self) -> str:
        """The ``oci:DIR:TAG`` reference of this image."""
        return f"oci:{self.layout}:{self.tag}"

    def blob_path(self, digest: str) -> Path:
        return self.layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def put_blob(blobs: Path, data: bytes) -> str:
    """Write ``data`` as a blob under ``blobs`` (a layout's ``blobs/sha256``); its digest."""
    digest = sha256_digest(data)
    (blobs / digest.removeprefix("sha256:")).write_bytes(data)
    return digest


class _HashingWriter:
    """A write-only file that hashes and counts what passes through to ``out``."""

    def __init__(self, out: BinaryIO) -> None:
        self.out, self.hash, self.size = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()


def put_file(blobs: Path, path: Path) -> tuple[str, int]:
    """Move the file at ``path`` (on the same filesystem) under ``blobs`` as the blob it holds; (digest, size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = "sha256:" + h.hexdigest()
    os.replace(path, blobs / h.hexdigest())
    return digest, (blobs / h.hexdigest()).stat().st_size


@dataclass(frozen=True)
class RawBlob:
    """A layer given as the exact bytes of its blob (a truncated tar, a corrupt gzip stream...).

    ``diff_id`` is what the config will claim; by default the SHA-256 of ``data``
    (right for a plain tar).
    """

    data: bytes
    media_type: str = MEDIA_LAYER_TAR
    diff_id: str = ""
    comment: str = "raw blob"


def write_layer_blob(layer: Layer | RawBlob, blobs: Path, compression: str = "gzip") -> tuple[str, str, int]:
    """Write ``layer`` as a blob under ``blobs``; returns (blob digest, diff_id, blob size)."""
    if isinstance(layer, RawBlob):
        digest = sha256_digest(layer.data)
        (blobs / digest.removeprefix("sha256:")).write_bytes(layer.data)
        return digest, layer.diff_id or digest, len(layer.data)
    if compression not in LAYER_MEDIA:
        raise ValueError(f"compression must be one of {sorted(LAYER_MEDIA)}, not {compression!r}")
    fd, spool = tempfile.mkstemp(dir=blobs, prefix=".building-")
    try:
        with os.fdopen(fd, "wb") as raw:
            if compression == "gzip":
                with gzip.GzipFile(fileobj=raw, mode="wb", mtime=EPOCH) as compressed:
                    tar = _HashingWriter(compressed)  # type: ignore[arg-type]
                    write_layer_tar(layer, tar)  # type: ignore[arg-type]
            elif compression == "zstd":
                with zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as compressed:
                    tar = _HashingWriter(compressed)  # type: ignore[arg-type]
                    write_layer_tar(layer, tar)  # type: ignore[arg-type]
            else:
                tar = _HashingWriter(raw)
                write_layer_tar(layer, tar)  # type: ignore[arg-type]
        diff_id = "sha256:" + tar.hash.hexdigest()
        digest, size = put_file(blobs, Path(spool))
        return digest, diff_id, size
    finally:
        if os.path.exists(spool):
            os.unlink(spool)


#: The creation time every test image's config and history carry (fixed: the same specs give the same digests).
TEST_IMAGE_CREATED = "2023-11-14T22:13:20Z"


@dataclass(frozen=True)
class LayerRef:
    """A layer blob already in a layout's ``blobs/sha256``, as its image's manifest and config name it."""

    media_type: str
    digest: str  #: of the blob as stored (compressed)
    size: int
    diff_id: str  #: of the uncompressed tar
    created_by: str  #: the config's history line for it


def write_image(
    layout: Path,
    layers: Sequence[LayerRef],
    *,
    tag: str,
    cmd: Sequence[str],
    env: Sequence[str],
    workdir: str = "/",
    architecture: str = "amd64",
    created: str = TEST_IMAGE_CREATED,
) -> BuiltImage:
    """Write the config and manifest of an image of ``layers`` (blobs already under ``layout``) and tag it.

    The one writer of configs, manifests, ``index.json`` and ``oci-layout`` (tests and benchmarks alike).
    An ``index.json`` that exists gets the image added under ``tag`` (a tag named before is replaced), so
    one layout can hold several images.  JSON is written with sorted keys: the same inputs give the same
    digests.
    """
    layout = Path(layout)
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    config = {
        "architecture": architecture,
        "os": "linux",
        "created": created,
        "config": {"Cmd": list(cmd), "Env": list(env), "WorkingDir": workdir},
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": created, "created_by": layer.created_by} for layer in layers],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_digest = put_blob(blobs, config_bytes)
    layer_descs = [{"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size} for layer in layers]
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": len(config_bytes)},
        "layers": layer_descs,
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    manifest_digest = put_blob(blobs, manifest_bytes)
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {"schemaVersion": 2, "manifests": []}
    index["manifests"] = [
        m for m in index["manifests"] if m.get("annotations", {}).get("org.opencontainers.image.ref.name") != tag
    ]
    index["manifests"].append(
        {
            "mediaType": MEDIA_MANIFEST,
            "digest": manifest_digest,
            "size": len(manifest_bytes),
            "annotations": {"org.opencontainers.image.ref.name": tag},
            "platform": {"architecture": architecture, "os": "linux"},
        }
    )
    index_path.write_text(json.dumps(index, sort_keys=True))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    return BuiltImage(
        layout=layout,
        tag=tag,
        manifest_digest=manifest_digest,
        config_digest=config_digest,
        layer_digests=tuple(layer.digest for layer in layers),
        diff_ids=tuple(layer.diff_id for layer in layers),
        layer_sizes=tuple(layer.size for layer in layers),
        media_types=tuple(layer.media_type for layer in layers),
    )


def build_oci_layout(
    layout: Path,
    layers: Sequence[Layer | RawBlob],
    *,
    tag: str = "latest",
    cmd: Sequence[str] = ("/bin/sh",),
    env: Sequence[str] = ("PATH=/bin:/usr/bin",),
    compression: str | Sequence[str] = "gzip",
    architecture: str = "amd64",
) -> BuiltImage:
    """Write an OCI image layout at ``layout`` holding one image of ``layers`` tagged ``tag``.

    ``compression`` is ``"gzip"``, ``"zstd"`` or ``"none"``, for every layer or one per
    layer.  A layout that already exists gets the image added under ``tag`` (a tag
    named before is replaced), so one layout can hold several images.
    """
    layout = Path(layout)
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    compressions = [compression] * len(layers) if isinstance(compression, str) else list(compression)
    if len(compressions) != len(layers):
        raise ValueError(f"{len(compressions)} compressions for {len(layers)} layers")
    refs = []
    for layer, how in zip(layers, compressions):
        digest, diff_id, size = write_layer_blob(layer, blobs, how)
        media_type = layer.media_type if isinstance(layer, RawBlob) else LAYER_MEDIA[how]
        refs.append(LayerRef(media_type, digest, size, diff_id, layer.comment or "bootseer test image"))
    return write_image(layout, refs, tag=tag, cmd=cmd, env=env, architecture=architecture)


def add_platform_index(image: BuiltImage, other: BuiltImage, tag: str = "multi") -> dict:
    """Add to ``image.layout`` an image index tagged ``tag``: ``image`` as linux/amd64 and ``other``
    (built in another layout; its blobs are copied over) as linux/arm64/v8.  Returns its descriptor."""
    blobs = image.layout / "blobs" / "sha256"
    for blob in (other.layout / "blobs" / "sha256").iterdir():
        shutil.copy(blob, blobs / blob.name)

    def entry(built: BuiltImage, platform: dict) -> dict:
        size = (blobs / built.manifest_digest.removeprefix("sha256:")).stat().st_size
        return {"mediaType": MEDIA_MANIFEST, "digest": built.manifest_digest, "size": size, "platform": platform}

    index = json.dumps({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [
        entry(image, {"os": "linux", "architecture": "amd64"}),
        entry(other, {"os": "linux", "architecture": "arm64", "variant": "v8"}),
    ]}).encode()
    digest = put_blob(blobs, index)
    desc = {"mediaType": MEDIA_INDEX, "digest": digest, "size": len(index),
            "annotations": {"org.opencontainers.image.ref.name": tag}}
    top = json.loads((image.layout / "index.json").read_text())
    top["manifests"].append(desc)
    (image.layout / "index.json").write_text(json.dumps(top))
    return desc


def expected_inodes(layer: Layer) -> int:
    """Inodes the unpacked ``layer`` has: one per tar entry but opaque markers, plus its root."""
    members = tarfile.open(fileobj=io.BytesIO(layer_tar(layer))).getnames()
    return 1 + sum(1 for name in members if not name.endswith(OPAQUE_MARKER))


def chain_ids(diff_ids: Sequence[str]) -> list[str]:
    """The OCI ChainIDs of a layer stack: the names containerd commits unpacked layers under."""
    chain: list[str] = []
    for diff_id in diff_ids:
        chain.append(diff_id if not chain else sha256_digest(f"{chain[-1]} {diff_id}".encode()))
    return chain


def busybox_layer(busybox: Path = Path("/bin/busybox")) -> Layer:
    """A base layer: static busybox at /bin/busybox with a symlink in /bin per applet."""
    if not busybox.is_file():
        raise BuildError(f"{busybox} missing: install busybox-static")
    applets = subprocess.run(
        [str(busybox), "--list"], check=True, capture_output=True, text=True, timeout=30
    ).stdout.split()
    entries: list[Entry] = [Dir(d) for d in ("bin", "dev", "etc", "proc", "sys", "root", "var")]
    entries.append(Dir("tmp", 0o1777))
    entries.append(File("bin/busybox", busybox.read_bytes(), 0o755))
    entries += [Symlink(f"bin/{name}", "busybox") for name in sorted(set(applets)) if name != "busybox"]
    entries.append(File("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"))
    entries.append(File("etc/group", b"root:x:0:\n"))
    return Layer(tuple(entries), "busybox base")


#: What the demo image's layers put where, for the tests to check against.
APP_FILE = "/app/layer1.txt"
APP_FILE_DATA = b"written by layer 1\n"
PATCH_FILE = "/app/layer2.txt"
PATCH_FILE_DATA = b"written by layer 2\n"
DELETED_FILE = "/etc/obsolete.conf"  #: added by layer 1, whited out by layer 2
OPAQUE_DIR = "/app/config"  #: layer 1 fills it, layer 2 makes it opaque
OPAQUE_OLD = ("a.conf", "b.conf")
OPAQUE_NEW = ("c.conf",)
BLOB_FILE = "/data/blob.bin"  #: a larger file, to see bytes come through intact
BLOB_SIZE = 3 * 1024 * 1024


def blob_data(size: int = BLOB_SIZE) -> bytes:
    """Deterministic, incompressible-looking content (a sha256 chain)."""
    out, block = bytearray(), b"bootseer"
    while len(out) < size:
        block = hashlib.sha256(block).digest()
        out += block
    return bytes(out[:size])


def demo_layers() -> list[Layer]:
    """The three-layer test image: busybox base, files added, then whiteout + opaque dir."""
    app = Layer(
        (
            File(APP_FILE, APP_FILE_DATA),
            *(File(f"{OPAQUE_DIR}/{name}", f"old {name}\n".encode()) for name in OPAQUE_OLD),
            File(DELETED_FILE, b"this file is deleted by layer 2\n"),
            File(BLOB_FILE, blob_data()),
            File("/app/run.sh", b"#!/bin/sh\necho hello from bootseer\n", 0o755),
        ),
        "layer 1: app files",
    )
    patch = Layer(
        (
            File(PATCH_FILE, PATCH_FILE_DATA),
            Whiteout(DELETED_FILE),
            Dir(OPAQUE_DIR),
            Opaque(OPAQUE_DIR),
            *(File(f"{OPAQUE_DIR}/{name}", f"new {name}\n".encode()) for name in OPAQUE_NEW),
        ),
        "layer 2: whiteout and opaque dir",
    )
    return [busybox_layer(), app, patch]


#: A long path (over 100 bytes: needs a PAX header) and a non-UTF-8 name (byte 0xe9).
LONG_NAME = "deep/" + "/".join(["d" * 60] * 3) + "/" + "f" * 200
NON_UTF8_NAME = "names/caf\udce9.txt"
#: Two 1 MiB blocks that appear in more than one layer (dedup across layers).
SHARED_BLOCKS = blob_data(2 << 20)


def rich_layers(block_size: int = 1 << 20) -> list[Layer]:
    """Three layers with one entry of every kind a converter must keep (no busybox needed).

    Layer 0: dirs with modes/owners/xattrs, files (empty, small, multi-block, one
    holding :data:`SHARED_BLOCKS`), hardlinks, symlinks (relative, absolute, dangling,
    ``..``), devices, a fifo, a GNU sparse file, a long and a non-UTF-8 name, an ns mtime.
    Layer 1: whiteouts of a file and a directory, an opaque directory refilled, a file
    replaced, :data:`SHARED_BLOCKS` again.  Layer 2: a replaced directory's metadata and
    a sparse file with a hole spanning whole blocks.
    """
    base = Layer(
        (
            Dir("etc", 0o755),
            Dir("srv", 0o750, uid=1000, gid=1000, xattrs={"user.comment": b"srv dir"}),
            File("etc/hosts", b"127.0.0.1 localhost\n"),
            File("etc/empty", b""),
            File("etc/secret", b"s3cret\n", 0o600, uid=1000, gid=100),
            File("srv/setuid", b"#!/bin/sh\n", 0o4755),
            File("srv/xattr.bin", b"x" * 100, xattrs={"user.a": b"1", "user.bin": b"\x00\xff\xfe"}),
            File("srv/mtime-ns", b"ns\n", mtime="1700000000.123456789"),
            File("srv/big.bin", blob_data(3 * block_size + 12345)),
            File("srv/shared.bin", SHARED_BLOCKS),
            Hardlink("srv/big.link", "srv/big.bin"),
            Hardlink("etc/hosts.link", "etc/hosts"),
            Symlink("srv/rel", "big.bin"),
            Symlink("srv/abs", "/etc/hosts"),
            Symlink("srv/escape", "../../../../etc/shadow"),
            Symlink("srv/dangling", "nowhere/at/all"),
            Device("dev/null", "char", 1, 3, 0o666),
            Device("dev/sda", "block", 8, 0, 0o660),
            Fifo("run/fifo", 0o600),
            Sparse("srv/sparse.img", 5 * block_size, ((0, b"head" * 1024), (4 * block_size + 7, b"tail" * 10))),
            File(LONG_NAME, b"long\n"),
            File(NON_UTF8_NAME, b"non-utf8\n"),
            Dir("opaque-me"),
            File("opaque-me/old.txt", b"old\n"),
            Dir("gone-dir"),
            File("gone-dir/file", b"x\n"),
            File("replace-me", b"first\n"),
        ),
        "rich: every kind",
    )
    middle = Layer(
        (
            Whiteout("etc/secret"),
            Whiteout("gone-dir"),
            Opaque("opaque-me"),
            File("opaque-me/new.txt", b"new\n"),
            File("replace-me", b"second version\n", 0o640),
            File("app/shared-again.bin", SHARED_BLOCKS + b"tail"),
        ),
        "rich: deletions",
    )
    top = Layer(
        (
            File("replace-me", b"third\n"),
            File("replace-me", b"fourth and last\n", 0o600),  # a later entry replaces an earlier one
            Dir("srv", 0o700, uid=1000, gid=1000),
            Sparse("data/holes.img", 3 * block_size + 12, ((3 * block_size, b"end of holes"),)),
        ),
        "rich: replacements and holes",
    )
    return [base, middle, top]

