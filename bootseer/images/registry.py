"""Read container images: an OCI image layout on disk or an image in an OCI/Docker registry.

One reader for everything that consumes images (``bootseer convert``, ``bootseer rpull``):

* ``oci:DIR[:TAG]`` -- an OCI image layout (``oci-layout``, ``index.json``, ``blobs/``);
* ``host[:port]/name[:tag][@sha256:...]`` -- the OCI distribution API over HTTPS (or HTTP
  with ``plain_http=True``), with bearer-token auth as the registry's ``WWW-Authenticate``
  challenge asks and basic credentials from ``~/.docker/config.json`` (``$DOCKER_CONFIG``)
  when present; credentials are never logged nor put into error messages.

Docker v2 schema 2 and OCI manifests are read; an image index (or Docker manifest list) is
resolved to the manifest of one platform (default: linux and the host's architecture).
Manifests and configs are bounded in size and checked against their digests before they
are parsed.  Blobs come as streams (:meth:`ImageSource.open_blob`) that hash what passes
through and raise :class:`DigestMismatch` instead of reporting the end of a blob whose bytes
or length are wrong, so no caller can take unverified bytes for a complete blob.

Requests go through the fetch layer's HTTP client (:mod:`bootseer.fetch.sources.http`: its
endpoints with their connect and read timeouts and TLS context, its redirect rules in
:func:`~bootseer.fetch.sources.http.request_following`, responses read bounded or streamed in
:class:`~bootseer.fetch.sources.http.HttpExchange`) and are retried by its policy
(:class:`~bootseer.fetch.retry.RetryPolicy`, :data:`HTTP_RETRY`); the auth challenge and what the
distribution API answers are this module's.

Every failure is an :class:`ImageError` subclass saying what and where.  This module is
synchronous; trio callers run it with ``trio.to_thread``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import os
import platform as _platform
import re
import time
import urllib.parse
from pathlib import Path
from typing import Any, BinaryIO, Mapping, Sequence

from bootseer.fetch.retry import RetryPolicy
from bootseer.fetch.source import PermanentError, SourceError, TransientError
from bootseer.fetch.sources import redact_url
from bootseer.fetch.sources.http import (
    HttpExchange, RedirectRefused, parse_endpoint_url, request_following, transient_status,
)  # fmt: skip
from bootseer.log import get_logger

log = get_logger(__name__)

# --------------------------------------------------------------------------- media types

MEDIA_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MEDIA_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MEDIA_DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
MEDIA_DOCKER_SCHEMA1 = ("application/vnd.docker.distribution.manifest.v1+json",
                        "application/vnd.docker.distribution.manifest.v1+prettyjws")

MANIFEST_TYPES = frozenset({MEDIA_OCI_MANIFEST, MEDIA_DOCKER_MANIFEST})
INDEX_TYPES = frozenset({MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST})
CONFIG_TYPES = frozenset({MEDIA_OCI_CONFIG, MEDIA_DOCKER_CONFIG})

#: Layer media types and the compression of their blobs (None: a plain tar).
LAYER_COMPRESSION: Mapping[str, str | None] = {
    "application/vnd.oci.image.layer.v1.tar": None,
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": None,
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar": None,
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.diff.tar.zstd": "zstd",
}

#: Bounds on what is read into memory: containerd caps manifests at 4 MiB too.
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_CONFIG_BYTES = 16 * 1024 * 1024
#: Bound on an index nested in an index (OCI allows it; a loop must not recurse forever).
MAX_INDEX_DEPTH = 4

#: Timeout of connecting to a registry, and of each socket operation after that.
HTTP_TIMEOUT_S = 60.0
#: Redirects followed for one request (blob GETs are often redirected to object storage).
MAX_REDIRECTS = 5
#: The retries of a request that failed before any body byte (connection refused or reset; 408, 425, 429,
#: 5xx): three attempts in all, about 0.2-0.4 s and 0.4-0.8 s apart (the fetch layer's policy, with its numbers).
HTTP_RETRY = RetryPolicy(timeout=HTTP_TIMEOUT_S, max_attempts=3, first_delay=0.4)
#: Chunk size blobs are read in.
CHUNK = 1024 * 1024

_HASHES = {"sha256": 64, "sha512": 128}
_DIGEST = re.compile(r"^(sha256|sha512):([0-9a-f]+)$")


def layer_compression(media_type: str) -> str | None:
    """``"gzip"``, ``"zstd"`` or None (plain tar) for a layer media type; :class:`UnsupportedMediaType` otherwise."""
    try:
        return LAYER_COMPRESSION[media_type]
    except KeyError:
        raise UnsupportedMediaType(f"unsupported layer media type {media_type!r}") from None


# --------------------------------------------------------------------------- errors


class ImageError(Exception):
    """Base of every failure reading an image; the message names the image or blob."""


class BadReference(ImageError, ValueError):
    """The image reference does not parse (neither ``oci:DIR[:TAG]`` nor a registry reference)."""


class ImageNotFound(ImageError):
    """The registry or layout has no such image, tag, manifest or blob (HTTP 404)."""


class AuthError(ImageError):
    """The registry refused us (401/403), or its auth challenge or token service failed."""


class UnsupportedMediaType(ImageError):
    """A manifest, config or layer of a media type this reader does not handle."""


class DigestMismatch(ImageError):
    """Bytes whose digest or length is not the one their descriptor names: never used."""


class MalformedImage(ImageError):
    """Malformed JSON, a document missing required fields, or an object over its size bound."""


class RegistryError(ImageError):
    """The registry failed otherwise (5xx, connection errors, unexpected status)."""


# --------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class Platform:
    """An OCI platform (``os/architecture[/variant]``)."""

    os: str
    architecture: str
    variant: str = ""

    @classmethod
    def parse(cls, text: str) -> "Platform":
        """``linux/amd64``, ``linux/arm64/v8``, ...; :class:`ImageError` for anything else."""
        parts = text.strip().split("/")
        if len(parts) not in (2, 3) or not all(re.fullmatch(r"[a-z0-9_.-]+", p) for p in parts):
            raise ImageError(f"bad platform {text!r}: want os/architecture[/variant], e.g. linux/amd64")
        return cls(*parts)

    @classmethod
    def host(cls) -> "Platform":
        """Linux on this machine's architecture, in Go's names (x86_64 -> amd64)."""
        machine = _platform.machine().lower()
        arch, variant = {
            "x86_64": ("amd64", ""), "amd64": ("amd64", ""), "aarch64": ("arm64", ""), "arm64": ("arm64", ""),
            "armv7l": ("arm", "v7"), "armv6l": ("arm", "v6"), "i686": ("386", ""), "i386": ("386", ""),
            "ppc64le": ("ppc64le", ""), "s390x": ("s390x", ""), "riscv64": ("riscv64", ""),
        }.get(machine, (machine, ""))
        return cls("linux", arch, variant)

    def matches(self, other: Mapping[str, Any]) -> bool:
        """Whether an index entry's ``platform`` object is this platform (an unset variant matches any)."""
        if other.get("os") != self.os or other.get("architecture") != self.architecture:
            return False
        return not self.variant or other.get("variant", "") in (self.variant, "")

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: what a blob is, by digest and size."""

    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    platform: Mapping[str, Any] | None = None
    urls: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, obj: Any, what: str) -> "Descriptor":
        """Parse and check a descriptor object; :class:`MalformedImage` names ``what`` on failure."""
        if not isinstance(obj, dict):
            raise MalformedImage(f"{what}: descriptor is not an object")
        media_type, digest, size = obj.get("mediaType"), obj.get("digest"), obj.get("size")
        if not isinstance(media_type, str) or not media_type:
            raise MalformedImage(f"{what}: descriptor has no mediaType")
        if not isinstance(digest, str):
            raise MalformedImage(f"{what}: descriptor has no digest")
        check_digest(digest, what)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise MalformedImage(f"{what}: descriptor has no valid size ({size!r})")
        annotations = obj.get("annotations") or {}
        if not isinstance(annotations, dict) or not all(isinstance(v, str) for v in annotations.values()):
            raise MalformedImage(f"{what}: annotations are not a string map")
        plat = obj.get("platform")
        if plat is not None and not isinstance(plat, dict):
            raise MalformedImage(f"{what}: platform is not an object")
        urls = obj.get("urls") or []
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise MalformedImage(f"{what}: urls are not a list of strings")
        return cls(media_type, digest, size, dict(annotations), plat, tuple(urls))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        if self.platform is not None:
            out["platform"] = dict(self.platform)
        if self.urls:
            out["urls"] = list(self.urls)
        return out


@dataclasses.dataclass(frozen=True)
class Manifest:
    """An image manifest (OCI or Docker schema 2): its config and its layers, lowest first."""

    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclasses.dataclass(frozen=True)
class ResolvedImage:
    """What a reference names, read and verified: manifest, config and the diff_ids of its layers.

    ``index``/``index_bytes`` are set when the reference named an image index (or Docker
    manifest list) from which ``manifest_descriptor`` was chosen for the platform.
    """

    reference: str
    manifest_descriptor: Descriptor
    manifest_bytes: bytes
    manifest: Manifest
    config_bytes: bytes
    config: Mapping[str, Any]
    diff_ids: tuple[str, ...]
    index: Descriptor | None = None
    index_bytes: bytes | None = None

    @property
    def target(self) -> Descriptor:
        """The descriptor the reference itself names: the index if there was one, else the manifest."""
        return self.index if self.index is not None else self.manifest_descriptor

    @property
    def layers(self) -> tuple[Descriptor, ...]:
        return self.manifest.layers


def check_digest(digest: str, what: str = "digest") -> str:
    """Return ``digest`` if it is ``sha256:<64 hex>`` or ``sha512:<128 hex>``; :class:`MalformedImage` otherwise."""
    m = _DIGEST.match(digest)
    if not m or len(m.group(2)) != _HASHES[m.group(1)]:
        raise MalformedImage(f"{what}: invalid digest {digest!r}")
    return digest


def _hasher(digest: str):
    return hashlib.new(digest.partition(":")[0])


def verify_bytes(data: bytes, descriptor: Descriptor, what: str) -> bytes:
    """``data`` if its length and digest are the descriptor's; :class:`DigestMismatch` otherwise."""
    if len(data) != descriptor.size:
        raise DigestMismatch(f"{what} {descriptor.digest}: {len(data)} bytes, descriptor says {descriptor.size}")
    h = _hasher(descriptor.digest)
    h.update(data)
    actual = f"{descriptor.digest.partition(':')[0]}:{h.hexdigest()}"
    if actual != descriptor.digest:
        raise DigestMismatch(f"{what}: content has digest {actual}, expected {descriptor.digest}")
    return data


