"""Ed25519 signatures on store objects, and the trust policy a node serves under (docs/trust.md).

A store is shared and writable by many; a node cannot check a layer index against
the layer's ``diff_id`` without the whole tar.  So a converter signs the chain
records it writes (a record names its index by SHA-256, the index its packs and
blocks, so one signature covers the whole layer), and a node signs the hot lists and
dependency records it publishes.  A node configured with trusted keys
(:class:`TrustPolicy`) serves only what one of them signed.

Keys (``bootseer keys generate``): the private key is PEM PKCS#8, written 0600; the
public key is one line, ``bootseer-ed25519 <base64 of the 32 raw bytes> <name>``.  A
key's id is the first 16 bytes of the SHA-256 of the raw public key, in hex.  A key file
is read only if no one but root or the running user can change it (its mode and owner, the
directories and symlinks on its path, :func:`_check_key_path`), a private key only if no one
else can read it, and never a FIFO or device (opened non-blocking, checked after the open).

A signature lives inside the object it signs (``"signatures": [{"key": ID, "sig":
BASE64}]`` in the object's JSON document), so object and signature are written
atomically as one; readers that do not know the key ignore it.  What is signed is
:func:`signed_message`: a context string, the object's *kind* (``chain``,
``hotlist``, ``deps``: a signature of one kind is never accepted as another) and the
SHA-256 of the document's canonical JSON without ``signatures``.  The document names
what it is stored under (the ChainID, the hot list's image and profile, the deps
key) and every reader checks that name, so a signed object cannot be replayed under
another name.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

# ``cryptography`` is imported where a key is used, not here: every reader of the store format
# imports this module, ``bootseer rpull`` in a job's start-up path among them (its import costs tens of ms).

PUBLIC_KEY_TAG = "bootseer-ed25519"
SIGNATURES_FIELD = "signatures"
#: Kinds of signed object; the kind is part of what is signed.
KINDS = ("chain", "hotlist", "deps")
#: More signatures than this on one object are not looked at (an object is signed by its writer, maybe re-signed).
MAX_SIGNATURES = 8
_CONTEXT = b"bootseer-signature-v1\0"
_KEY_FILE_LIMIT = 16 << 10
_NAME = re.compile(r"[A-Za-z0-9._@:+-]{1,64}")


class KeyFileError(ValueError):
    """A key file is missing, unreadable or not a BootSeer Ed25519 key; the message names the file."""


class Untrusted(Exception):
    """An object carries no valid signature of a key the policy trusts."""


def key_id(raw_public: bytes) -> str:
    """The id of a public key: the first 16 bytes of the SHA-256 of its 32 raw bytes, hex."""
    return hashlib.sha256(raw_public).hexdigest()[:32]


@dataclass(frozen=True)
class PublicKey:
    raw: bytes  #: the 32 raw bytes
    name: str = ""  #: a label for logs (the third word of the .pub line)

    @property
    def id(self) -> str:
        return key_id(self.raw)

    def line(self) -> str:
        """The one-line text form written to ``PATH.pub``."""
        return f"{PUBLIC_KEY_TAG} {base64.b64encode(self.raw).decode()} {self.name or self.id}\n"

    def verify(self, signature: bytes, message: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
            return True
        except InvalidSignature:
            return False


@dataclass(frozen=True)
class SigningKey:
    private: Ed25519PrivateKey = field(repr=False)
    name: str = ""

    @property
    def public(self) -> PublicKey:
        from cryptography.hazmat.primitives import serialization

        raw = self.private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return PublicKey(raw, self.name)

    def sign(self, kind: str, document: Mapping[str, Any]) -> dict[str, str]:
        """The signature entry of ``document`` (a JSON document, ``signatures`` left out) as ``kind``."""
        return {"key": self.public.id, "sig": base64.b64encode(self.private.sign(signed_message(kind, document))).decode()}


# -- key files ---------------------------------------------------------------------------------


def generate_key(out: str | os.PathLike[str], name: str = "") -> SigningKey:
    """Make a new key: ``out`` (private, PEM PKCS#8, 0600) and ``out.pub``; refuses to overwrite either."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    out = Path(out)
    name = name or out.stem
    if not _NAME.fullmatch(name):
        raise KeyFileError(f"key name {name!r}: use 1-64 letters, digits or ._@:+-")
    key = SigningKey(Ed25519PrivateKey.generate(), name)
    pem = key.private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pub = Path(f"{out}.pub")
    for path, data, mode in ((out, pem, 0o600), (pub, key.public.line().encode(), 0o644)):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        except FileExistsError:
            raise KeyFileError(f"{path} exists; a key is never overwritten") from None
        except OSError as exc:
            raise KeyFileError(f"cannot write {path}: {exc.strerror}") from None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return key


#: The most symlinks followed on the way to a key file (the kernel's MAXSYMLINKS).
_MAX_LINKS = 40


def _owner_ok(st: os.stat_result) -> bool:
    """Whether an inode on a key file's path belongs to root or to whoever runs this process."""
    return st.st_uid in (0, os.geteuid())


def _check_key_path(path: str | os.PathLike[str]) -> tuple[int, int]:
    """The (device, inode) of the key file ``path`` names, once every step to it has been checked.

    Walks the path from ``/`` (a relative one from the working directory) one component at a
    time, following symlinks as the kernel would, and refuses (:class:`KeyFileError`, naming
    the key file and the step at fault) anything someone other than root or this process's
    user could use to change what the file says:

    * every directory passed through (the key's own and its parents, and those holding each
      symlink followed) must belong to root or the user and must not be writable by group or
      others unless it has the sticky bit (as ``/tmp``: there only an entry's owner may
      replace it, and the entries are checked themselves);
    * every symlink followed must belong to root or the user (in a sticky directory its
      owner may replace it);
    * the file must be a regular file belonging to root or the user and not writable by
      group or others.
    """
    name = os.fspath(path)
    pending = (name if name.startswith("/") else os.path.join(os.getcwd(), name)).split("/")
    pending.reverse()  # popped from the end: the next component last
    current, links = "/", 0

    def refuse(why: str) -> KeyFileError:
        return KeyFileError(f"key file {name!r}: {why}")

    def lstat(step: str) -> os.stat_result:
        try:
            return os.lstat(step)
        except OSError as exc:
            raise KeyFileError(f"cannot read key file {name!r}: {exc.strerror}") from None

    def check_directory(step: str, st: os.stat_result) -> None:
        if not _owner_ok(st):
            raise refuse(f"directory {step} belongs to uid {st.st_uid}, not root or this user")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise refuse(f"directory {step} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}) "
                         "without the sticky bit: whoever can write it can replace the key")  # fmt: skip

    check_directory("/", lstat("/"))
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current)  # ``current`` has no symlinks, so its parent is lexical
            continue
        step = os.path.join(current, part)
        st = lstat(step)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise refuse(f"more than {_MAX_LINKS} symlinks on its path")
            if not _owner_ok(st):
                raise refuse(f"symlink {step} belongs to uid {st.st_uid}, not root or this user")
            try:
                target = os.readlink(step)
            except OSError as exc:
                raise KeyFileError(f"cannot read key file {name!r}: {exc.strerror}") from None
            if target.startswith("/"):
                current = "/"
            pending.extend(reversed(target.split("/")))
        elif any(pending_part not in ("", ".") for pending_part in pending):
            if not stat.S_ISDIR(st.st_mode):
                raise KeyFileError(f"cannot read key file {name!r}: {step} is not a directory")
            check_directory(step, st)
            current = step
        elif stat.S_ISDIR(st.st_mode):
            raise refuse(f"{step} is a directory, not a regular file")
        else:
            what = f"key file {name!r}" + (f" (the file {step} its symlinks lead to)" if links else "")
            if not stat.S_ISREG(st.st_mode):
                raise KeyFileError(f"{what} is not a regular file")
            if not _owner_ok(st):
                raise KeyFileError(f"{what} belongs to uid {st.st_uid}, not root or this user")
            if st.st_mode & 0o022:
                raise KeyFileError(f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                                   "whoever can write it chooses the key; chmod go-w it")  # fmt: skip
            return st.st_dev, st.st_ino
    raise refuse("names a directory, not a regular file")


