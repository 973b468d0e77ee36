"""``bootseer rpull``: containerd's client-side pull with unpack, so remote snapshots are used.

``ctr images pull`` in containerd 1.6 fetches every blob before it unpacks anything.  This
does what containerd's Go client does when it pulls with unpack (``client.Pull``,
``unpacker.go``, ``rootfs/apply.go``), through containerd's own gRPC services on its socket:

1. a lease (so nothing written is collected before the image record refers to it);
2. the config, the manifest (and the index it was chosen from) into the content store
   (``Content.Write``), with the labels containerd's garbage collector follows
   (``containerd.io/gc.ref.content.*``) and the distribution source labels;
3. each layer, lowest first: ``Stat(chainID)`` (already unpacked: skip), else ``Prepare``
   with key ``extract-<unique> <chainID>``, parent the previous chainID and the labels
   ``containerd.io/snapshot.ref=<chainID>`` plus the CRI hints (``cri.image-ref``,
   ``cri.layer-digest``, ``cri.manifest-digest``, ``cri.image-layers``).  A snapshotter
   that has the layer (a remote snapshot) answers ALREADY_EXISTS: nothing is fetched.
   Otherwise the blob is fetched into the content store, applied with the ``Diff``
   service on the mounts ``Prepare`` returned (its diffID checked), committed under the
   chainID and labelled ``containerd.io/uncompressed``.  Blobs are fetched one at a time
   and only for layers that need one: containerd's unpacker starts fetching every layer
   above the first it must download, which would defeat remote snapshots higher up;
4. ``containerd.io/gc.ref.snapshot.<snapshotter>=<top chainID>`` on the config (what
   ``ctr run``'s "is it unpacked?" check and the garbage collector follow), the image
   record (``Images.Create``/``Update``), and the lease is released.

Image reading (registry, auth, verification) is :mod:`bootseer.images.registry`'; this module is the
containerd side.  gRPC failures become :class:`ContainerdError` kinds at :class:`Containerd`,
the one place that calls containerd.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import os
import queue
import secrets
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence, TextIO

import grpc
from google.protobuf import field_mask_pb2

from bootseer.images import registry as images
from bootseer.images.chains import LABEL_LAYERS_ABOVE, MAX_LABEL_BYTES, chain_ids, label_list, layers_above_label
from bootseer.images.registry import Descriptor, ImageSource, ResolvedImage
from bootseer.log import get_logger
from bootseer.profile import hooks as profile_hooks, traced
from bootseer.proto.containerd.services.content.v1 import content_pb2, content_pb2_grpc
from bootseer.proto.containerd.services.diff.v1 import diff_pb2, diff_pb2_grpc
from bootseer.proto.containerd.services.images.v1 import images_pb2, images_pb2_grpc
from bootseer.proto.containerd.services.leases.v1 import leases_pb2, leases_pb2_grpc
from bootseer.proto.containerd.services.snapshots.v1 import snapshots_pb2, snapshots_pb2_grpc
from bootseer.proto.containerd.types import descriptor_pb2, mount_pb2

log = get_logger(__name__)

DEFAULT_ADDRESS = "/run/containerd/containerd.sock"
DEFAULT_NAMESPACE = "default"
DEFAULT_SNAPSHOTTER = "bootseer"

# Labels, as containerd's own pull sets them (images/mediatypes.go, unpacker.go, pkg/snapshotters).
LABEL_SNAPSHOT_REF = "containerd.io/snapshot.ref"
LABEL_UNCOMPRESSED = "containerd.io/uncompressed"
LABEL_GC_EXPIRE = "containerd.io/gc.expire"
LABEL_GC_CONTENT = "containerd.io/gc.ref.content"
LABEL_GC_SNAPSHOT = "containerd.io/gc.ref.snapshot"
LABEL_DISTRIBUTION_SOURCE = "containerd.io/distribution.source"
INHERITED_LABEL_PREFIX = "containerd.io/snapshot/"
LABEL_CRI_IMAGE_REF = "containerd.io/snapshot/cri.image-ref"
LABEL_CRI_MANIFEST_DIGEST = "containerd.io/snapshot/cri.manifest-digest"
LABEL_CRI_LAYER_DIGEST = "containerd.io/snapshot/cri.layer-digest"
LABEL_CRI_IMAGE_LAYERS = "containerd.io/snapshot/cri.image-layers"

#: gRPC headers containerd reads the namespace and lease from.
NAMESPACE_HEADER = "containerd-namespace"
LEASE_HEADER = "containerd-lease"
#: How long the pull's lease protects its content if rpull dies before releasing it (containerd's default).
LEASE_EXPIRY = datetime.timedelta(hours=24)
#: Bytes per Content.Write message (containerd accepts up to 16 MiB).
WRITE_CHUNK = 1024 * 1024
#: Deadline of the small calls; Write and Apply move whole layers and have none.
CALL_TIMEOUT_S = 60.0
#: Prepare attempts when ALREADY_EXISTS comes back and the chainID is still not there (unpacker.go's 3).
PREPARE_ATTEMPTS = 3


# --------------------------------------------------------------------------- errors


class RpullError(Exception):
    """A pull failed; the message says which step and why."""


class ContainerdError(RpullError):
    """containerd answered an error; ``code`` is its gRPC status (containerd's errdefs kind)."""

    def __init__(self, message: str, code: grpc.StatusCode):
        super().__init__(message)
        self.code = code


class AlreadyExists(ContainerdError):
    pass


class NotFound(ContainerdError):
    pass


def _containerd_error(what: str, error: grpc.RpcError) -> ContainerdError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    detail = error.details() if hasattr(error, "details") else str(error)
    kind = {grpc.StatusCode.ALREADY_EXISTS: AlreadyExists, grpc.StatusCode.NOT_FOUND: NotFound}.get(code, ContainerdError)
    return kind(f"{what}: containerd answered {code.name}: {detail}", code)


# --------------------------------------------------------------------------- containerd client


class Containerd:
    """containerd's content, images, leases, snapshots and diff services over its gRPC socket.

    Every call carries the namespace and, once :meth:`use_lease` was called, the lease.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, namespace: str = DEFAULT_NAMESPACE):
        if not Path(address).exists():
            raise RpullError(f"containerd socket {address} does not exist (is containerd running? --address)")
        self.address = address
        self.namespace = namespace
        self.lease: str | None = None
        # containerd's default limit is 16 MiB; messages here stay at WRITE_CHUNK plus a header.
        self._channel = grpc.insecure_channel(f"unix://{address}", options=[
            ("grpc.max_send_message_length", 16 * 1024 * 1024),
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
        ])
        self._content = content_pb2_grpc.ContentStub(self._channel)
        self._images = images_pb2_grpc.ImagesStub(self._channel)
        self._leases = leases_pb2_grpc.LeasesStub(self._channel)
        self._snapshots = snapshots_pb2_grpc.SnapshotsStub(self._channel)
        self._diff = diff_pb2_grpc.DiffStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Containerd":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _metadata(self) -> list[tuple[str, str]]:
        md = [(NAMESPACE_HEADER, self.namespace)]
        if self.lease:
            md.append((LEASE_HEADER, self.lease))
        return md

    def _call(self, what: str, method: Callable, request, timeout: float | None = CALL_TIMEOUT_S):
        try:
            return method(request, metadata=self._metadata(), timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise ContainerdError(f"{what}: containerd at {self.address} is unavailable: {e.details()}",
                                      e.code()) from None
            raise _containerd_error(what, e) from None

    # -- leases --

    def create_lease(self, expiry: datetime.timedelta = LEASE_EXPIRY) -> str:
        """A new lease with an expiry (in case this process dies); later calls carry it."""
        lease_id = f"bootseer-rpull-{secrets.token_hex(8)}"
        expires = (datetime.datetime.now(datetime.timezone.utc) + expiry).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._call("create lease", self._leases.Create,
                   leases_pb2.CreateRequest(id=lease_id, labels={LABEL_GC_EXPIRE: expires}))
        self.lease = lease_id
        return lease_id

    def delete_lease(self) -> None:
        if self.lease is None:
            return
        lease, self.lease = self.lease, None
        self._call(f"delete lease {lease}", self._leases.Delete, leases_pb2.DeleteRequest(id=lease))

    # -- content --

    def content_info(self, digest: str) -> content_pb2.Info | None:
        try:
            return self._call(f"content info {digest}", self._content.Info,
                              content_pb2.InfoRequest(digest=digest)).info
        except NotFound:
            return None

    def update_content_labels(self, digest: str, labels: Mapping[str, str]) -> None:
        if not labels:
            return
        info = content_pb2.Info(digest=digest, labels=dict(labels))
        mask = field_mask_pb2.FieldMask(paths=[f"labels.{key}" for key in labels])
        self._call(f"label content {digest}", self._content.Update,
                   content_pb2.UpdateRequest(info=info, update_mask=mask))

    def abort_write(self, ref: str) -> None:
        try:
            self._call(f"abort ingest {ref}", self._content.Abort, content_pb2.AbortRequest(ref=ref))
        except NotFound:
            pass

    def write_content(self, ref: str, descriptor: Descriptor, chunks: Iterable[bytes],
                      labels: Mapping[str, str], on_bytes: Callable[[int], None] | None = None) -> int:
        """Write a blob (``chunks``, verified by the caller's stream) under ``ref``; return bytes sent.

        Lock-step over one ``Content.Write`` stream, as containerd's remote writer does: STAT
        (ALREADY_EXISTS: the blob is there, 0 is returned and nothing is read), WRITE per chunk,
        COMMIT with the expected size and digest (containerd checks both) and ``labels``.  An
        ingest left by an earlier, interrupted attempt is resumed at its offset (the skipped
        bytes are still read through the caller's verifying stream).
        """
        what = f"write {descriptor.digest}"
        requests: queue.Queue = queue.Queue()
        done = object()

        def feed() -> Iterator[content_pb2.WriteContentRequest]:
            while (item := requests.get()) is not done:
                yield item

        call = self._content.Write(feed(), metadata=self._metadata())

        def exchange(request: content_pb2.WriteContentRequest) -> content_pb2.WriteContentResponse:
            requests.put(request)
            try:
                return next(call)
            except grpc.RpcError as e:
                raise _containerd_error(what, e) from None
            except StopIteration:
                raise ContainerdError(f"{what}: containerd ended the write stream early", grpc.StatusCode.UNKNOWN) from None

        try:
            try:
                status = exchange(content_pb2.WriteContentRequest(
                    action=content_pb2.STAT, ref=ref, total=descriptor.size, expected=descriptor.digest))
            except AlreadyExists:
                return 0
            offset, skip, sent = status.offset, status.offset, 0
            if offset:
                log.info("resuming an interrupted content write", ref=ref, offset=offset)
            for chunk in chunks:
                if skip:
                    cut = min(skip, len(chunk))
                    chunk, skip = chunk[cut:], skip - cut
                    if not chunk:
                        continue
                response = exchange(content_pb2.WriteContentRequest(
                    action=content_pb2.WRITE, ref=ref, offset=offset, data=chunk))
                offset += len(chunk)
                sent += len(chunk)
                if response.offset != offset:
                    raise ContainerdError(f"{what}: containerd is at offset {response.offset}, expected {offset}",
                                          grpc.StatusCode.DATA_LOSS)
                if on_bytes is not None:
                    on_bytes(len(chunk))
            if skip:
                raise RpullError(f"{what}: the blob is shorter than the {status.offset} bytes already ingested")
            try:
                exchange(content_pb2.WriteContentRequest(
                    action=content_pb2.COMMIT, ref=ref, offset=offset, total=descriptor.size,
                    expected=descriptor.digest, labels=dict(labels)))
            except AlreadyExists:
                pass  # someone else committed the same blob meanwhile
            requests.put(done)
            return sent
        except BaseException:
            call.cancel()
            requests.put(done)
            raise

    # -- images --

    def put_image(self, name: str, target: Descriptor, labels: Mapping[str, str] | None = None) -> None:
        """Create the image record, or point an existing one at ``target``."""
        image = images_pb2.Image(name=name, labels=dict(labels or {}), target=descriptor_to_proto(target))
        try:
            self._call(f"create image {name}", self._images.Create, images_pb2.CreateImageRequest(image=image))
        except AlreadyExists:
            mask = field_mask_pb2.FieldMask(paths=["target"])
            self._call(f"update image {name}", self._images.Update,
                       images_pb2.UpdateImageRequest(image=image, update_mask=mask))

    # -- snapshots --

    def snapshot_exists(self, snapshotter: str, key: str) -> bool:
        try:
            self._call(f"stat snapshot {key}", self._snapshots.Stat,
                       snapshots_pb2.StatSnapshotRequest(snapshotter=snapshotter, key=key))
            return True
        except NotFound:
            return False

    def prepare(self, snapshotter: str, key: str, parent: str, labels: Mapping[str, str]) -> list[mount_pb2.Mount]:
        """Prepare an active snapshot; :class:`AlreadyExists` when the snapshotter has the target already."""
        response = self._call(f"prepare snapshot {key!r}", self._snapshots.Prepare, snapshots_pb2.PrepareSnapshotRequest(
            snapshotter=snapshotter, key=key, parent=parent, labels=dict(labels)))
        return list(response.mounts)

    def commit(self, snapshotter: str, name: str, key: str, labels: Mapping[str, str]) -> None:
        self._call(f"commit snapshot {name}", self._snapshots.Commit, snapshots_pb2.CommitSnapshotRequest(
            snapshotter=snapshotter, name=name, key=key, labels=dict(labels)))

    def remove_snapshot(self, snapshotter: str, key: str) -> None:
        self._call(f"remove snapshot {key!r}", self._snapshots.Remove,
                   snapshots_pb2.RemoveSnapshotRequest(snapshotter=snapshotter, key=key))

    # -- diff --

    def apply(self, layer: Descriptor, mounts: Sequence[mount_pb2.Mount]) -> str:
        """Apply the layer blob (in the content store) onto ``mounts``; return the diffID containerd computed."""
        response = self._call(f"apply layer {layer.digest}", self._diff.Apply,
                              diff_pb2.ApplyRequest(diff=descriptor_to_proto(layer), mounts=list(mounts)),
                              timeout=None)
        return response.applied.digest


def descriptor_to_proto(descriptor: Descriptor) -> descriptor_pb2.Descriptor:
    return descriptor_pb2.Descriptor(media_type=descriptor.media_type, digest=descriptor.digest,
                                     size=descriptor.size, annotations=dict(descriptor.annotations))


# --------------------------------------------------------------------------- labels


def child_gc_labels(children: Sequence[Descriptor]) -> dict[str, str]:
    """The ``containerd.io/gc.ref.content.*`` labels a parent blob carries for its children.

    As ``images.SetChildrenMappedLabels`` with ``ChildGCLabels``: ``config`` for the config,
    ``m.<n>`` for manifests, ``l.<n>`` for layers, ``<n>`` for anything else; ``<n>`` counts
    per prefix.
    """
    labels: dict[str, str] = {}
    counts: dict[str, int] = {}
    for child in children:
        if child.media_type in images.CONFIG_TYPES:
            prefix = f"{LABEL_GC_CONTENT}.config"
        elif child.media_type in images.MANIFEST_TYPES:
            prefix = f"{LABEL_GC_CONTENT}.m."
        elif child.media_type in images.LAYER_COMPRESSION:
            prefix = f"{LABEL_GC_CONTENT}.l."
        else:
            prefix = f"{LABEL_GC_CONTENT}."
        n = counts.get(prefix, 0)
        counts[prefix] = n + 1
        key = f"{prefix}{n}" if n > 0 or prefix.endswith(".") else prefix
        labels[key] = child.digest
    return labels


def _label_fits(key: str, value: str) -> bool:
    return len(key) + len(value) <= MAX_LABEL_BYTES


def layer_digest_list(layers: Sequence[Descriptor], key: str = LABEL_CRI_IMAGE_LAYERS) -> str:
    """Comma-separated digests, as many as fit in one label (pkg/snapshotters getLayers)."""
    return label_list((layer.digest for layer in layers), key)


def snapshot_labels(resolved: ResolvedImage, index: int, chain: Sequence[str]) -> dict[str, str]:
    """The labels of layer ``index``'s Prepare and Commit (``chain``: the image's ChainIDs, bottom first):
    inherited annotations, the target, the CRI hints, and the ChainIDs of the layers above it
    (:data:`~bootseer.images.chains.LABEL_LAYERS_ABOVE`: BootSeer's snapshotter loads them meanwhile)."""
    layer = resolved.layers[index]
    labels = {k: v for k, v in layer.annotations.items() if k.startswith(INHERITED_LABEL_PREFIX)}
    labels[LABEL_SNAPSHOT_REF] = chain[index]
    if above := layers_above_label(chain, index):
        labels[LABEL_LAYERS_ABOVE] = above
    labels[LABEL_CRI_IMAGE_REF] = resolved.reference
    labels[LABEL_CRI_LAYER_DIGEST] = layer.digest
    labels[LABEL_CRI_MANIFEST_DIGEST] = resolved.manifest_descriptor.digest
    labels[LABEL_CRI_IMAGE_LAYERS] = layer_digest_list(resolved.layers[index:])
    return {k: v for k, v in labels.items() if _label_fits(k, v)}


def distribution_source(source: ImageSource) -> tuple[str, str] | None:
    """(label key, repository) for blobs of a registry image; None for a layout."""
    if not isinstance(source, images.RegistrySource):
        return None
    host = source.ref.domain
    host = host[1:].partition("]")[0] if host.startswith("[") else host.rsplit(":", 1)[0] if ":" in host else host
    return f"{LABEL_DISTRIBUTION_SOURCE}.{host}", source.ref.repository


# --------------------------------------------------------------------------- progress


class Progress:
    """Per-layer lines and a byte counter on a terminal; silent otherwise (the summary is printed anyway)."""

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._last = 0.0
        self._line = ""

    def say(self, text: str) -> None:
        if self.enabled:
            self._clear()
            print(text, file=self.stream, flush=True)

    def bytes(self, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        self._clear()
        self._line = f"  {label}: {_human(done)} / {_human(total)}"
        print(self._line, end="\r", file=self.stream, flush=True)

    def _clear(self) -> None:
        if self._line:
            print(" " * len(self._line), end="\r", file=self.stream)
            self._line = ""


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


# --------------------------------------------------------------------------- pull


@dataclasses.dataclass(frozen=True)
class LayerResult:
    digest: str
    chain_id: str
    #: "lazy" (the snapshotter had it: nothing fetched), "downloaded" (fetched and applied),
    #: "unpacked" (already unpacked before this pull).
    state: str
    #: Compressed bytes fetched from the image source for this layer (0 if the content store had the blob).
    fetched_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class PullResult:
    name: str
    target: Descriptor
    manifest_digest: str
    chain_id: str
    snapshotter: str
    layers: tuple[LayerResult, ...]

    def count(self, state: str) -> int:
        return sum(1 for layer in self.layers if layer.state == state)

    @property
    def fetched_bytes(self) -> int:
        return sum(layer.fetched_bytes for layer in self.layers)

    def summary(self) -> str:
        return (f"{self.name}: {len(self.layers)} layers on {self.snapshotter}: {self.count('lazy')} lazy, "
                f"{self.count('downloaded')} downloaded ({_human(self.fetched_bytes)}), "
                f"{self.count('unpacked')} already unpacked")


def _chunks(stream, size: int = WRITE_CHUNK) -> Iterator[bytes]:
    while chunk := stream.read(size):
        yield chunk


def _blob_ref(kind: str, digest: str) -> str:
    """The ingest ref of a blob (one per digest: two pulls of one blob take turns, as containerd's)."""
    return f"bootseer-rpull-{kind}-{digest}"


class _Puller:
    """One pull: the image source, containerd, the progress display and the labels they share."""

    def __init__(self, source: ImageSource, client: Containerd, snapshotter: str, progress: Progress):
        self.source = source
        self.client = client
        self.snapshotter = snapshotter
        self.progress = progress
        self.source_label = distribution_source(source)

    def _source_labels(self, digest: str, existing: content_pb2.Info | None) -> dict[str, str]:
        """The distribution source label, merged with what the blob has (sorted, unique: containerd's form)."""
        if self.source_label is None:
            return {}
        key, repo = self.source_label
        repos = set(filter(None, (existing.labels.get(key, "") if existing else "").split(",")))
        value = ",".join(sorted(repos | {repo}))
        return {key: value} if _label_fits(key, value) else {}

    def put_small(self, kind: str, descriptor: Descriptor, data: bytes, labels: Mapping[str, str]) -> None:
        """Index, manifest or config (bytes already verified) into the content store, labelled."""
        existing = self.client.content_info(descriptor.digest)
        labels = {**labels, **self._source_labels(descriptor.digest, existing)}
        if existing is not None:
            self.client.update_content_labels(descriptor.digest, labels)
            return
        self.client.write_content(_blob_ref(kind, descriptor.digest), descriptor, [data], labels)

    def fetch_layer(self, layer: Descriptor, index: int, total: int) -> int:
        """The layer blob into the content store (verified on the way); return the bytes fetched."""
        existing = self.client.content_info(layer.digest)
        labels = self._source_labels(layer.digest, existing)
        if existing is not None:
            self.client.update_content_labels(layer.digest, labels)
            return 0
        done = 0

        def moved(n: int) -> None:
            nonlocal done
            done += n
            self.progress.bytes(f"layer {index + 1}/{total} {layer.digest[:19]}", done, layer.size)

        ref = _blob_ref("layer", layer.digest)
        try:
            with self.source.open_blob(layer) as blob:
                return self.client.write_content(ref, layer, _chunks(blob), labels, on_bytes=moved)
        except (images.ImageError, RpullError):
            # A blob that failed verification or transfer must not be resumed from: drop the ingest.
            self.client.abort_write(ref)
            raise

    @traced("image.layer", phase="image", attrs=profile_hooks.layer_attrs)  # start-up profiler: one span per layer
    def unpack_layer(self, resolved: ResolvedImage, index: int, chain: Sequence[str]) -> LayerResult:
        """Layer ``index`` as containerd's unpacker does it (see the module docstring, step 3)."""
        layer, chain_id = resolved.layers[index], chain[index]
        parent = chain[index - 1] if index else ""
        total = len(resolved.layers)
        if self.client.snapshot_exists(self.snapshotter, chain_id):
            return LayerResult(layer.digest, chain_id, "unpacked")
        labels = snapshot_labels(resolved, index, chain)
        mounts = None
        for attempt in range(PREPARE_ATTEMPTS):
            key = f"extract-{time.time_ns() % 1_000_000_000}-{base64.urlsafe_b64encode(os.urandom(3)).decode()} {chain_id}"
            try:
                mounts = self.client.prepare(self.snapshotter, key, parent, labels)
                break
            except AlreadyExists:
                if self.client.snapshot_exists(self.snapshotter, chain_id):
                    log.debug("layer is a remote snapshot", chain_id=chain_id, layer=layer.digest)
                    return LayerResult(layer.digest, chain_id, "lazy")
                log.debug("extraction snapshot exists but the chainID does not; retrying", key=key)
        if mounts is None:
            raise RpullError(f"layer {layer.digest}: Prepare kept answering ALREADY_EXISTS without {chain_id} appearing")
        try:
            fetched = self.fetch_layer(layer, index, total)
            applied = self.client.apply(layer, mounts)
            if applied != resolved.diff_ids[index]:
                raise RpullError(f"layer {layer.digest}: unpacked to diffID {applied}, the config says "
                                 f"{resolved.diff_ids[index]}")
            try:
                self.client.commit(self.snapshotter, chain_id, key, labels)
            except AlreadyExists:
                # Another pull committed the same layer meanwhile: theirs stands, ours goes.
                self.client.remove_snapshot(self.snapshotter, key)
        except BaseException:
            try:
                self.client.remove_snapshot(self.snapshotter, key)
            except ContainerdError as e:
                log.warning("could not remove the extraction snapshot", key=key, error=str(e))
            raise
        # Only after Apply verified the uncompressed digest (as unpacker.go).
        self.client.update_content_labels(layer.digest, {LABEL_UNCOMPRESSED: applied})
        return LayerResult(layer.digest, chain_id, "downloaded", fetched)

    def pull(self) -> PullResult:
        resolved = self.source.resolve()
        manifest = resolved.manifest_descriptor
        self.progress.say(f"{resolved.reference}: manifest {manifest.digest}, {len(resolved.layers)} layers")
        chain = chain_ids(resolved.diff_ids)

        # Children first, then the blobs that name them: a reader that finds a parent finds its children.
        self.put_small("config", resolved.manifest.config, resolved.config_bytes, {})
        self.put_small("manifest", manifest, resolved.manifest_bytes,
                       child_gc_labels([resolved.manifest.config, *resolved.layers]))
        if resolved.index is not None and resolved.index_bytes is not None:
            children = images.parse_index(resolved.index_bytes, resolved.index.media_type, "index")
            self.put_small("index", resolved.index, resolved.index_bytes, child_gc_labels(children))

        results = []
        for i in range(len(resolved.layers)):
            result = self.unpack_layer(resolved, i, chain)
            results.append(result)
            detail = f" ({_human(result.fetched_bytes)})" if result.state == "downloaded" else ""
            self.progress.say(f"layer {i + 1}/{len(chain)} {result.digest[:19]}  {result.state}{detail}")

        top = chain[-1] if chain else ""
        if top:
            self.client.update_content_labels(resolved.manifest.config.digest,
                                              {f"{LABEL_GC_SNAPSHOT}.{self.snapshotter}": top})
        self.client.put_image(resolved.reference, resolved.target)
        return PullResult(resolved.reference, resolved.target, manifest.digest, top, self.snapshotter, tuple(results))


@traced("image.pull", phase="image", attrs=profile_hooks.pull_attrs)  # start-up profiler: the pull as a span
def rpull(ref: str, *, address: str = DEFAULT_ADDRESS, namespace: str = DEFAULT_NAMESPACE,
          snapshotter: str = DEFAULT_SNAPSHOTTER, plain_http: bool = False, platform: str | None = None,
          progress: Progress | None = None) -> PullResult:
    """Pull ``ref`` into containerd and unpack it on ``snapshotter``, remote snapshots first.

    Raises :class:`bootseer.images.registry.ImageError` for image problems and :class:`RpullError`
    (:class:`ContainerdError`) for containerd's; whatever was written under the pull's lease
    is released for garbage collection when the pull fails.
    """
    progress = progress or Progress(enabled=False)
    with images.open_image(ref, plain_http=plain_http, platform=platform) as source, \
            Containerd(address, namespace) as client:
        client.create_lease()
        try:
            result = _Puller(source, client, snapshotter, progress).pull()
        finally:
            try:
                client.delete_lease()
            except ContainerdError as e:
                log.warning("could not delete the pull's lease; it expires by itself", error=str(e))
    log.info("image pulled", image=result.name, snapshotter=snapshotter, lazy=result.count("lazy"),
             downloaded=result.count("downloaded"), unpacked=result.count("unpacked"),
             fetched_bytes=result.fetched_bytes)
    return result