def _parse_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedImage(f"{what}: malformed JSON ({e})") from None
    if not isinstance(obj, dict):
        raise MalformedImage(f"{what}: not a JSON object")
    return obj


def parse_manifest(data: bytes, media_type: str, what: str) -> Manifest:
    """Parse an image manifest; its ``mediaType`` field, if set, must agree with ``media_type``."""
    obj = _parse_json(data, what)
    declared = obj.get("mediaType", media_type)
    if declared != media_type:
        raise MalformedImage(f"{what}: mediaType field {declared!r} disagrees with {media_type!r}")
    if obj.get("schemaVersion") != 2:
        raise UnsupportedMediaType(f"{what}: schemaVersion {obj.get('schemaVersion')!r}, only 2 is supported")
    config = Descriptor.from_json(obj.get("config"), f"{what} config")
    if config.media_type not in CONFIG_TYPES:
        raise UnsupportedMediaType(f"{what}: config media type {config.media_type!r} is not an image config")
    raw_layers = obj.get("layers")
    if not isinstance(raw_layers, list):
        raise MalformedImage(f"{what}: layers is not a list")
    layers = tuple(Descriptor.from_json(layer, f"{what} layer {i}") for i, layer in enumerate(raw_layers))
    for i, layer in enumerate(layers):
        if layer.media_type not in LAYER_COMPRESSION:
            raise UnsupportedMediaType(f"{what} layer {i}: unsupported layer media type {layer.media_type!r}")
    return Manifest(media_type, config, layers)