def _read_key_file(path: str | os.PathLike[str], *, private: bool = False) -> tuple[bytes, int]:
    """The bytes of the key file ``path`` and its permission bits.

    The path is checked first (:func:`_check_key_path`); the file is opened without blocking
    (a FIFO or a device never holds the caller) and must still be the regular file the check
    found.  ``private``: refuse a file group or others may read (a private key), as ssh does.
    """
    name = os.fspath(path)
    checked = _check_key_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {name!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != checked:
            raise KeyFileError(f"key file {name!r}: changed while it was opened (not the regular file checked)")
        if private:
            _check_private(name, st.st_mode)
        pieces, total = [], 0
        while total <= _KEY_FILE_LIMIT and (piece := os.read(fd, _KEY_FILE_LIMIT + 1 - total)):
            pieces.append(piece)
            total += len(piece)
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {name!r}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if total > _KEY_FILE_LIMIT:
        raise KeyFileError(f"key file {name!r} is larger than a key")
    return b"".join(pieces), stat.S_IMODE(st.st_mode)


def _check_private(name: str, mode: int) -> None:
    """KeyFileError unless the private key file ``name`` of ``mode`` is open to its owner alone."""
    if mode & 0o077:
        raise KeyFileError(f"private key file {name!r} is open to group or others (mode {stat.S_IMODE(mode):04o}): "
                           "chmod 600 it")  # fmt: skip


def load_signing_key(path: str | os.PathLike[str]) -> SigningKey:
    """The private key in ``path`` (PEM PKCS#8 Ed25519, as :func:`generate_key` writes it); the file
    must pass the checks of :func:`_read_key_file` and be open to no one but its owner."""
    data, _ = _read_key_file(path, private=True)
    return _private_key(path, data)


def _private_key(path: str | os.PathLike[str], data: bytes) -> SigningKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{os.fspath(path)!r} is not an unencrypted PEM private key ({exc})") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise KeyFileError(f"{os.fspath(path)!r} is not an Ed25519 key")
    return SigningKey(private, Path(path).stem)


def load_public_key(path: str | os.PathLike[str]) -> PublicKey:
    """The public key in ``path``: a ``bootseer-ed25519 <base64> <name>`` line (a ``.pub`` file)
    that passes the checks of :func:`_read_key_file`."""
    data, _ = _read_key_file(path)
    return _public_key(path, data)


def _public_key(path: str | os.PathLike[str], data: bytes) -> PublicKey:
    try:
        return parse_public_key_line(data.decode("ascii", errors="replace"))
    except KeyFileError as exc:
        raise KeyFileError(f"{os.fspath(path)!r}: {exc}") from None


def show_key(path: str | os.PathLike[str]) -> PublicKey:
    """The public key of the key file ``path``, a ``.pub`` line or a private key (read once, checked as
    :func:`load_public_key` or :func:`load_signing_key` checks it): what ``bootseer keys show`` prints."""
    data, mode = _read_key_file(path)
    if data.lstrip().startswith(PUBLIC_KEY_TAG.encode()):
        return _public_key(path, data)
    key = _private_key(path, data)
    _check_private(os.fspath(path), mode)
    return key.public


def parse_public_key_line(text: str) -> PublicKey:
    """A public key in its one-line text form."""
    words = text.split()
    if len(words) not in (2, 3) or words[0] != PUBLIC_KEY_TAG:
        raise KeyFileError(f"not a public key line '{PUBLIC_KEY_TAG} <base64> <name>'")
    try:
        raw = base64.b64decode(words[1], validate=True)
    except binascii.Error:
        raw = b""
    if len(raw) != 32:
        raise KeyFileError("the key is not 32 bytes of base64")
    return PublicKey(raw, words[2] if len(words) == 3 else "")


# -- signing and verifying documents -----------------------------------------------------------------


def canonical_json(document: Mapping[str, Any]) -> bytes:
    """``document`` without ``signatures`` as canonical JSON (sorted keys, no spaces, ASCII)."""
    unsigned = {k: v for k, v in document.items() if k != SIGNATURES_FIELD}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def signed_message(kind: str, document: Mapping[str, Any]) -> bytes:
    """What a signature of ``document`` as ``kind`` signs (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind of signed object {kind!r}")
    return _CONTEXT + kind.encode() + b"\0" + hashlib.sha256(canonical_json(document)).digest()


def sign_document(document: Mapping[str, Any], kind: str, key: SigningKey) -> dict[str, Any]:
    """``document`` with ``key``'s signature in its ``signatures`` (replacing an earlier one of that key)."""
    entry = key.sign(kind, document)
    others = [s for s in signatures_of(document) if s.get("key") != entry["key"]]
    return {**document, SIGNATURES_FIELD: [*others, entry]}


def signatures_of(document: Mapping[str, Any]) -> list[dict[str, str]]:
    """The well-formed signature entries of ``document`` (at most :data:`MAX_SIGNATURES`); others are dropped."""
    found = document.get(SIGNATURES_FIELD)
    if not isinstance(found, list):
        return []
    return [
        {"key": s["key"], "sig": s["sig"]}
        for s in found[:MAX_SIGNATURES]
        if isinstance(s, dict) and isinstance(s.get("key"), str) and isinstance(s.get("sig"), str)
    ]


@dataclass(frozen=True)
class Signed:
    """What a reader keeps of a decoded object to check its signatures later: the signed message and the entries."""

    message: bytes
    signatures: tuple[tuple[str, str], ...]  #: (key id, base64 signature)

    @classmethod
    def of(cls, kind: str, document: Mapping[str, Any]) -> Signed:
        entries = tuple((s["key"], s["sig"]) for s in signatures_of(document))
        if not entries:  # nothing to check: spare the canonical encoding (a large hot list's is megabytes)
            return cls(b"", ())
        try:
            message = signed_message(kind, document)
        except ValueError:  # a NaN or infinity: no canonical form, so nothing can have signed it
            message = b""
        return cls(message, entries)

    def signer(self, keys: Iterable[PublicKey]) -> PublicKey | None:
        """The first of ``keys`` whose valid signature this object carries; None if there is none."""
        if not self.message:
            return None
        by_id = {key.id: key for key in keys}
        for kid, sig in self.signatures:
            key = by_id.get(kid)
            if key is None:
                continue
            try:
                raw = base64.b64decode(sig, validate=True)
            except binascii.Error:
                continue
            if len(raw) == 64 and key.verify(raw, self.message):
                return key
        return None

    def key_ids(self) -> list[str]:
        return [kid for kid, _ in self.signatures]


# -- the policy -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrustPolicy:
    """The keys a node trusts, by role.  An empty role trusts the store as it is (no check).

    ``converter_keys`` sign conversions (chain records); ``writer_keys`` sign what nodes
    publish (hot lists, deps records).  The roles are separate so a node's key, which
    every node of a cluster holds, cannot forge an image's conversion.
    """

    converter_keys: tuple[PublicKey, ...] = ()
    writer_keys: tuple[PublicKey, ...] = ()

    @classmethod
    def load(cls, converter_key_files: Sequence[str] = (), writer_key_files: Sequence[str] = ()) -> TrustPolicy:
        """The policy of these ``.pub`` files; :class:`KeyFileError` naming the first that is bad."""
        return cls(
            tuple(load_public_key(p) for p in converter_key_files), tuple(load_public_key(p) for p in writer_key_files)
        )

    def load_sign_key(self, path: str | os.PathLike[str]) -> SigningKey:
        """A node's own key (``[trust] sign_key``, ``--sign-key``) from ``path``, as :func:`load_signing_key`
        reads it; :class:`KeyFileError` too when its public key is one of :attr:`converter_keys`.

        Every node of a cluster holds its sign key, and a converter key makes any layer trusted, so the
        two roles never share a key (docs/trust.md).  Only the converter keys this policy knows are
        checked: a node configured without them cannot tell.
        """
        key = load_signing_key(path)
        public = key.public
        if any(public.raw == converter.raw for converter in self.converter_keys):
            raise KeyFileError(f"sign key {os.fspath(path)!r} is a trusted converter key (id {public.id}): a node "
                               "signs with its own key, never the one that vouches for conversions")  # fmt: skip
        return key

    def keys_for(self, kind: str) -> tuple[PublicKey, ...]:
        return self.converter_keys if kind == "chain" else self.writer_keys

    def enforced(self, kind: str) -> bool:
        """Whether objects of ``kind`` must carry a trusted signature."""
        return bool(self.keys_for(kind))

    def check(self, kind: str, signed: Signed | None, what: str) -> PublicKey | None:
        """The trusted key that signed ``what`` (None when ``kind`` is not enforced); :class:`Untrusted` if none did."""
        keys = self.keys_for(kind)
        if not keys:
            return None
        signed = signed or Signed(b"", ())
        signer = signed.signer(keys)
        if signer is None:
            found = ", ".join(signed.key_ids()) or "none"
            role = "converter" if kind == "chain" else "writer"
            raise Untrusted(f"{what} is not signed by a trusted {role} key (signatures by: {found})")
        return signer

    def describe(self) -> dict[str, Any]:
        """For a start-up log line: which keys each role trusts."""
        return {
            "converter_keys": [f"{k.name}:{k.id}" for k in self.converter_keys] or "any (not checked)",
            "writer_keys": [f"{k.name}:{k.id}" for k in self.writer_keys] or "any (not checked)",
        }
