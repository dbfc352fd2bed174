"""Content-addressed object store shared by the API and the workers.

Objects (uploaded modules, built libraries, reports) are named by the sha256 of their bytes, so a
job delivered twice, or two jobs with the same input, write the same object: harmless. Writes go
to a temporary file in the same filesystem and are published with ``os.replace``, so a reader
never sees a partial object. :class:`Store` is the narrow interface the rest of the code uses;
:class:`LocalStore` implements it on a directory (by default ``<STACKFUSE_DATA_DIR>/objects``),
and an object-store backend only has to provide the same methods.

Retention (:mod:`service.retention`) decides what is garbage by the age of an object's mtime:
a put of an object that is already there refreshes its mtime, so an object about to be
referenced by a new job record is young, and young objects are never collected.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1024 * 1024


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def is_sha256(text: str) -> bool:
    return bool(_SHA256.match(text))


@dataclass(frozen=True)
class StoredObject:
    sha256: str
    size: int
    mtime: float  # seconds since the epoch: when it was last put


class Store(Protocol):
    """What the service needs from a blob store: put, look up, read."""

    def put_bytes(self, data: bytes) -> str:
        """Store ``data``; return its sha256. Idempotent."""
        ...

    def put_file(self, path: Path) -> str:
        """Store a copy of the file at ``path``; return its sha256. Idempotent."""
        ...

    def exists(self, sha256: str) -> bool: ...

    def size(self, sha256: str) -> int: ...

    def open(self, sha256: str) -> BinaryIO:
        """Open an object for reading; ``FileNotFoundError`` if absent."""
        ...

    def local_path(self, sha256: str) -> Path | None:
        """A filesystem path of the object when the backend has one (lets a server use
        sendfile); ``None`` otherwise, and callers fall back to :meth:`open`."""
        ...

    def keep(self, sha256: str) -> bool:
        """Mark an existing object as just used (retention spares it); False if absent."""
        ...

    def objects(self) -> Iterator[StoredObject]:
        """Every stored object (for retention)."""
        ...

    def delete(self, sha256: str, *, older_than: float) -> bool:
        """Delete the object unless it was put or kept at or after ``older_than`` (epoch
        seconds); True when it was deleted."""
        ...


class LocalStore:
    """A :class:`Store` on a local (or shared network) directory: ``root/ab/cdef...``."""

    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self._tmp = self.root / "tmp"

    @classmethod
    def for_data_dir(cls, data_dir: Path, *, fsync: bool = True) -> LocalStore:
        return cls(Path(data_dir) / "objects", fsync=fsync)

    def _path(self, sha256: str) -> Path:
        if not is_sha256(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / sha256[:2] / sha256[2:]

    def _publish(self, tmp: Path, sha256: str) -> None:
        final = self._path(sha256)
        if self.keep(sha256):
            tmp.unlink(missing_ok=True)
            return
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)

    def _tempfile(self) -> tuple[int, Path]:
        self._tmp.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self._tmp, prefix="put-")
        return fd, Path(name)

    def put_bytes(self, data: bytes) -> str:
        sha = sha256_bytes(data)
        if self.keep(sha):
            return sha
        fd, tmp = self._tempfile()
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            self._publish(tmp, sha)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return sha

    def put_file(self, path: Path) -> str:
        h = hashlib.sha256()
        fd, tmp = self._tempfile()
        try:
            with os.fdopen(fd, "wb") as out, Path(path).open("rb") as src:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                if self.fsync:
                    out.flush()
                    os.fsync(out.fileno())
            sha = h.hexdigest()
            self._publish(tmp, sha)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return sha

    def exists(self, sha256: str) -> bool:
        return is_sha256(sha256) and self._path(sha256).is_file()

    def size(self, sha256: str) -> int:
        return self._path(sha256).stat().st_size

    def open(self, sha256: str) -> BinaryIO:
        return self._path(sha256).open("rb")

    def local_path(self, sha256: str) -> Path | None:
        path = self._path(sha256)
        return path if path.is_file() else None

    def keep(self, sha256: str) -> bool:
        if not is_sha256(sha256):
            return False
        try:
            os.utime(self._path(sha256))
        except FileNotFoundError:
            return False
        return True

    def objects(self) -> Iterator[StoredObject]:
        if not self.root.is_dir():
            return
        for shard in sorted(self.root.iterdir()):
            if len(shard.name) != 2 or not shard.is_dir():
                continue  # tmp/ and anything else that is not a shard
            for path in shard.iterdir():
                sha = shard.name + path.name
                if not is_sha256(sha):
                    continue
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                yield StoredObject(sha, st.st_size, st.st_mtime)

    def delete(self, sha256: str, *, older_than: float) -> bool:
        """Moved aside first, then its mtime read again: a put or :meth:`keep` that raced the
        decision has refreshed it, and the object is put back."""
        path = self._path(sha256)
        aside = path.with_name(f".{path.name}.gc-{os.getpid()}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return False
        if aside.stat().st_mtime >= older_than:
            os.replace(aside, path)  # a concurrent put wrote the same bytes, if anything
            return False
        aside.unlink()
        return True

    def stale_temporaries(self, older_than: float) -> Iterator[Path]:
        """Half-written puts of processes that died (``tmp/put-*``) older than ``older_than``."""
        if not self._tmp.is_dir():
            return
        for path in self._tmp.iterdir():
            try:
                if path.stat().st_mtime < older_than:
                    yield path
            except FileNotFoundError:
                continue
