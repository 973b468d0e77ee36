"""Publishing a hot list to a store: first writer wins, and removing one (``bootseer hotlist clear``).

Several nodes may boot an image for the first time at once, and each records a hot
list.  The first one published stays; the others find the name taken and drop
theirs (logged, counted).  A merge was considered and rejected: first touches from
different boots interleave differently, and a merged order is nobody's real order.

How "publish only if absent" is made atomic on each kind of store:

* **file** (a local or NFS directory): the object is written whole under a temp name
  (fsync), then ``link(2)``-ed to its name, which fails with EEXIST if the name
  exists: only one writer's link can succeed; the temp name is then removed.
* **S3**: ``PutObject`` with ``If-None-Match: *`` (S3's conditional write): S3
  answers 412 to every writer but the first.  A store that does not implement
  conditional writes (older S3-compatible servers answer 501 NotImplemented or
  ignore the header) falls back to check-then-put: a HEAD, then a plain PUT.  Two
  writers may then both see the name free; each PUT is atomic, so readers always
  see one whole, valid hot list (the last writer's), never a mix.  That race is
  what the fallback costs, and it is logged.
* **HDFS**: written under a temp name, then renamed without overwrite (the namenode
  refuses a rename onto an existing name).

Functions block (network and disk I/O): call them from a worker thread.
"""

from __future__ import annotations

import os
import uuid

from bootseer.blockstore.store import FileStoreWriter, HdfsStoreWriter, S3StoreWriter, StoreError, StoreWriter
from bootseer.log import get_logger

log = get_logger(__name__)


def publish_if_absent(writer: StoreWriter, name: str, data: bytes) -> bool:
    """Store ``data`` as ``name`` unless the name exists; True if this call published it.

    StoreError when the store fails.  The object appears whole or not at all.
    """
    if isinstance(writer, FileStoreWriter):
        return _publish_file(writer, name, data)
    if isinstance(writer, S3StoreWriter):
        return _publish_s3(writer, name, data)
    if isinstance(writer, HdfsStoreWriter):
        return _publish_hdfs(writer, name, data)
    # Any other writer: check then put (the race of the S3 fallback; see the module docstring).
    if writer.exists(name):
        return False
    writer.put(name, data)
    return True


def remove_object(writer: StoreWriter, name: str) -> bool:
    """Delete ``name`` from the store; True if it existed.  StoreError when the store fails."""
    if not writer.exists(name):
        return False
    if isinstance(writer, FileStoreWriter):
        try:
            writer.path(name).unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"{writer.display_url}: remove {name}: {exc.strerror}") from None
        return True
    if isinstance(writer, S3StoreWriter):
        try:
            writer.client.delete_object(Bucket=writer.bucket, Key=writer.source.key(name))
        except Exception as exc:
            raise writer._error("remove", name, exc) from None
        return True
    if isinstance(writer, HdfsStoreWriter):
        try:
            writer.client.delete(writer.source.hdfs_path(name))
        except Exception as exc:
            raise writer._error("remove", name, exc) from None
        return True
    raise StoreError(f"{writer.display_url}: this store cannot remove objects")


def _publish_file(writer: FileStoreWriter, name: str, data: bytes) -> bool:
    target = writer.path(name)
    temp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(temp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(temp, target)
        except FileExistsError:
            return False
        directory = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        writer.puts += 1
        writer.put_bytes += len(data)
        return True
    except OSError as exc:
        raise StoreError(f"{writer.root}: write {name}: {exc.strerror or exc}") from None
    finally:
        try:
            temp.unlink(missing_ok=True)
        except OSError:
            pass


def _publish_s3(writer: S3StoreWriter, name: str, data: bytes) -> bool:
    key = writer.source.key(name)
    try:
        writer.client.put_object(Bucket=writer.bucket, Key=key, Body=data, IfNoneMatch="*")
    except Exception as exc:
        response = getattr(exc, "response", {}) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return False
        if code in ("NotImplemented", "InvalidArgument", "InvalidRequest") or status == 501:
            log.warning("the S3 store does not do conditional writes; publishing with check-then-put "
                        "(two first boots at once may both write: the last whole list stays)",
                        store=writer.display_url, name=name, code=code)  # fmt: skip
            if writer.exists(name):
                return False
            writer.put(name, data)
            return True
        raise writer._error("write", name, exc) from None
    writer.puts += 1
    writer.put_bytes += len(data)
    return True


def _publish_hdfs(writer: HdfsStoreWriter, name: str, data: bytes) -> bool:
    target = writer.source.hdfs_path(name)
    parent, _, base = target.rpartition("/")
    temp = f"{parent}/.{base}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        writer.client.mkdirs(parent or "/", create_parent=True)
        out = writer.client.create(temp)
        try:
            out.write(data)
        finally:
            out.close()
        try:
            writer.client.rename(temp, target, overwrite=False)
        except Exception as exc:
            if writer.exists(name):
                return False
            raise writer._error("write", name, exc) from None
        writer.puts += 1
        writer.put_bytes += len(data)
        return True
    except StoreError:
        raise
    except Exception as exc:
        raise writer._error("write", name, exc) from None
    finally:
        try:
            writer.client.delete(temp)
        except Exception:  # noqa: BLE001 - renamed away (the usual case) or already reported
            pass


__all__ = ["publish_if_absent", "remove_object"]