def parse_config(data: bytes, n_layers: int, what: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Parse an image config and return it with its ``rootfs.diff_ids`` (one per layer, checked)."""
    obj = _parse_json(data, what)
    rootfs = obj.get("rootfs")
    if not isinstance(rootfs, dict) or rootfs.get("type") != "layers" or not isinstance(rootfs.get("diff_ids"), list):
        raise MalformedImage(f"{what}: no rootfs.diff_ids of type layers")
    diff_ids = tuple(rootfs["diff_ids"])
    for diff_id in diff_ids:
        if not isinstance(diff_id, str):
            raise MalformedImage(f"{what}: diff_id {diff_id!r} is not a string")
        check_digest(diff_id, f"{what} diff_id")
    if len(diff_ids) != n_layers:
        raise MalformedImage(f"{what}: {len(diff_ids)} diff_ids for {n_layers} layers")
    return obj, diff_ids


def index_entries(index: Mapping[str, Any], what: str) -> list[Descriptor]:
    """The ``manifests`` of a parsed image index, checked."""
    raw = index.get("manifests")
    if not isinstance(raw, list):
        raise MalformedImage(f"{what}: manifests is not a list")
    return [Descriptor.from_json(m, f"{what} manifest {i}") for i, m in enumerate(raw)]


def parse_index(data: bytes, media_type: str, what: str) -> list[Descriptor]:
    """The entries of an image index (or Docker manifest list); its ``mediaType`` must agree with ``media_type``."""
    index = _parse_json(data, what)
    declared = index.get("mediaType", media_type)
    if declared != media_type:
        raise MalformedImage(f"{what}: mediaType field {declared!r} disagrees with {media_type!r}")
    return index_entries(index, what)


def select_platform(index: Mapping[str, Any] | Sequence[Descriptor], wanted: Platform, what: str) -> Descriptor:
    """The entry of an image index for ``wanted``: exact variant first, then one without a variant."""
    entries = list(index) if not isinstance(index, Mapping) else index_entries(index, what)
    candidates = [e for e in entries if e.platform is not None and wanted.matches(e.platform)
                  and (e.media_type in MANIFEST_TYPES or e.media_type in INDEX_TYPES)]
    candidates.sort(key=lambda e: 0 if (e.platform or {}).get("variant", "") == wanted.variant else 1)
    if not candidates:
        offered = sorted({"/".join(filter(None, (e.platform.get("os"), e.platform.get("architecture"),
                                                 e.platform.get("variant"))))
                          for e in entries if e.platform})
        raise ImageNotFound(f"{what}: no manifest for platform {wanted} (offered: {', '.join(offered) or 'none'})")
    return candidates[0]


# --------------------------------------------------------------------------- verified stream


class VerifiedBlob(io.RawIOBase):
    """A blob's bytes as a stream, checked against its descriptor as they pass.

    End of stream is reported (``read`` returning ``b""``) only after the length and digest
    were found right; otherwise the read that reaches the end (or the first byte past the
    declared size) raises :class:`DigestMismatch`.  ``verified`` says the check passed.
    """

    def __init__(self, raw: BinaryIO | HttpExchange, descriptor: Descriptor, what: str, on_close=None):
        super().__init__()
        self._raw = raw
        self.descriptor = descriptor
        self._what = what
        self._hash = _hasher(descriptor.digest)
        self._seen = 0
        self._on_close = on_close
        self.verified = False

    def readable(self) -> bool:
        return True

    @property
    def bytes_read(self) -> int:
        return self._seen

    def readinto(self, buffer) -> int:
        if self.verified:
            return 0
        view = memoryview(buffer).cast("B")
        # Ask for at most one byte past the declared size: enough to notice an overlong blob.
        want = min(len(view), self.descriptor.size - self._seen + 1)
        try:
            data = self._raw.read(want) if want > 0 else b""
        except (OSError, SourceError) as e:
            raise RegistryError(f"{self._what}: read failed after {self._seen} bytes: {e}") from e
        if not data:
            self._finish()
            return 0
        self._seen += len(data)
        if self._seen > self.descriptor.size:
            raise DigestMismatch(f"{self._what}: more than the {self.descriptor.size} bytes its descriptor says")
        self._hash.update(data)
        view[: len(data)] = data
        return len(data)

    def _finish(self) -> None:
        if self._seen != self.descriptor.size:
            raise DigestMismatch(f"{self._what}: ended after {self._seen} of {self.descriptor.size} bytes")
        actual = f"{self.descriptor.digest.partition(':')[0]}:{self._hash.hexdigest()}"
        if actual != self.descriptor.digest:
            raise DigestMismatch(f"{self._what}: content has digest {actual}, expected {self.descriptor.digest}")
        self.verified = True

    def close(self) -> None:
        if not self.closed:
            try:
                self._raw.close()
            finally:
                if self._on_close is not None:
                    self._on_close()
        super().close()


# --------------------------------------------------------------------------- sources


class ImageSource:
    """An image to read: :meth:`resolve` it, then stream its blobs.  Use as a context manager."""

    #: The reference as given (credentials never appear in it).
    reference: str

    def resolve(self) -> ResolvedImage:
        """Read the manifest (through the index for the platform) and the config, verified."""
        target, target_bytes = self._resolve_target()
        index_desc: Descriptor | None = None
        index_bytes: bytes | None = None
        desc, data = target, target_bytes
        for depth in range(MAX_INDEX_DEPTH + 1):
            if desc.media_type in MANIFEST_TYPES:
                break
            if desc.media_type not in INDEX_TYPES:
                raise UnsupportedMediaType(self._media_type_message(desc.media_type, desc.digest))
            if depth == MAX_INDEX_DEPTH:
                raise MalformedImage(f"{self.reference}: image indexes nested deeper than {MAX_INDEX_DEPTH}")
            if index_desc is None:
                index_desc, index_bytes = desc, data
            what = f"{self.reference} index {desc.digest}"
            desc = select_platform(parse_index(data, desc.media_type, what), self.platform, what)
            data = self._read_manifest(desc)
        what = f"{self.reference} manifest {desc.digest}"
        manifest = parse_manifest(data, desc.media_type, what)
        if manifest.config.size > MAX_CONFIG_BYTES:
            raise MalformedImage(f"{what}: config of {manifest.config.size} bytes exceeds {MAX_CONFIG_BYTES}")
        config_bytes = self.read_blob(manifest.config, MAX_CONFIG_BYTES)
        config, diff_ids = parse_config(config_bytes, len(manifest.layers), f"{self.reference} config")
        return ResolvedImage(self.reference, desc, data, manifest, config_bytes, config, diff_ids,
                             index_desc, index_bytes)

    def _media_type_message(self, media_type: str, what: str) -> str:
        if media_type in MEDIA_DOCKER_SCHEMA1:
            return f"{self.reference}: Docker schema 1 manifests are not supported (re-push the image)"
        return f"{self.reference}: {what} has media type {media_type!r}, not a manifest or index"

    def read_blob(self, descriptor: Descriptor, limit: int) -> bytes:
        """A small blob, whole and verified; :class:`MalformedImage` if it is larger than ``limit``."""
        if descriptor.size > limit:
            raise MalformedImage(f"{self.reference}: blob {descriptor.digest} of {descriptor.size} bytes exceeds {limit}")
        with self.open_blob(descriptor) as stream:
            data = stream.read()
        return data

    # Subclasses provide these.
    platform: Platform

    def _resolve_target(self) -> tuple[Descriptor, bytes]:
        """The descriptor the reference names and its bytes, verified against it."""
        raise NotImplementedError

    def _read_manifest(self, descriptor: Descriptor) -> bytes:
        """A manifest or index by descriptor, verified and bounded."""
        return self.read_blob(descriptor, MAX_MANIFEST_BYTES)

    def open_blob(self, descriptor: Descriptor) -> VerifiedBlob:
        """A stream of the blob's bytes that verifies digest and size when read to the end."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections; the source is unusable afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class OCILayoutSource(ImageSource):
    """An image in an OCI image layout directory, chosen by its ``org.opencontainers.image.ref.name``."""

    REF_NAME = "org.opencontainers.image.ref.name"

    def __init__(self, directory: Path, tag: str | None, platform: Platform):
        self.directory = directory
        self.tag = tag
        self.platform = platform
        self.reference = f"oci:{directory}" + (f":{tag}" if tag else "")

    def _resolve_target(self) -> tuple[Descriptor, bytes]:
        layout = self.directory / "oci-layout"
        try:
            version = _parse_json(layout.read_bytes(), f"{layout}").get("imageLayoutVersion")
        except FileNotFoundError:
            raise ImageNotFound(f"{self.reference}: {layout} missing: not an OCI image layout") from None
        if version != "1.0.0":
            raise UnsupportedMediaType(f"{self.reference}: imageLayoutVersion {version!r}, expected 1.0.0")
        index_path = self.directory / "index.json"
        try:
            raw = index_path.read_bytes()
        except FileNotFoundError:
            raise ImageNotFound(f"{self.reference}: {index_path} missing") from None
        if len(raw) > MAX_MANIFEST_BYTES:
            raise MalformedImage(f"{index_path}: larger than {MAX_MANIFEST_BYTES} bytes")
        index = _parse_json(raw, str(index_path))
        entries = index.get("manifests")
        if not isinstance(entries, list):
            raise MalformedImage(f"{index_path}: manifests is not a list")
        descs = [Descriptor.from_json(m, f"{index_path} manifest {i}") for i, m in enumerate(entries)]
        if self.tag is None:
            if len(descs) != 1:
                raise BadReference(f"{self.reference}: the layout holds {len(descs)} images; name one as oci:DIR:TAG")
            chosen = descs
        else:
            chosen = [d for d in descs if d.annotations.get(self.REF_NAME) == self.tag]
            if not chosen:
                tags = sorted(d.annotations[self.REF_NAME] for d in descs if self.REF_NAME in d.annotations)
                raise ImageNotFound(f"{self.reference}: no image tagged {self.tag!r} (tags: {', '.join(tags) or 'none'})")
        if len(chosen) > 1:
            # Several entries under one name: one per platform (skopeo/buildx write layouts so).
            desc = select_platform(chosen, self.platform, self.reference)
        else:
            desc = chosen[0]
        if desc.media_type not in MANIFEST_TYPES | INDEX_TYPES:
            raise UnsupportedMediaType(self._media_type_message(desc.media_type, desc.digest))
        return desc, self._read_manifest(desc)

    def _blob_path(self, descriptor: Descriptor) -> Path:
        algorithm, _, hexdigest = check_digest(descriptor.digest, self.reference).partition(":")
        return self.directory / "blobs" / algorithm / hexdigest

    def open_blob(self, descriptor: Descriptor) -> VerifiedBlob:
        path = self._blob_path(descriptor)
        what = f"{self.reference} blob {descriptor.digest}"
        try:
            raw = open(path, "rb")
        except FileNotFoundError:
            raise ImageNotFound(f"{what}: {path} missing") from None
        except OSError as e:
            raise ImageError(f"{what}: cannot open {path}: {e}") from e
        return VerifiedBlob(raw, descriptor, what)


# --------------------------------------------------------------------------- registry

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = re.compile(rf"^(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?$")
_PATH_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"


@dataclasses.dataclass(frozen=True)
class RegistryReference:
    """A parsed registry reference: ``domain/repository[:tag][@digest]`` (tag ``latest`` if neither)."""

    domain: str
    repository: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str) -> "RegistryReference":
        """Docker's reference grammar; a name without a domain is Docker Hub's (``library/`` added)."""
        if not text or len(text) > 4096 or any(c.isspace() for c in text):
            raise BadReference(f"bad image reference {text!r}")
        rest, digest = text, None
        if "@" in rest:
            rest, _, digest = rest.partition("@")
            try:
                check_digest(digest, "reference")
            except MalformedImage:
                raise BadReference(f"bad image reference {text!r}: invalid digest {digest!r}") from None
        tag = None
        last = rest.rsplit("/", 1)[-1]
        if ":" in last:
            rest, _, tag = rest.rpartition(":")
            if not _TAG.match(tag):
                raise BadReference(f"bad image reference {text!r}: invalid tag {tag!r}")
        first, sep, remainder = rest.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
            domain, path = first, remainder
            if not _DOMAIN.match(domain):
                raise BadReference(f"bad image reference {text!r}: invalid registry host {domain!r}")
        else:
            domain, path = DOCKER_HUB, rest
            if "/" not in path:
                path = f"library/{path}"
        components = path.split("/")
        if not path or not all(_PATH_COMPONENT.match(c) for c in components):
            raise BadReference(f"bad image reference {text!r}: invalid repository name {path!r}")
        if len(path) > 255:
            raise BadReference(f"bad image reference {text!r}: repository name longer than 255")
        if tag is None and digest is None:
            tag = "latest"
        return cls(domain, path, tag, digest)

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.domain == DOCKER_HUB else self.domain

    @property
    def object(self) -> str:
        """What the manifest request names: the digest if given (it pins the content), else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.domain}/{self.repository}" + (f":{self.tag}" if self.tag else "") + \
            (f"@{self.digest}" if self.digest else "")


def docker_credentials(host: str, config_dir: Path | None = None) -> tuple[str, str] | None:
    """(user, password) for ``host`` from ``$DOCKER_CONFIG/config.json`` (default ``~/.docker``), if any.

    Only inline ``auths`` entries are read; credential helpers (``credsStore``) are not run.
    """
    if config_dir is None:
        env = os.environ.get("DOCKER_CONFIG")
        config_dir = Path(env) if env else Path.home() / ".docker"
    path = config_dir / "config.json"
    try:
        config = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise AuthError(f"cannot read {path}: {e.__class__.__name__}") from None
    auths = config.get("auths") if isinstance(config, dict) else None
    if not isinstance(auths, dict):
        return None
    names = {host}
    if host in (DOCKER_HUB, DOCKER_HUB_API):
        names |= {DOCKER_HUB, "https://index.docker.io/v1/", "index.docker.io"}
    for key, entry in auths.items():
        bare = re.sub(r"^https?://", "", key).rstrip("/").split("/", 1)[0]
        if (key in names or bare in names) and isinstance(entry, dict):
            if isinstance(entry.get("auth"), str) and entry["auth"]:
                try:
                    user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
                except (ValueError, UnicodeDecodeError):
                    raise AuthError(f"{path}: the auth entry for {key} is not base64 user:password") from None
                if sep:
                    return user, password
            if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
                return entry["username"], entry["password"]
    return None


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="...",service="..."`` -> ("bearer", {...})."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    params.update({k.lower(): v for k, v in re.findall(r'(\w+)=([^",\s]+)', rest) if k.lower() not in params})
    return scheme.lower(), params


class RegistrySource(ImageSource):
    """An image in a registry, read with the OCI distribution API."""

    def __init__(self, ref: RegistryReference, *, plain_http: bool, platform: Platform,
                 credentials: tuple[str, str] | None = None, timeout: float = HTTP_TIMEOUT_S,
                 retry: RetryPolicy = HTTP_RETRY):
        self.ref = ref
        self.reference = str(ref)
        self.platform = platform
        self.plain_http = plain_http
        self.timeout = timeout
        self.retry = retry
        self._credentials = credentials if credentials is not None else docker_credentials(ref.domain)
        self._authorization: str | None = None  # what the last challenge led to; never logged
        # The registry's endpoint: its timeouts and TLS context (the system's CAs, $SSL_CERT_FILE) go to
        # every URL a request names or is redirected to (HttpEndpoint.at); credentials go per request.
        self._endpoint, _path, _query = parse_endpoint_url(
            self.base_url, ("http", "https"), connect_timeout=timeout, read_timeout=timeout, headers=None,
            verify=True, ca_file=None, default_ports={"http": 80, "https": 443},
        )  # fmt: skip

    @property
    def base_url(self) -> str:
        return f"{'http' if self.plain_http else 'https'}://{self.ref.api_host}/v2/{self.ref.repository}"

    # -- HTTP ----------------------------------------------------------------

    def _send(self, method: str, url: str, headers: Mapping[str, str], authorization: str | None = None) -> HttpExchange:
        """One request, retried as :attr:`retry` says on network failures and transient statuses
        (the last answer comes back as it is); the response is open.

        Redirects are followed (:func:`~bootseer.fetch.sources.http.request_following`), up
        to :data:`MAX_REDIRECTS`, with two rules for every request (manifests, blobs, token
        services): a redirect from ``https`` to ``http`` is refused unless ``plain_http`` was
        asked for, and ``authorization`` is dropped as soon as a hop leaves the origin
        (scheme, host or port), as blob redirects to object storage or a CDN normally do:
        their URLs carry their own signature.
        """
        try:
            endpoint, target = self._endpoint.at(url)
        except PermanentError as e:
            raise RegistryError(f"{self.reference}: refusing to follow {e}") from None
        if authorization:
            endpoint = endpoint.with_headers({"Authorization": authorization})
        first_attempt, attempts = time.monotonic(), 0
        while True:
            attempts += 1
            try:
                exchange = request_following(endpoint, method, target, headers, max_redirects=MAX_REDIRECTS,
                                             allow_downgrade=self.plain_http)
            except RedirectRefused as e:
                raise RegistryError(f"{self.reference}: {e}; pass --plain-http to allow it") from None
            except PermanentError as e:
                raise RegistryError(f"{self.reference}: {e}") from None
            except TransientError as e:
                if self.retry.gives_up(e, attempts=attempts, first_attempt=first_attempt, now=time.monotonic()):
                    raise RegistryError(f"{self.reference}: {method} {redact_url(url)} failed: {e}") from e
            else:
                failure = TransientError(f"HTTP {exchange.status}")
                if not transient_status(exchange.status) or self.retry.gives_up(
                        failure, attempts=attempts, first_attempt=first_attempt, now=time.monotonic()):
                    return exchange
                exchange.close()
            log.debug("registry request failed; retrying", registry=self.ref.api_host, method=method,
                        url=redact_url(url), attempt=attempts)
            time.sleep(self.retry.wait(attempts, first_attempt, time.monotonic()))

    def _request(self, method: str, url: str, headers: Mapping[str, str], what: str) -> HttpExchange:
        """A request to the registry, answering its auth challenge once; raises on any non-2xx status."""
        response = self._send(method, url, headers, self._authorization)
        if response.status == 401:
            challenge = response.header("WWW-Authenticate") or ""
            response.close()
            self._authorization = self._answer(challenge, what)
            response = self._send(method, url, headers, self._authorization)
        if 200 <= response.status < 300:
            return response
        status, reason = response.status, response.reason
        body = _error_summary(response)
        if status == 404:
            raise ImageNotFound(f"{what}: not found in {self.ref.api_host}/{self.ref.repository} (404{body})")
        if status in (401, 403):
            hint = "" if self._credentials else " (no credentials for this registry in the docker config)"
            raise AuthError(f"{what}: the registry refused access ({status} {reason}{body}){hint}")
        raise RegistryError(f"{what}: {method} {redact_url(url)} answered {status} {reason}{body}")

    def _answer(self, challenge: str, what: str) -> str:
        """The Authorization header a 401's challenge asks for."""
        scheme, params = _parse_challenge(challenge)
        if scheme == "basic":
            if not self._credentials:
                raise AuthError(f"{what}: the registry wants basic auth and the docker config has no credentials "
                                f"for {self.ref.domain}")
            user, password = self._credentials
            return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        if scheme != "bearer" or "realm" not in params:
            raise AuthError(f"{what}: unsupported auth challenge {challenge.split(' ', 1)[0]!r}")
        return "Bearer " + self._token(params, what)

    def _token(self, params: Mapping[str, str], what: str) -> str:
        realm = params["realm"]
        scheme = urllib.parse.urlsplit(realm).scheme
        if scheme not in ("https", "http") or (scheme == "http" and not self.plain_http):
            raise AuthError(f"{what}: refusing token realm {redact_url(realm)} (not HTTPS)")
        query = {k: v for k, v in (("service", params.get("service")),
                                   ("scope", params.get("scope") or f"repository:{self.ref.repository}:pull")) if v}
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        basic = None
        if self._credentials:
            user, password = self._credentials
            basic = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        response = self._send("GET", url, {"Accept": "application/json"}, basic)
        try:
            if response.status != 200:
                raise AuthError(f"{what}: token service {redact_url(realm)} answered {response.status}"
                                f"{'' if self._credentials else ' (no credentials in the docker config)'}")
            body = _parse_json(_read_bounded(response, 1024 * 1024, "token response"), "token response")
        finally:
            response.close()
        token = body.get("token") or body.get("access_token")
        if not isinstance(token, str) or not token:
            raise AuthError(f"{what}: token service {redact_url(realm)} sent no token")
        log.debug("registry token obtained", registry=self.ref.api_host, scope=query.get("scope", ""))
        return token

    # -- the API -------------------------------------------------------------

    def _fetch_manifest(self, name: str, expected: Descriptor | None) -> tuple[Descriptor, bytes]:
        what = f"{self.reference} manifest {name}"
        accept = ", ".join([MEDIA_OCI_MANIFEST, MEDIA_DOCKER_MANIFEST, MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST,
                            *MEDIA_DOCKER_SCHEMA1])
        response = self._request("GET", f"{self.base_url}/manifests/{name}", {"Accept": accept}, what)
        try:
            data = _read_bounded(response, MAX_MANIFEST_BYTES, what)
            content_type = (response.header("Content-Type") or "").split(";")[0].strip()
            header_digest = response.header("Docker-Content-Digest")
        finally:
            response.close()
        if expected is not None:
            return expected, verify_bytes(data, expected, what)
        media_type = content_type
        if media_type not in MANIFEST_TYPES | INDEX_TYPES:
            # Some registries answer a generic type; the document's own mediaType then decides.
            media_type = _parse_json(data, what).get("mediaType") or content_type
        if media_type not in MANIFEST_TYPES | INDEX_TYPES:
            raise UnsupportedMediaType(self._media_type_message(media_type or "(none)", f"manifest {name}"))
        algorithm = self.ref.digest.partition(":")[0] if self.ref.digest else "sha256"
        actual = f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"
        if self.ref.digest and actual != self.ref.digest:
            raise DigestMismatch(f"{what}: content has digest {actual}, expected {self.ref.digest}")
        if header_digest and header_digest.startswith(f"{algorithm}:") and header_digest != actual:
            raise DigestMismatch(f"{what}: content has digest {actual}, the registry says {header_digest}")
        return Descriptor(media_type, actual, len(data)), data

    def _resolve_target(self) -> tuple[Descriptor, bytes]:
        return self._fetch_manifest(self.ref.object, None)

    def _read_manifest(self, descriptor: Descriptor) -> bytes:
        if descriptor.size > MAX_MANIFEST_BYTES:
            raise MalformedImage(f"{self.reference}: manifest {descriptor.digest} of {descriptor.size} bytes "
                                 f"exceeds {MAX_MANIFEST_BYTES}")
        return self._fetch_manifest(descriptor.digest, descriptor)[1]

    def open_blob(self, descriptor: Descriptor) -> VerifiedBlob:
        check_digest(descriptor.digest, self.reference)
        what = f"{self.reference} blob {descriptor.digest}"
        response = self._request("GET", f"{self.base_url}/blobs/{descriptor.digest}", {}, what)
        length = response.header("Content-Length")
        if length is not None and length.isdigit() and int(length) != descriptor.size:
            response.close()
            raise DigestMismatch(f"{what}: the registry sends {length} bytes, descriptor says {descriptor.size}")
        return VerifiedBlob(response, descriptor, what)


