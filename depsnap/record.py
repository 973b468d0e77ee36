"""The deps record (``v1/deps/<key>.json``): what makes a dependency snapshot visible in a store.

A record names the layer (a ChainID whose chain record, index and packs are in the
same store, written by :mod:`blockstore.convert.converter`) holding what an install created,
changed or deleted, under the key of everything that decided it
(:mod:`depsnap.key`).  It is written last, after the layer is published and
verified, and first writer wins (:meth:`bootseer.blockstore.objects.store.StoreWriter.put_if_absent`):
a capture that fails or is killed never leaves one, and two captures of one key
leave one whole record.  Only ``bootseer deps rm|prune`` remove records; the layers
they named stay for the store's garbage collector (FORMAT.md).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from bootseer.blockstore.objects.format import FORMAT_VERSION, FormatError, check_digest

from bootseer.images.chains import chain_id
from bootseer.blockstore.objects.signing import Signed, SigningKey, sign_document, signatures_of

#: Where deps records live.
DEPS_PREFIX = f"v{FORMAT_VERSION}/deps"
#: A record is a few KiB (the inputs); anything this large is not one.
MAX_RECORD_BYTES = 1 << 20
MODES = ("prefix", "container")


def deps_object(key: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", key):
        raise FormatError(f"deps key is not 64 hex digits: {key!r}")
    return f"{DEPS_PREFIX}/{key}.json"


def key_of_object(name: str) -> str | None:
    """The key a record's object name stands for; None for any other name."""
    match = re.fullmatch(rf"{DEPS_PREFIX}/([0-9a-f]{{64}})\.json", name)
    return match.group(1) if match else None


@dataclass
class DepsRecord:
    key: str  #: 64 hex digits: the object's name
    mode: str  #: ``prefix`` (bare metal: the layer's root is the prefix) or ``container`` (the root is ``/``)
    chain_id: str  #: the layer: ``chain_id(parent, diff_id)``
    parent: str  #: ``""`` (prefix) or the ChainID of the image layers the install ran on (container)
    diff_id: str
    index: str  #: SHA-256 hex of the layer's index
    files: int  #: entries in the layer (whiteouts included)
    bytes: int  #: raw bytes of its regular files
    prefix: str = ""  #: the absolute prefix (mode prefix): shebangs and .pth files name it
    command: list[str] = field(default_factory=list)
    inputs: dict[str, str] = field(default_factory=dict)  #: what the key was computed from, as printed
    captured_at: str = ""
    node: str = ""
    capturer: str = ""
    format: int = FORMAT_VERSION
    #: the capturing node's signatures (docs/trust.md); what a trust policy checks is ``signed``
    signatures: list[dict[str, str]] = field(default_factory=list, compare=False)
    signed: Signed | None = field(default=None, compare=False, repr=False)

    def _document(self) -> dict[str, Any]:
        document = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "signed"}
        if not self.signatures:
            del document["signatures"]
        return json.loads(json.dumps(document))  # plain JSON types, as a reader sees them

    def encode(self) -> bytes:
        return json.dumps(self._document(), sort_keys=True, indent=1).encode() + b"\n"

    def sign(self, key: SigningKey) -> DepsRecord:
        """This record with ``key``'s signature (it names its key, so it cannot stand under another)."""
        signatures = sign_document(self._document(), "deps", key)["signatures"]
        return dataclasses.replace(self, signatures=signatures, signed=None)

    def signature_check(self) -> Signed:
        return self.signed if self.signed is not None else Signed.of("deps", self._document())

    @classmethod
    def decode(cls, data: bytes, *, expected_key: str | None = None) -> DepsRecord:
        """Parse and check a record; FormatError for anything malformed or stored under another key."""
        try:
            doc: Any = json.loads(data)
        except ValueError as exc:
            raise FormatError(f"deps record is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise FormatError("deps record is not a JSON object")
        if doc.get("format") != FORMAT_VERSION:
            raise FormatError(f"deps record of format {doc.get('format')!r}, not {FORMAT_VERSION}")
        known = {f for f in cls.__dataclass_fields__} - {"signatures", "signed"}
        try:
            record = cls(**{k: v for k, v in doc.items() if k in known}, signatures=signatures_of(doc),
                         signed=Signed.of("deps", doc))  # fmt: skip
        except TypeError as exc:
            raise FormatError(f"deps record lacks a field: {exc}") from None
        deps_object(record.key)
        if expected_key is not None and record.key != expected_key:
            raise FormatError(f"deps record of key {record.key} is stored under {expected_key}")
        if record.mode not in MODES:
            raise FormatError(f"deps record mode {record.mode!r} is not one of {MODES}")
        check_digest(record.chain_id, "chain_id")
        check_digest(record.diff_id, "diff_id")
        if record.parent:
            check_digest(record.parent, "parent")
        if (record.mode == "prefix") == bool(record.parent):
            raise FormatError("a prefix record has no parent layer and a container record has one")
        if record.chain_id != chain_id(record.parent, record.diff_id):
            raise FormatError(f"deps record chain_id {record.chain_id} is not that of its parent and diff_id")
        if not re.fullmatch(r"[0-9a-f]{64}", str(record.index)):
            raise FormatError(f"deps record index is not 64 hex digits: {record.index!r}")
        if not isinstance(record.files, int) or not isinstance(record.bytes, int) or record.files < 1 or record.bytes < 0:
            raise FormatError("deps record files/bytes are not counts")
        if not isinstance(record.inputs, dict) or not isinstance(record.command, list):
            raise FormatError("deps record inputs/command are malformed")
        return record
