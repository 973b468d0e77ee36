"""bootseer.images.registry: OCI layouts and a real registry (Debian's docker-registry), read and verified.

Registry tests push OCI layouts with skopeo into a ``docker-registry`` on 127.0.0.1
(:class:`tests.support.registry.Registry`), then read them back: by tag and by digest,
through an index with several platforms, with basic auth (htpasswd) and bearer tokens
(the registry's own token verification against a token service this file runs), and
with blobs corrupted in the registry's storage.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import shutil
import threading
import time
import urllib.parse
import uuid
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from bootseer.images import registry as images
from bootseer.images.registry import (
    AuthError, BadReference, Descriptor, DigestMismatch, ImageNotFound, MalformedImage, Platform,
    RegistryReference, UnsupportedMediaType, open_image,
)
from tests.support.layers import Dir, File, Layer
from tests.support.oci import BuiltImage, add_platform_index, blob_data, build_oci_layout
from tests.support.processes import run
from tests.support.registry import Registry
from tests.support.tls import self_signed

# --------------------------------------------------------------------------- helpers

LAYERS = [
    Layer((File("/a.txt", b"layer zero\n"), Dir("/etc")), "zero"),
    Layer((File("/b.bin", blob_data(300_000)),), "one"),
]


def build(tmp: Path, name: str = "img", tag: str = "v1", layers=LAYERS) -> BuiltImage:
    return build_oci_layout(tmp / name, layers, tag=tag)


def blob_path(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def put_blob(layout: Path, data: bytes) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob_path(layout, digest).write_bytes(data)
    return {"digest": digest, "size": len(data)}


def set_index(layout: Path, manifests: list[dict]) -> None:
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))


def rewrite_manifest(image: BuiltImage, change) -> None:
    """Apply ``change(manifest_dict)`` and point index.json at the new manifest."""
    manifest = json.loads(blob_path(image.layout, image.manifest_digest).read_bytes())
    change(manifest)
    desc = put_blob(image.layout, json.dumps(manifest).encode())
    desc.update(mediaType=manifest.get("mediaType", images.MEDIA_OCI_MANIFEST),
                annotations={"org.opencontainers.image.ref.name": image.tag})
    set_index(image.layout, [desc])


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:5000/bootseer/demo:v1", ("127.0.0.1:5000", "bootseer/demo", "v1", None)),
    ("localhost/x", ("localhost", "x", "latest", None)),
    ("registry.example.com/a/b/c", ("registry.example.com", "a/b/c", "latest", None)),
    ("ubuntu", ("docker.io", "library/ubuntu", "latest", None)),
    ("someone/app:1.2", ("docker.io", "someone/app", "1.2", None)),
    ("h:1/n@sha256:" + "a" * 64, ("h:1", "n", None, "sha256:" + "a" * 64)),
    ("h:1/n:t@sha256:" + "b" * 64, ("h:1", "n", "t", "sha256:" + "b" * 64)),
])
def test_registry_reference_grammar(text, expected):
    ref = RegistryReference.parse(text)
    assert (ref.domain, ref.repository, ref.tag, ref.digest) == expected
    assert ref.object == (ref.digest or ref.tag)


@pytest.mark.parametrize("text", [
    "", "UPPER/case", "h:1/n:bad tag", "h:1/n@sha256:abc", "h:1/n@md5:" + "a" * 32, "h:1/n:-x", "h:1//n",
    "http://h:1/n:t", "h:1/n:" + "t" * 129,
])
def test_bad_references_are_refused_clearly(text):
    with pytest.raises(BadReference, match="reference"):
        open_image(text)


def test_oci_reference_forms(tmp_path):
    image = build(tmp_path)
    assert open_image(f"oci:{image.layout}:v1").reference == f"oci:{image.layout}:v1"
    # No tag: the layout's only image.
    assert open_image(f"oci:{image.layout}").resolve().manifest_descriptor.digest == image.manifest_digest
    with pytest.raises(BadReference):
        open_image("oci:")


def test_platform_parse_and_host():
    assert Platform.parse("linux/arm64/v8") == Platform("linux", "arm64", "v8")
    assert Platform.host().os == "linux"
    with pytest.raises(images.ImageError, match="platform"):
        Platform.parse("linux")


# --------------------------------------------------------------------------- OCI layouts


def test_resolve_oci_layout(tmp_path):
    image = build(tmp_path)
    with open_image(f"oci:{image.layout}:v1") as source:
        resolved = source.resolve()
        assert resolved.manifest_descriptor.digest == image.manifest_digest
        assert resolved.target == resolved.manifest_descriptor and resolved.index is None
        assert resolved.manifest.config.digest == image.config_digest
        assert "sha256:" + hashlib.sha256(resolved.config_bytes).hexdigest() == image.config_digest
        assert tuple(d.digest for d in resolved.layers) == image.layer_digests
        assert resolved.diff_ids == image.diff_ids
        assert images.layer_compression(resolved.layers[0].media_type) == "gzip"
        with source.open_blob(resolved.layers[1]) as blob:
            data = blob.read()
            assert blob.verified
        assert "sha256:" + hashlib.sha256(gzip.decompress(data)).hexdigest() == image.diff_ids[1]


def test_index_picks_the_platform(tmp_path):
    image = build(tmp_path)
    other = build(tmp_path, "arm", layers=[Layer((File("/arm", b"arm\n"),))])
    index_desc = add_platform_index(image, other)
    amd = open_image(f"oci:{image.layout}:multi", platform="linux/amd64").resolve()
    assert amd.manifest_descriptor.digest == image.manifest_digest
    assert amd.index is not None and amd.index.digest == index_desc["digest"]
    assert amd.target == amd.index and json.loads(amd.index_bytes)["manifests"][0]["digest"] == image.manifest_digest
    arm = open_image(f"oci:{image.layout}:multi", platform="linux/arm64").resolve()
    assert arm.manifest_descriptor.digest == other.manifest_digest and arm.diff_ids == other.diff_ids
    with pytest.raises(ImageNotFound, match=r"no manifest for platform linux/s390x.*linux/amd64, linux/arm64/v8"):
        open_image(f"oci:{image.layout}:multi", platform="linux/s390x").resolve()


def test_layout_errors_name_the_problem(tmp_path):
    image = build(tmp_path)
    with pytest.raises(ImageNotFound, match=r"no image tagged 'nope' \(tags: v1\)"):
        open_image(f"oci:{image.layout}:nope").resolve()
    with pytest.raises(ImageNotFound, match="not an OCI image layout"):
        open_image(f"oci:{tmp_path}:v1").resolve()
    (image.layout / "index.json").write_text("{not json")
    with pytest.raises(MalformedImage, match="malformed JSON"):
        open_image(f"oci:{image.layout}:v1").resolve()


def test_tampered_blobs_are_never_handed_out_as_complete(tmp_path):
    image = build(tmp_path)
    source = open_image(f"oci:{image.layout}:v1")
    layer = source.resolve().layers[1]
    path = blob_path(image.layout, layer.digest)
    good = path.read_bytes()

    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same size, one bit off
    with source.open_blob(layer) as blob, pytest.raises(DigestMismatch, match="expected " + layer.digest):
        while blob.read(65536):
            pass
    assert not blob.verified

    path.write_bytes(good[:-10])
    with pytest.raises(DigestMismatch, match=f"ended after {len(good) - 10} of {len(good)}"):
        source.open_blob(layer).read()

    path.write_bytes(good + b"extra")
    with pytest.raises(DigestMismatch, match="more than"):
        source.open_blob(layer).read()

    path.unlink()
    with pytest.raises(ImageNotFound, match="missing"):
        source.open_blob(layer)


def test_tampered_manifest_and_config_are_refused(tmp_path):
    image = build(tmp_path)
    manifest = blob_path(image.layout, image.manifest_digest)
    manifest.write_bytes(manifest.read_bytes().replace(b'"layers"', b'"lAyers"'))
    with pytest.raises(DigestMismatch):
        open_image(f"oci:{image.layout}:v1").resolve()

    image = build(tmp_path, "cfg")
    config = blob_path(image.layout, image.config_digest)
    config.write_bytes(config.read_bytes()[:-1] + b" ")
    with pytest.raises(DigestMismatch, match=image.config_digest):
        open_image(f"oci:{image.layout}:v1").resolve()


def test_wrong_media_types_and_shapes(tmp_path):
    image = build(tmp_path)
    rewrite_manifest(image, lambda m: m["config"].update(mediaType="application/octet-stream"))
    with pytest.raises(UnsupportedMediaType, match="not an image config"):
        open_image(f"oci:{image.layout}:v1").resolve()

    image = build(tmp_path, "layer")
    rewrite_manifest(image, lambda m: m["layers"][0].update(mediaType="application/x-rar"))
    with pytest.raises(UnsupportedMediaType, match="x-rar"):
        open_image(f"oci:{image.layout}:v1").resolve()

    image = build(tmp_path, "count")
    rewrite_manifest(image, lambda m: m["layers"].pop())
    with pytest.raises(MalformedImage, match="2 diff_ids for 1 layers"):
        open_image(f"oci:{image.layout}:v1").resolve()

    image = build(tmp_path, "schema1")
    desc = put_blob(image.layout, b'{"schemaVersion": 1}')
    set_index(image.layout, [dict(desc, mediaType=images.MEDIA_DOCKER_SCHEMA1[1])])
    with pytest.raises(UnsupportedMediaType, match="schema 1"):
        open_image(f"oci:{image.layout}").resolve()

    image = build(tmp_path, "baddesc")
    set_index(image.layout, [{"mediaType": images.MEDIA_OCI_MANIFEST, "digest": "sha256:xyz", "size": 1}])
    with pytest.raises(MalformedImage, match="invalid digest"):
        open_image(f"oci:{image.layout}").resolve()


def test_sizes_are_bounded(tmp_path, monkeypatch):
    image = build(tmp_path)
    monkeypatch.setattr(images, "MAX_CONFIG_BYTES", 16)
    with pytest.raises(MalformedImage, match="exceeds 16"):
        open_image(f"oci:{image.layout}:v1").resolve()
    source = open_image(f"oci:{image.layout}:v1")
    with pytest.raises(MalformedImage, match="exceeds 10"):
        source.read_blob(Descriptor(images.MEDIA_OCI_CONFIG, image.config_digest, 11), 10)


# --------------------------------------------------------------------------- registry


@pytest.fixture(scope="module")
def tools() -> None:
    missing = [t for t in ("docker-registry", "skopeo") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"missing {missing}: run ctr_examples/install-deps.sh")


@pytest.fixture
def registry(tools, tmp_path) -> Iterator[Registry]:
    reg = Registry(tmp_path / "registry")
    reg.start()
    try:
        yield reg
    finally:
        reg.stop()


def test_registry_by_tag_and_by_digest(registry, tmp_path):
    image = build(tmp_path)
    ref = registry.push(image, "bootseer/img")
    with open_image(ref, plain_http=True) as source:
        resolved = source.resolve()
        assert resolved.diff_ids == image.diff_ids
        assert resolved.manifest.config.digest == image.config_digest
        # skopeo keeps the OCI manifest as is: the same bytes, the same digest.
        assert resolved.manifest_descriptor.digest == image.manifest_digest
        for layer, digest in zip(resolved.layers, image.layer_digests):
            with source.open_blob(layer) as blob:
                assert hashlib.sha256(blob.read()).hexdigest() == digest.removeprefix("sha256:")
                assert blob.verified
    pinned = f"{registry.address}/bootseer/img@{image.manifest_digest}"
    assert open_image(pinned, plain_http=True).resolve().diff_ids == image.diff_ids


def test_registry_docker_schema2_and_manifest_list(registry, tmp_path):
    image = build(tmp_path)
    other = build(tmp_path, "arm", layers=[Layer((File("/arm", b"arm\n"),))])
    add_platform_index(image, other)
    ref = f"{registry.address}/bootseer/multi:v2"
    # skopeo converts to Docker's formats on request: a manifest list of schema 2 manifests.
    run(["skopeo", "copy", "--quiet", "--all", "--dest-tls-verify=false", "--format", "v2s2",
                 f"oci:{image.layout}:multi", f"docker://{ref}"])
    arm = open_image(ref, plain_http=True, platform="linux/arm64/v8").resolve()
    assert arm.index is not None and arm.index.media_type == images.MEDIA_DOCKER_LIST
    assert arm.manifest_descriptor.media_type == images.MEDIA_DOCKER_MANIFEST
    assert arm.manifest.config.media_type == images.MEDIA_DOCKER_CONFIG
    assert arm.diff_ids == other.diff_ids
    assert arm.layers[0].media_type == "application/vnd.docker.image.rootfs.diff.tar.gzip"
    amd = open_image(ref, plain_http=True, platform="linux/amd64").resolve()
    assert amd.diff_ids == image.diff_ids


def test_registry_not_found(registry, tmp_path):
    image = build(tmp_path)
    registry.push(image, "bootseer/img")
    with pytest.raises(ImageNotFound, match="404"):
        open_image(f"{registry.address}/bootseer/img:nope", plain_http=True).resolve()
    with pytest.raises(ImageNotFound):
        open_image(f"{registry.address}/bootseer/none:v1", plain_http=True).resolve()
    with pytest.raises(ImageNotFound):
        open_image(f"{registry.address}/bootseer/img@sha256:" + "0" * 64, plain_http=True).resolve()
    source = open_image(f"{registry.address}/bootseer/img:v1", plain_http=True)
    with pytest.raises(ImageNotFound):
        source.open_blob(Descriptor(images.MEDIA_OCI_CONFIG, "sha256:" + "1" * 64, 3))


def test_registry_serving_corrupt_blobs_is_caught(registry, tmp_path):
    image = build(tmp_path)
    ref = registry.push(image, "bootseer/img")
    # The registry serves what its storage holds without re-hashing it: flip a bit there.
    layer_digest = image.layer_digests[1]
    stored = registry.base / "storage/docker/registry/v2/blobs/sha256" / layer_digest[7:9] / layer_digest[7:] / "data"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0x40
    stored.write_bytes(bytes(data))
    source = open_image(ref, plain_http=True)
    layer = source.resolve().layers[1]
    with pytest.raises(DigestMismatch, match="expected " + layer_digest):
        source.open_blob(layer).read()


def test_https_is_the_default(registry, tmp_path):
    image = build(tmp_path)
    ref = registry.push(image, "bootseer/img")
    # The registry speaks plain HTTP only: without plain_http the TLS handshake fails, clearly.
    with pytest.raises(images.RegistryError, match="failed"):
        open_image(ref).resolve()


def _docker_config(tmp_path: Path, host: str, user: str, password: str, monkeypatch) -> None:
    config = tmp_path / "docker"
    config.mkdir(exist_ok=True)
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    (config / "config.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(config))


def test_basic_auth_from_the_docker_config(registry, tmp_path, monkeypatch):
    image = build(tmp_path)
    ref = registry.push(image, "bootseer/img")
    registry.stop()
    with warnings.catch_warnings():  # crypt (bcrypt via libxcrypt) is deprecated from 3.11, gone in 3.13
        warnings.simplefilter("ignore", DeprecationWarning)
        crypt = pytest.importorskip("crypt", reason="hashes the htpasswd entry")
    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text(f"alice:{crypt.crypt('s3cret-pw', crypt.mksalt(crypt.METHOD_BLOWFISH))}\n")
    registry.extra_config = f"auth:\n  htpasswd:\n    realm: bootseer-test\n    path: {htpasswd}\n"
    registry.start()
    ref = f"{registry.address}/bootseer/img:v1"

    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
    with pytest.raises(AuthError, match="no credentials"):
        open_image(ref, plain_http=True).resolve()

    _docker_config(tmp_path, registry.address, "alice", "wrong-pw", monkeypatch)
    with pytest.raises(AuthError) as refused:
        open_image(ref, plain_http=True).resolve()
    assert "wrong-pw" not in str(refused.value)

    _docker_config(tmp_path, registry.address, "alice", "s3cret-pw", monkeypatch)
    with open_image(ref, plain_http=True) as source:
        resolved = source.resolve()
        assert resolved.diff_ids == image.diff_ids
        assert hashlib.sha256(source.open_blob(resolved.layers[0]).read()).hexdigest() == \
            image.layer_digests[0].removeprefix("sha256:")


class TokenService:
    """A Docker token service (the protocol of docker/distribution's docs/spec/auth/token.md) on 127.0.0.1.

    Issues RS256 JWTs with an ``x5c`` chain of its self-signed certificate, which the real
    registry is configured to trust; checks basic credentials; records each request's query.
    """

    SERVICE = "bootseer-registry"
    ISSUER = "bootseer-test-issuer"

    def __init__(self, directory: Path, user: str, password: str):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID
        import datetime

        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bootseer token signer")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(hours=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        self.cert_pem = directory / "token-cert.pem"
        self.cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self._x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self.user, self.password = user, password
        self.queries: list[dict[str, list[str]]] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                service.queries.append(query)
                expected = "Basic " + base64.b64encode(f"{service.user}:{service.password}".encode()).decode()
                if self.headers.get("Authorization") != expected:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps({"token": service.token(query.get("scope", [""])[0])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/token"

    def token(self, scope: str) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        access = []
        if scope.count(":") == 2:
            kind, name, actions = scope.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self._x5c]}
        claims = {"iss": self.ISSUER, "sub": self.user, "aud": self.SERVICE, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": uuid.uuid4().hex, "access": access}
        signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        signature = self.key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{b64(signature)}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_bearer_token_auth(registry, tmp_path, monkeypatch):
    pytest.importorskip("cryptography", reason="signs the test token service's JWTs")
    image = build(tmp_path)
    registry.push(image, "bootseer/img")
    registry.stop()
    tokens = TokenService(tmp_path, "bob", "token-pw")
    try:
        registry.extra_config = (f"auth:\n  token:\n    realm: {tokens.realm}\n    service: {tokens.SERVICE}\n"
                                 f"    issuer: {tokens.ISSUER}\n    rootcertbundle: {tokens.cert_pem}\n")
        registry.start()
        ref = f"{registry.address}/bootseer/img:v1"

        monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
        with pytest.raises(AuthError, match="token service .* answered 401"):
            open_image(ref, plain_http=True).resolve()

        _docker_config(tmp_path, registry.address, "bob", "token-pw", monkeypatch)
        with open_image(ref, plain_http=True) as source:
            resolved = source.resolve()
            assert resolved.diff_ids == image.diff_ids
            with source.open_blob(resolved.layers[1]) as blob:
                assert hashlib.sha256(blob.read()).hexdigest() == image.layer_digests[1].removeprefix("sha256:")
        # The challenge's service and scope went to the token service as the spec says.
        last = tokens.queries[-1]
        assert last["service"] == [tokens.SERVICE]
        assert last["scope"] == ["repository:bootseer/img:pull"]
    finally:
        tokens.close()


def test_https_registry_with_its_certificate_verified(registry, tmp_path, monkeypatch):
    pytest.importorskip("cryptography", reason="makes the registry's certificate")
    image = build(tmp_path)
    registry.push(image, "bootseer/img")
    registry.stop()
    registry.tls = cert, _ = self_signed(tmp_path)
    registry.start()
    ref = f"{registry.address}/bootseer/img:v1"

    # HTTPS is the default and the certificate is checked: an unknown CA is refused, clearly.
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-such-bundle.pem"))
    with pytest.raises(images.RegistryError, match="CERTIFICATE_VERIFY_FAILED"):
        open_image(ref).resolve()
    # Trusted (as a cluster's private CA would be, through the system bundle or SSL_CERT_FILE): it works.
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    with open_image(ref) as source:
        resolved = source.resolve()
        assert resolved.diff_ids == image.diff_ids
        assert source.open_blob(resolved.layers[1]).read()
    # plain_http against a TLS registry fails too, and says so.
    with pytest.raises(images.ImageError):
        open_image(ref, plain_http=True).resolve()