def _read_bounded(response: HttpExchange, limit: int, what: str) -> bytes:
    """The whole body of ``response``; :class:`MalformedImage` past ``limit`` bytes, :class:`RegistryError`
    if the connection fails on the way."""
    try:
        return response.read_body(limit)
    except PermanentError:
        raise MalformedImage(f"{what}: larger than the bound of {limit} bytes") from None
    except TransientError as e:
        raise RegistryError(f"{what}: reading the body failed: {e}") from e


def _error_summary(response: HttpExchange) -> str:
    """``: CODE message`` from a distribution-API error body, if it has one (bounded, never raises)."""
    try:
        body = json.loads(response.read(64 * 1024) or b"{}")
        errors = body.get("errors") if isinstance(body, dict) else None
        if isinstance(errors, list) and errors and isinstance(errors[0], dict):
            return f": {errors[0].get('code', '')} {errors[0].get('message', '')}".rstrip()
    except (ValueError, SourceError):
        pass
    finally:
        response.close()
    return ""


# --------------------------------------------------------------------------- entry point


def parse_oci_reference(text: str) -> tuple[Path, str | None]:
    """``oci:DIR[:TAG]`` -> (DIR, TAG); a DIR that exists as given wins over a split at its last ``:``."""
    body = text[len("oci:"):]
    if not body:
        raise BadReference(f"bad image reference {text!r}: want oci:DIR[:TAG]")
    if Path(body).is_dir():
        return Path(body), None
    directory, sep, tag = body.rpartition(":")
    if sep and directory and "/" not in tag:
        if not _TAG.match(tag):
            raise BadReference(f"bad image reference {text!r}: invalid tag {tag!r}")
        return Path(directory), tag
    return Path(body), None


