"""The hot-list object: an image's first-touch block trace, as it lies in a block store.

A hot list is keyed by the image's top ChainID and an optional profile name, and
lists every block the image's first recorded boot read, in the order it first read
them, each with where its compressed bytes lie (the layer's ChainID, the block's
SHA-256, its pack, offset and lengths) and when it was first read (seconds after the
container's writable snapshot was prepared).  It says when and where (node,
container) it was recorded and why recording ended.

On disk it is a sealed object, as a layer index is
(:func:`bootseer.blockstore.objects.format.encode_sealed`/``decode_sealed``): a header (magic
``BSHOTL01``, format version, payload length, payload SHA-256) and a zstd-compressed
JSON payload.  :meth:`HotList.decode` never trusts the store: a
truncated, tampered, oversized or malformed object, or one stored under another
image's or profile's name, raises :class:`HotListError`.  Whether its blocks match
the image's layer indexes is checked against those indexes (:func:`resolve`), since
only the layer server holds them.

Store paths (:func:`hotlist_object`): ``v1/hotlists/<top chain hex>/default`` for the
default profile and ``v1/hotlists/<top chain hex>/profile.<NAME>`` for profile NAME.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from bootseer.blockstore.objects.format import FORMAT_VERSION as STORE_FORMAT_VERSION
from bootseer.blockstore.objects.block_table import LayerBlocks
from bootseer.blockstore.objects.format import FormatError, check_digest, encode_sealed, open_sealed, sealed_size_bound
from bootseer.blockstore.objects.jsonstream import ArrayRule, read_document
from bootseer.blockstore.objects.signing import Signed, SigningKey, sign_document, signatures_of

if TYPE_CHECKING:
    from bootseer.blockstore.objects.store import StoreReader

HOTLIST_VERSION = 1
HOTLIST_MAGIC = b"BSHOTL01"
#: The most rows any hot list may have, whatever image it is for (a reader that knows the
#: image bounds it by the image's blocks: :meth:`HotList.decode`'s ``max_blocks``).
MAX_BLOCKS = 1 << 21
#: The most layers an image may have (overlayfs takes about 500 lower directories).
MAX_LAYERS = 1024
#: What one row may take in the payload: ``[layer, "<64 hex>", pack, offset, clen, rlen, at]``
#: with every number at its widest, the comma, and its pack's name (at most one new pack a row).
HOTLIST_ROW_BYTES = 256
#: The payload beside the rows: the layers' ChainIDs and the recording's strings.
HOTLIST_FIXED_BYTES = 64 << 10
#: The longest single value (a row, a layer, node or container name) a hot list holds.
MAX_VALUE_BYTES = 16 << 10
#: An encoded hot list larger than this is refused before it is read.
MAX_OBJECT_BYTES = 64 << 20

#: The snapshot label that names a profile:
#: ``ctr run --snapshotter-label containerd.io/snapshot/bootseer.profile=NAME``.  containerd
#: passes a proxy snapshotter only labels under ``containerd.io/snapshot/`` (and
#: ``containerd.io/snapshot.ref``): ``FilterInheritedLabels`` in its metadata store.
PROFILE_LABEL = "containerd.io/snapshot/bootseer.profile"
#: The short form, honoured where labels reach the snapshotter unfiltered (a direct gRPC Prepare).
PROFILE_LABEL_SHORT = "bootseer.io/profile"


def max_object_bytes(max_blocks: int | None = None) -> int:
    """The most bytes a stored hot list of at most ``max_blocks`` rows can take (None: the
    format's :data:`MAX_BLOCKS`), never more than :data:`MAX_OBJECT_BYTES`: a reader refuses
    a larger object from its size, before reading it."""
    rows = MAX_BLOCKS if max_blocks is None else max(0, min(max_blocks, MAX_BLOCKS))
    return min(MAX_OBJECT_BYTES, sealed_size_bound(HOTLIST_FIXED_BYTES + rows * HOTLIST_ROW_BYTES))


async def read_hot_list_object(store: StoreReader, image: str, profile: str, max_blocks: int | None) -> bytes | None:
    """The stored bytes of ``image``'s hot list for ``profile`` from ``store`` (a
    :class:`~bootseer.blockstore.objects.store.StoreReader`), None if there is none.

    An object larger than ``max_blocks`` rows can take (:func:`max_object_bytes`) is
    refused from its size, unread, with a HotListError naming the bound; the store's
    own failures pass through.
    """
    try:
        return await store.read_object(hotlist_object(image, profile), max_object_bytes(max_blocks))
    except HotListError:
        raise
    except FormatError as exc:  # too large, or a directory: the object's fault, not the store's
        bound = "the format's limit" if max_blocks is None else f"{max_blocks} rows at most: the blocks of the image's layers"
        raise HotListError(f"{exc} ({bound})") from None


def profile_of_labels(labels: Mapping[str, str]) -> str:
    """The profile a snapshot's labels name ("" for none); HotListError for an invalid name."""
    return check_profile(str(labels.get(PROFILE_LABEL, labels.get(PROFILE_LABEL_SHORT, ""))))
_PROFILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_HEX = re.compile(r"[0-9a-f]{64}")

#: Where every hot list lives, one directory per image.
HOTLIST_PREFIX = f"v{STORE_FORMAT_VERSION}/hotlists"


class HotListError(FormatError):
    """A hot list is malformed, truncated, tampered with, foreign, or does not match the image."""


class HotListUntrusted(HotListError):
    """A hot list not signed by a writer key the node trusts (docs/trust.md): ignored, never prefetched."""


def check_profile(profile: str) -> str:
    """``profile`` if it is a valid profile name ("" is the default profile), else HotListError."""
    if profile != "" and not (isinstance(profile, str) and _PROFILE.fullmatch(profile)):
        raise HotListError(
            f"profile name {profile!r} is not valid: 1-63 of A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    return profile


def hotlist_object(image: str, profile: str = "") -> str:
    """Store path of the hot list of image ``image`` (its top ChainID) for ``profile``."""
    top = check_digest(image, "image top ChainID")[len("sha256:") :]
    check_profile(profile)
    return f"{HOTLIST_PREFIX}/{top}/{'profile.' + profile if profile else 'default'}"


def hotlist_dir(image: str) -> str:
    """Store directory holding every profile's hot list of ``image``."""
    return f"{HOTLIST_PREFIX}/{check_digest(image, 'image top ChainID')[len('sha256:'):]}"


def profile_of_object(name: str) -> str | None:
    """The profile a hot-list object name stands for ("" default), None if it is not one."""
    base = name.rsplit("/", 1)[-1]
    if base == "default":
        return ""
    if base.startswith("profile.") and _PROFILE.fullmatch(base[len("profile.") :]):
        return base[len("profile.") :]
    return None


@dataclass(frozen=True)
class HotBlock:
    """One block's first touch: which layer, which block, where it lies, when it was first read."""

    layer: str  #: ChainID of the layer whose file was read
    digest: str  #: SHA-256 hex of the raw block
    pack: str  #: SHA-256 hex of the pack holding it
    offset: int  #: of the compressed block in the pack
    clen: int  #: compressed length
    rlen: int  #: raw length
    at: float  #: seconds after the container's writable snapshot was prepared


#: The keys :meth:`HotList._document` writes (and ``signatures``, beside them).
_DOCUMENT_KEYS = frozenset({
    "format", "image", "profile", "layers", "packs", "blocks", "recorded_at", "node", "container",
    "sealed_by", "duration", "unattributed", "recorder", "signatures",
})


@dataclass
class HotList:
    """An image's first-touch trace (see the module docstring)."""

    image: str  #: the image's top ChainID
    profile: str  #: "" for the default profile
    layers: list[str]  #: the image's ChainIDs, bottom first (the top one last)
    blocks: list[HotBlock]
    recorded_at: str = ""  #: ISO 8601 time recording began (UTC)
    node: str = ""  #: host name of the node that recorded it
    container: str = ""  #: the container (snapshot key) whose reads were recorded
    sealed_by: str = ""  #: what ended recording: seal, marker, quiet, window, removed
    duration: float = 0.0  #: seconds recording ran
    unattributed: int = 0  #: reads whose opener could not be identified, left out (several recordings were possible)
    recorder: str = ""  #: ``bootseer <version>``
    #: the writing node's signatures (docs/trust.md); what a trust policy checks is ``signed``
    signatures: list[dict[str, str]] = field(default_factory=list, compare=False)
    signed: Signed | None = field(default=None, compare=False, repr=False)

    @property
    def total_bytes(self) -> int:
        """Compressed bytes of all the blocks (what a prefetch moves)."""
        return sum(block.clen for block in self.blocks)

    @property
    def raw_bytes(self) -> int:
        return sum(block.rlen for block in self.blocks)

    @property
    def span(self) -> float:
        """Seconds from the first block's first read to the last's."""
        return self.blocks[-1].at - self.blocks[0].at if self.blocks else 0.0

    def per_layer(self) -> dict[str, tuple[int, int]]:
        """ChainID -> (blocks, compressed bytes), in the image's layer order."""
        out = {layer: (0, 0) for layer in self.layers}
        for block in self.blocks:
            count, size = out[block.layer]
            out[block.layer] = (count + 1, size + block.clen)
        return out

    # -- encoding ---------------------------------------------------------------------

    def encode(self, sign_key: SigningKey | None = None) -> bytes:
        """The sealed object; with ``sign_key``, signed by it (the list names its image and profile, so the
        signature binds it to its store name)."""
        self.validate()
        document = self._document()
        if self.signatures:
            document["signatures"] = self.signatures
        if sign_key is not None:
            document = sign_document(document, "hotlist", sign_key)
        payload = json.dumps(document, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        return encode_sealed(HOTLIST_MAGIC, HOTLIST_VERSION, payload)

    def _document(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The JSON document of this list, without signatures: what :meth:`encode` writes and a signature signs.

        Rows name their layer and pack by number (each pack numbered at its first use);
        times are in microseconds. ``extra``: keys of a decoded document this version does
        not know, kept so its signature still checks.
        """
        layer_numbers = {layer: number for number, layer in enumerate(self.layers)}
        packs: dict[str, int] = {}
        rows = []
        for block in self.blocks:
            pack = packs.setdefault(block.pack, len(packs))
            # Times in microseconds: compact integers, enough for ordering and spans.
            rows.append([layer_numbers[block.layer], block.digest, pack, block.offset, block.clen, block.rlen,
                         round(block.at * 1e6)])  # fmt: skip
        return {
            **(extra or {}),
            "format": HOTLIST_VERSION,
            "image": self.image,
            "profile": self.profile,
            "layers": self.layers,
            "packs": list(packs),
            "blocks": rows,
            "recorded_at": self.recorded_at,
            "node": self.node,
            "container": self.container,
            "sealed_by": self.sealed_by,
            "duration": round(self.duration, 6),
            "unattributed": self.unattributed,
            "recorder": self.recorder,
        }

    @classmethod
    def decode(
        cls,
        data: bytes,
        *,
        expected_image: str | None = None,
        expected_profile: str | None = None,
        max_blocks: int | None = None,
    ) -> HotList:
        """Parse and check an encoded hot list; HotListError for anything wrong.

        ``expected_image``/``expected_profile`` (what the object's store path names)
        must be what the list says it is: a list copied under another image's name
        is foreign and refused.  ``max_blocks`` is the most rows the list may have:
        the blocks of the image's layers (a first boot cannot touch more); None:
        :data:`MAX_BLOCKS`.  The payload may be at most :data:`HOTLIST_ROW_BYTES` a
        row plus :data:`HOTLIST_FIXED_BYTES`, the stored object what that payload can
        take (:func:`max_object_bytes`); the bounds are enforced before and while the
        list is decompressed and parsed, row by row, so a bomb is refused in bounded memory.
        CPU work proportional to the list: the layer server runs it in a worker thread.
        """
        rows = MAX_BLOCKS if max_blocks is None else max(0, min(max_blocks, MAX_BLOCKS))
        because = "the format's limit" if max_blocks is None else "the blocks of the image's layers"
        payload_limit = HOTLIST_FIXED_BYTES + rows * HOTLIST_ROW_BYTES
        if len(data) > max_object_bytes(max_blocks):
            raise HotListError(f"hot list is {len(data)} bytes, more than {max_object_bytes(max_blocks)} ({rows} rows at most: {because})")
        pieces = open_sealed(data, HOTLIST_MAGIC, HOTLIST_VERSION, payload_limit, "hot list", HotListError,
                             because=f"{rows} rows at most: {because}")  # fmt: skip
        layers: list[str] = []
        packs: list[str] = []

        def layer_of(value: Any) -> str:
            layers.append(check_digest(value, "hot list layer"))
            return layers[-1]

        def pack_of(value: Any) -> str:
            packs.append(str(value))
            return packs[-1]

        def block_of(row: Any) -> HotBlock:
            # Rows name their layer and pack by number: both arrays come first, as encode writes them.
            layer, digest, pack, offset, clen, rlen, at = row
            if not (isinstance(layer, int) and 0 <= layer < len(layers) and isinstance(pack, int) and 0 <= pack < len(packs)):
                raise HotListError(f"hot list block {str(digest)[:64]!r}: layer or pack number out of range (layers and packs come first)")
            return HotBlock(layers[layer], str(digest), packs[pack], int(offset), int(clen), int(rlen), int(at) / 1e6)

        rules = {
            "layers": ArrayRule(MAX_LAYERS, layer_of, "the format's limit"),
            "packs": ArrayRule(rows, pack_of, because),
            "blocks": ArrayRule(rows, block_of, because),
        }
        try:
            document = read_document(pieces, "hot list", rules, max_value_chars=MAX_VALUE_BYTES, error_type=HotListError)
            if document.get("format") != HOTLIST_VERSION:
                raise HotListError(f"hot list document format is not {HOTLIST_VERSION}")
            if not all(isinstance(document[key], list) for key in rules):
                raise HotListError("hot list: layers, packs and blocks must be arrays")
            blocks = document["blocks"]
            hot = cls(
                image=check_digest(document["image"], "hot list image"),
                profile=str(document["profile"]),
                layers=layers,
                blocks=blocks,
                recorded_at=str(document.get("recorded_at", "")),
                node=str(document.get("node", "")),
                container=str(document.get("container", "")),
                sealed_by=str(document.get("sealed_by", "")),
                duration=float(document.get("duration", 0.0)),
                unattributed=int(document.get("unattributed", 0)),
                recorder=str(document.get("recorder", "")),
                signatures=signatures_of(document),
            )
        except HotListError:
            raise
        except FormatError as exc:
            raise HotListError(str(exc)) from None
        except (ValueError, KeyError, TypeError) as exc:
            raise HotListError(f"hot list is malformed: {exc!r}") from None
        hot.validate()
        if hot.signatures:
            # The rows were turned into blocks as they were parsed: what was signed is the document
            # they encode again to (a genuine writer's list does so exactly; anything else fails the check).
            extra = {key: value for key, value in document.items() if key not in _DOCUMENT_KEYS}
            hot.signed = Signed.of("hotlist", {**hot._document(extra), "signatures": hot.signatures})
        if expected_image is not None and hot.image != expected_image:
            raise HotListError(f"hot list of image {hot.image} stored under image {expected_image}: foreign, ignored")
        if expected_profile is not None and hot.profile != expected_profile:
            raise HotListError(f"hot list of profile {hot.profile!r} stored under profile {expected_profile!r}")
        return hot

    def validate(self) -> None:
        """HotListError unless the list is consistent in itself."""
        check_digest(self.image, "hot list image")
        check_profile(self.profile)
        if not self.layers or self.layers[-1] != self.image:
            raise HotListError("a hot list's layers end with its image's top ChainID")
        if len(set(self.layers)) != len(self.layers):
            raise HotListError("a hot list names a layer twice")
        known = set(self.layers)
        seen: set[tuple[str, str]] = set()
        last = 0.0
        for number, block in enumerate(self.blocks):
            what = f"hot list block {number}"
            if block.layer not in known:
                raise HotListError(f"{what}: layer {block.layer} is not a layer of the image")
            if not _HEX.fullmatch(block.digest) or not _HEX.fullmatch(block.pack):
                raise HotListError(f"{what}: digest or pack is not 64 hex digits")
            if block.offset < 0 or block.clen <= 0 or block.rlen <= 0:
                raise HotListError(f"{what}: bad offset or length")
            if block.at < last - 1e-6 or block.at < 0:
                raise HotListError(f"{what}: first touches are not in time order")
            last = block.at
            if (block.layer, block.digest) in seen:
                raise HotListError(f"{what}: block {block.digest} of {block.layer} is listed twice")
            seen.add((block.layer, block.digest))


@dataclass(frozen=True)
class ResolvedBlock:
    """A hot block matched to its layer's index: what the prefetcher fetches."""

    layer: str  #: ChainID
    ref: int  #: index into that layer's ``LayerIndex.blocks``
    hot: HotBlock


def resolve(hot: HotList, image_layers: Sequence[str], indexes: Mapping[str, LayerBlocks]) -> list[ResolvedBlock]:
    """Each hot block as a reference into its layer's index, in recorded order.

    ``image_layers`` is the image's chain, bottom first (from the chain records of the
    layers actually served), ``indexes`` their indexes.  HotListError if the list is
    for another chain of layers, or names a block its layer's index does not hold at
    that place (the list does not match the image: ignore it).
    """
    if list(hot.layers) != list(image_layers):
        raise HotListError(
            f"hot list for layers {[layer[:19] for layer in hot.layers]} does not match the image's "
            f"{[layer[:19] for layer in image_layers]}"
        )
    places: dict[str, dict[tuple[str, str, int, int, int], int]] = {}
    for layer in hot.layers:
        index = indexes[layer]
        table: dict[tuple[str, str, int, int, int], int] = {}
        for ref, block in enumerate(index.blocks):
            if not block.is_zero:
                table.setdefault((block.digest, index.packs[block.pack], block.offset, block.clen, block.rlen), ref)
        places[layer] = table
    out = []
    for number, block in enumerate(hot.blocks):
        ref = places[block.layer].get((block.digest, block.pack, block.offset, block.clen, block.rlen))
        if ref is None:
            raise HotListError(
                f"hot list block {number} ({block.digest[:12]} in pack {block.pack[:12]} at {block.offset}) "
                f"is not a block of layer {block.layer}'s index"
            )
        out.append(ResolvedBlock(block.layer, ref, block))
    return out


def summary(hot: HotList) -> dict[str, Any]:
    """What ``bootseer hotlist show`` prints, as data."""
    return {
        "image": hot.image,
        "profile": hot.profile or "(default)",
        "blocks": len(hot.blocks),
        "bytes": hot.total_bytes,
        "raw_bytes": hot.raw_bytes,
        "span_s": round(hot.span, 3),
        "first_s": round(hot.blocks[0].at, 3) if hot.blocks else None,
        "last_s": round(hot.blocks[-1].at, 3) if hot.blocks else None,
        "recorded_at": hot.recorded_at,
        "node": hot.node,
        "container": hot.container,
        "sealed_by": hot.sealed_by,
        "duration_s": round(hot.duration, 3),
        "unattributed": hot.unattributed,
        "recorder": hot.recorder,
        "layers": [{"chain_id": layer, "blocks": n, "bytes": b} for layer, (n, b) in hot.per_layer().items()],
    }
