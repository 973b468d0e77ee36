"""The lazy-layers benchmark's image: Debian + Python + CPU torch + a tiny training job.

Builds, once, an OCI image layout of four gzip layers, each the difference a build step
made (captured as an overlayfs upper directory, the way an image builder does it):

1. ``base``: Debian bookworm ``debootstrap --variant=minbase`` from the configured mirror;
2. ``python``: ``apt-get install python3 python3-pip`` (no recommends);
3. ``torch``: ``pip install torch==TORCH_VERSION`` (the CPU wheel on this machine's disk)
   with pip's default bytecode compilation, as any image built with pip has it;
4. ``app``: ``/app/train.py``, the container's command: it imports torch (and marks
   ``/.bootseer/import.end`` for the start-up profiler), runs one training step of a tiny
   model, prints :data:`FIRST_OUTPUT_MARKER`, marks ``/.bootseer/first_step`` and creates
   ``/.bootseer-seal`` (:data:`SEAL_MARKER`), which ends a hot-list recording of the boot.
   The marks are files whose mtime is the moment (docs/profile.md); unprofiled, they are
   two empty files in the container's writable layer.

Everything lives under one cache directory and is reused by later runs: a step is redone
only when its recipe (or a step below it) changed.  A step builds into ``NAME.partial``
and is renamed into place when complete, so an interrupted build never leaves a step that
looks done.  The builder runs commands in a chroot over an overlay mount whose upper
directory becomes the layer: overlayfs marks deletions as 0/0 character devices and
opaque directories with the ``trusted.overlay.opaque`` xattr, which become OCI
``.wh.NAME`` and ``.wh..wh..opq`` entries in the layer tar.  While a step runs, the host's
CA bundle, resolv.conf and wheel directories are mounted into the chroot (on tmpfs or
bind mounts) and never land in a layer.

Run alone (from the checkout's root): ``python -m bench.image_build [--cache-dir DIR]`` prints the layout.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tests.support.oci import MEDIA_LAYER_GZIP, LayerRef, put_file, write_image

DEFAULT_CACHE_DIR = Path("/var/tmp/bootseer-bench")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"
TORCH_VERSION = "2.13.0"
IMAGE_TAG = "v1"
#: Bumped whenever write_layer_tar changes what it writes, so cached blobs are remade.
TAR_WRITER_VERSION = "2"
#: What the job prints when it has done its first useful work; the benchmark's clock stops there.
FIRST_OUTPUT_MARKER = "BOOTSEER-FIRST-OUTPUT"
#: The file the job creates at its root after its first output: the hot-list seal marker
#: (the layer server's default ``--hotlist-marker``).
SEAL_MARKER = ".bootseer-seal"
#: The start-up profiler's marks the job leaves (bootseer/profile/trace.py): where its marks go in a
#: container, the mark that closes the import phase, and the one that ends the start.
MARKS_DIR = "/.bootseer"
IMPORT_DONE_MARK = "import.end"
FIRST_STEP_MARK = "first_step"

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"

#: Host paths the pip step needs inside the chroot, mounted read-only under /run (a tmpfs there).
PIP_SOURCES = ("/opt/wheels", "/opt/pypi", "/opt/pypi-more")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
CHROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

TRAIN_PY = f'''\
"""The benchmark's job: import torch, one training step of a tiny model, one line of output."""
import os

import torch


def mark(name):
    """The start-up profiler's shell form of a mark (docs/profile.md): the file's mtime is the moment."""
    os.makedirs("{MARKS_DIR}", exist_ok=True)
    open(f"{MARKS_DIR}/{{name}}", "w").close()