def open_image(ref: str, *, plain_http: bool = False, platform: str | Platform | None = None) -> ImageSource:
    """An :class:`ImageSource` for ``oci:DIR[:TAG]`` or a registry reference; :class:`BadReference` if neither.

    ``platform`` (``os/arch[/variant]``) picks the manifest of an index; default linux on this
    machine's architecture.  ``plain_http`` talks HTTP instead of HTTPS to the registry.
    """
    wanted = platform if isinstance(platform, Platform) else (Platform.parse(platform) if platform else Platform.host())
    if ref.startswith("oci:"):
        directory, tag = parse_oci_reference(ref)
        return OCILayoutSource(directory, tag, wanted)
    if "://" in ref:
        raise BadReference(f"bad image reference {ref!r}: give host[:port]/name[:tag] without a scheme "
                           f"(--plain-http for HTTP) or oci:DIR[:TAG]")
    return RegistrySource(RegistryReference.parse(ref), plain_http=plain_http, platform=wanted)


__all__ = [
    "AuthError", "BadReference", "Descriptor", "DigestMismatch", "ImageError", "ImageNotFound", "ImageSource",
    "MalformedImage", "Manifest", "OCILayoutSource", "Platform", "RegistryError", "RegistryReference",
    "RegistrySource", "ResolvedImage", "UnsupportedMediaType", "VerifiedBlob", "layer_compression", "open_image",
    "parse_index",
]