mark("{IMPORT_DONE_MARK}")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
inputs, labels = torch.randn(32, 64), torch.randint(0, 10, (32,))
loss = torch.nn.functional.cross_entropy(model(inputs), labels)
optimizer.zero_grad()
loss.backward()
optimizer.step()
print(f"{FIRST_OUTPUT_MARKER} step=1 loss={{loss.item():.4f}} torch={{torch.__version__}}", flush=True)
mark("{FIRST_STEP_MARK}")
# The start-up is over: a recording of this boot's reads ends here (docs/hotlist.md, sealing).
open("/{SEAL_MARKER}", "w").close()
'''

PYTHON_STEP = """\
set -e
apt-get update -q
apt-get install -y -q --no-install-recommends python3 python3-pip
apt-get clean
rm -rf /var/lib/apt/lists/*_* /var/cache/debconf/*-old
"""

TORCH_STEP = f"""\
set -e
python3 -m pip install --break-system-packages --no-cache-dir --root-user-action=ignore \\
    --disable-pip-version-check torch=={TORCH_VERSION} numpy
python3 -c 'import torch; print("torch", torch.__version__)'
"""


class BuildError(RuntimeError):
    """A build step failed; the message names the step and the command."""


@dataclass(frozen=True)
class LayerBlob:
    name: str
    digest: str  #: sha256 of the gzip blob
    size: int
    diff_id: str  #: sha256 of the uncompressed tar
    tar_size: int
    recipe: str  #: key of the recipe that made it (and the layers below)


@dataclass(frozen=True)
class Image:
    layout: Path
    tag: str
    manifest_digest: str
    layers: tuple[LayerBlob, ...]

    @property
    def oci_ref(self) -> str:
        return f"oci:{self.layout}:{self.tag}"

    @property
    def unpacked_bytes(self) -> int:
        return sum(layer.tar_size for layer in self.layers)

    @property
    def compressed_bytes(self) -> int:
        return sum(layer.size for layer in self.layers)


def _log(message: str) -> None:
    print(f"[image] {message}", flush=True)


def _run(argv: list[str], what: str, **kwargs) -> None:
    done = subprocess.run(argv, **kwargs)
    if done.returncode != 0:
        raise BuildError(f"{what}: exit status {done.returncode}: {' '.join(argv)}")


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- steps


def _clean_apt(root: Path) -> None:
    """Drop what debootstrap leaves behind that no image keeps: downloaded .debs and package lists."""
    for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*_*", "var/cache/apt/*.bin"):
        for path in root.glob(pattern):
            path.unlink()


def debootstrap(target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    _log(f"debootstrap --variant=minbase {SUITE} from {DEBIAN_MIRROR} (a few minutes)")
    _run(["nice", "-n", "10", "debootstrap", "--variant=minbase", SUITE, str(partial), DEBIAN_MIRROR],
         "debootstrap", stdout=subprocess.DEVNULL)
    _clean_apt(partial)
    partial.rename(target)


@contextlib.contextmanager
def _mounted(argv: list[str], point: Path) -> Iterator[None]:
    _run(argv, f"mount {point}")
    try:
        yield
    finally:
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)


def run_step(lowers: list[Path], upper: Path, script: str, work: Path) -> None:
    """Run ``script`` as root in a chroot of ``lowers`` (topmost first); its changes go to ``upper``.

    ``upper`` is built as ``upper.partial`` and renamed when the script succeeded.
    """
    partial = upper.with_name(upper.name + ".partial")
    overlay_work, merged = work / "ovl-work", work / "merged"
    for path in (partial, overlay_work, merged):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    options = (f"lowerdir={':'.join(map(str, lowers))},upperdir={partial},workdir={overlay_work},"
               "redirect_dir=off,metacopy=off,index=off")
    with contextlib.ExitStack() as mounts:
        mounts.enter_context(_mounted(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], merged))
        mounts.enter_context(_mounted(["mount", "-t", "proc", "proc", str(merged / "proc")], merged / "proc"))
        mounts.enter_context(_mounted(["mount", "--bind", "/dev", str(merged / "dev")], merged / "dev"))
        # /run and /tmp are tmpfs, as in a container: nothing there reaches the layer.
        for name in ("run", "tmp"):
            mounts.enter_context(_mounted(["mount", "-t", "tmpfs", "tmpfs", str(merged / name)], merged / name))
        resolv = merged / "etc" / "resolv.conf"
        if resolv.is_file() and not resolv.is_symlink():
            mounts.enter_context(_mounted(["mount", "--bind", "-o", "ro", "/etc/resolv.conf", str(resolv)], resolv))
        env = {"PATH": CHROOT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
        if HOST_CA_BUNDLE.is_file():
            shutil.copy(HOST_CA_BUNDLE, merged / "run" / "host-ca.crt")
            env |= {"PIP_CERT": "/run/host-ca.crt", "SSL_CERT_FILE": "/run/host-ca.crt"}
        links, indexes = [], []
        for source in PIP_SOURCES:
            if not Path(source).is_dir():
                continue
            inside = merged / "run" / Path(source).name
            inside.mkdir()
            mounts.enter_context(_mounted(["mount", "--bind", "-o", "ro", source, str(inside)], inside))
            if (Path(source) / "simple").is_dir():
                indexes.append(f"file:///run/{inside.name}/simple")
            else:
                links.append(f"/run/{inside.name}")
        if links:
            env["PIP_FIND_LINKS"] = " ".join(links)
        if indexes:
            env["PIP_EXTRA_INDEX_URL"] = " ".join(indexes)
        _run(["chroot", str(merged), "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()),
              "/bin/sh", "-c", script], f"build step {upper.name}")
    shutil.rmtree(overlay_work, ignore_errors=True)
    partial.rename(upper)


def write_app(target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "app").mkdir(parents=True)
    (partial / "app" / "train.py").write_text(TRAIN_PY)
    partial.rename(target)


# --------------------------------------------------------------------------- layer tars


def _layer_members(root: Path) -> Iterator[tuple[str, Path | None]]:
    """(name in the tar, path on disk) in a stable order; path None for an opaque marker."""
    for directory, dirnames, filenames in os.walk(root):
        # os.walk lists symlinks to directories (merged-/usr's /bin, /lib, /lib64) with the
        # directories but never descends into them: they are entries of their own.
        links = [name for name in dirnames if os.path.islink(os.path.join(directory, name))]
        dirnames[:] = sorted(set(dirnames) - set(links))
        filenames = filenames + links
        rel = os.path.relpath(directory, root)
        if rel != ".":
            yield rel, Path(directory)
            with contextlib.suppress(OSError):
                if os.getxattr(directory, OPAQUE_XATTR, follow_symlinks=False) == b"y":
                    yield f"{rel}/{OPAQUE_MARKER}", None
        for name in sorted(filenames):
            path = Path(directory, name)
            yield (name if rel == "." else f"{rel}/{name}"), path


def write_layer_tar(root: Path, out: Path) -> tuple[str, int]:
    """Write the OCI layer tar of directory ``root`` (an overlayfs upper dir) to ``out``.

    Returns the tar's sha256 (the layer's diff_id) and size.  Ownership is numeric
    (the chroot's users are not the host's); xattrs other than overlayfs's are not
    carried (this image has none that matter).
    """
    digest = hashlib.sha256()

    class _Hashing:
        def __init__(self, file):
            self.file = file

        def write(self, data: bytes) -> int:
            digest.update(data)
            return self.file.write(data)

    with open(out, "wb") as raw:
        with tarfile.open(fileobj=_Hashing(raw), mode="w|", format=tarfile.PAX_FORMAT,
                          bufsize=1 << 20) as tar:
            for name, path in _layer_members(root):
                if path is None:  # opaque marker
                    marker = tarfile.TarInfo(name)
                    marker.mtime = int(time.time())
                    tar.addfile(marker)
                    continue
                st = path.lstat()
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # overlayfs whiteout
                    parent, _, base = name.rpartition("/")
                    info = tarfile.TarInfo(f"{parent}/{WHITEOUT_PREFIX}{base}" if parent else WHITEOUT_PREFIX + base)
                    info.mtime = int(st.st_mtime)
                    tar.addfile(info)
                    continue
                info = tar.gettarinfo(str(path), arcname=name)
                info.uname = info.gname = ""
                if info.isreg():
                    with open(path, "rb") as data:
                        tar.addfile(info, data)
                else:
                    tar.addfile(info)
        size = raw.tell()
    return "sha256:" + digest.hexdigest(), size


def make_blob(name: str, root: Path, blobs: Path, recipe: str, jobs: int) -> LayerBlob:
    """Tar and gzip ``root`` into ``blobs``; the blob's record is kept beside it as NAME.json."""
    record_path = blobs.parent / f"{name}.json"
    if record_path.exists():
        record = LayerBlob(**json.loads(record_path.read_text()))
        if record.recipe == recipe and (blobs / record.digest.removeprefix("sha256:")).exists():
            return record
    _log(f"layer {name}: tar + gzip (pigz -p {jobs})")
    tar_path = blobs.parent / f"{name}.tar"
    gz_path = blobs.parent / f"{name}.tar.gz.partial"
    diff_id, tar_size = write_layer_tar(root, tar_path)
    with open(gz_path, "wb") as out:
        _run(["nice", "-n", "10", "pigz", "-n", "-6", "-p", str(jobs), "-c", str(tar_path)], f"gzip {name}", stdout=out)
    tar_path.unlink()
    digest, size = put_file(blobs, gz_path)
    record = LayerBlob(name=name, digest=digest, size=size, diff_id=diff_id, tar_size=tar_size, recipe=recipe)
    record_path.write_text(json.dumps(record.__dict__, indent=1))
    _log(f"layer {name}: {tar_size / 1e6:.0f} MB tar, {size / 1e6:.0f} MB gzip")
    return record


# --------------------------------------------------------------------------- the image


def write_layout(layout: Path, blobs: Path, layers: list[LayerBlob], tag: str) -> Image:
    """An OCI image layout at ``layout`` whose blobs are hard links to the cached ones (written whole in
    ``layout.partial`` and renamed into place; config, manifest and index by :func:`tests.support.oci.write_image`)."""
    partial = layout.with_name(layout.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    out_blobs = partial / "blobs" / "sha256"
    out_blobs.mkdir(parents=True)
    for layer in layers:
        os.link(blobs / layer.digest.removeprefix("sha256:"), out_blobs / layer.digest.removeprefix("sha256:"))
    refs = [LayerRef(MEDIA_LAYER_GZIP, layer.digest, layer.size, layer.diff_id, f"bootseer bench: {layer.name}")
            for layer in layers]
    built = write_image(partial, refs, tag=tag, cmd=["python3", "/app/train.py"], workdir="/app",
                        env=[f"PATH={CHROOT_PATH}", "LANG=C.UTF-8"], created="2026-01-01T00:00:00Z")
    shutil.rmtree(layout, ignore_errors=True)
    partial.rename(layout)
    return Image(layout=layout, tag=tag, manifest_digest=built.manifest_digest, layers=tuple(layers))


def build_image(cache_dir: Path = DEFAULT_CACHE_DIR, jobs: int = 2) -> Image:
    """Build (or reuse) the benchmark image under ``cache_dir``; needs root, debootstrap, pigz."""
    for tool in ("debootstrap", "pigz", "chroot"):
        if not shutil.which(tool):
            raise BuildError(f"{tool} not found (apt-get install debootstrap pigz)")
    layers_dir = cache_dir / "layers"
    blobs = layers_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    work = layers_dir / "work"
    base, python, torch, app = (layers_dir / n for n in ("base", "python", "torch", "app"))
    recipes = {"base": _key("debootstrap", SUITE, "minbase", DEBIAN_MIRROR)}
    recipes["python"] = _key(recipes["base"], PYTHON_STEP)
    recipes["torch"] = _key(recipes["python"], TORCH_STEP)
    recipes["app"] = _key(TRAIN_PY)
    # A step whose recipe changed is redone, and with it every step above it.
    stale = False
    for name, root in (("base", base), ("python", python), ("torch", torch)):
        marker = layers_dir / f"{name}.recipe"
        if stale or not root.is_dir() or not marker.exists() or marker.read_text() != recipes[name]:
            stale = True
            shutil.rmtree(root, ignore_errors=True)
            marker.unlink(missing_ok=True)
    started = time.monotonic()
    if not base.is_dir():
        debootstrap(base)
        (layers_dir / "base.recipe").write_text(recipes["base"])
    if not python.is_dir():
        _log("step python: apt-get install python3 python3-pip")
        run_step([base], python, PYTHON_STEP, work)
        (layers_dir / "python.recipe").write_text(recipes["python"])
    if not torch.is_dir():
        _log(f"step torch: pip install torch=={TORCH_VERSION}")
        run_step([python, base], torch, TORCH_STEP, work)
        (layers_dir / "torch.recipe").write_text(recipes["torch"])
    if not app.is_dir() or (app / "app" / "train.py").read_text() != TRAIN_PY:
        shutil.rmtree(app, ignore_errors=True)
        write_app(app)
    shutil.rmtree(work, ignore_errors=True)
    records = [make_blob(name, root, blobs, _key(recipes[name], TAR_WRITER_VERSION), jobs)
               for name, root in (("base", base), ("python", python), ("torch", torch), ("app", app))]
    wanted = {r.digest.removeprefix("sha256:") for r in records}
    for blob in blobs.iterdir():
        if blob.name not in wanted:  # a blob of an earlier recipe
            blob.unlink()
    layout = cache_dir / "oci"
    image_record = layout / "image.json"
    if image_record.exists():
        saved = json.loads(image_record.read_text())
        if saved["layers"] == [r.__dict__ for r in records]:
            return Image(layout=layout, tag=saved["tag"], manifest_digest=saved["manifest_digest"],
                         layers=tuple(records))
    image = write_layout(layout, blobs, records, IMAGE_TAG)
    image_record.write_text(json.dumps({"tag": image.tag, "manifest_digest": image.manifest_digest,
                                        "layers": [r.__dict__ for r in records]}, indent=1))
    _log(f"image {image.oci_ref}: {image.unpacked_bytes / 1e9:.2f} GB unpacked, "
         f"{image.compressed_bytes / 1e9:.2f} GB compressed, built in {time.monotonic() - started:.0f} s")
    return image


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help=f"(default {DEFAULT_CACHE_DIR})")
    parser.add_argument("--jobs", type=int, default=2, help="gzip threads (2)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("error: building the image needs root (debootstrap, chroot, overlay mounts)")
    try:
        image = build_image(args.cache_dir, args.jobs)
    except BuildError as e:
        sys.exit(f"error: {e}")
    for layer in image.layers:
        print(f"{layer.name:7} {layer.digest} {layer.size / 1e6:8.1f} MB gzip {layer.tar_size / 1e6:8.1f} MB tar")
    print(image.oci_ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
