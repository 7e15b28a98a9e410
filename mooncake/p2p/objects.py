"""A store's P2P objects on disk.

Layout under ``data_dir/<store node id>/p2p/``: one record per object,
``<quoted name>.mpk`` (MessagePack: manifest, root directory, verified-chunk bitmap).
An object's files stay where they are: a published object is served in place from
the published path, a fetched one from its destination directory. Objects are pinned:
nothing evicts them; only ``forget`` (``mooncake p2p rm``) drops a record, never the files.

Every chunk is checked against its checksum when it is written, when it is served and
when a fetch resumes; a file is checked against its SHA-256 when its fetch completes.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path
from urllib.parse import quote

import msgspec

from mooncake.p2p.manifest import ObjectError, Span, checksum, file_sha256, free_bytes, spans, validate
from mooncake.p2p.messages import Manifest, bitmap, bits

log = logging.getLogger(__name__)


class Record(msgspec.Struct):
    manifest: Manifest
    root: str
    done: bytes


class ChunkCorrupt(ObjectError):
    """A chunk on disk no longer matches its checksum (the file changed under us)."""


class DiskFull(ObjectError):
    """Not enough space at the destination for the object."""


class LocalObject:
    """One object this store holds (completely or in part)."""

    def __init__(self, manifest: Manifest, root: Path, done: set[int] | None = None) -> None:
        self.manifest = manifest
        self.root = root
        self.spans: list[Span] = spans(manifest)
        self.done: set[int] = set(done or ())
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.spans)

    @property
    def done_bytes(self) -> int:
        return sum(self.spans[i].length for i in self.done)

    def path(self, file: int) -> Path:
        return self.root / self.manifest.files[file].path

    def _fd(self, file: int, write: bool) -> int:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                fd = os.open(self.path(file), os.O_RDWR if write else os.O_RDONLY)
                self._fds[file] = fd
            return fd

    def read_chunk(self, index: int) -> bytes:
        """The chunk's bytes, verified; ChunkCorrupt if they changed."""
        s = self.spans[index]
        data = os.pread(self._fd(s.file, False), s.length, s.offset)
        if len(data) != s.length or checksum(data) != self.manifest.checksums[index]:
            raise ChunkCorrupt(f"{self.name}: chunk {index} of {self.manifest.files[s.file].path} is corrupt on disk")
        return data

    def write_chunk(self, index: int, data: memoryview | bytes) -> bool:
        """Write a received chunk if it verifies; False (nothing written) if it does not."""
        s = self.spans[index]
        if len(data) != s.length or checksum(data) != self.manifest.checksums[index]:
            return False
        fd = self._fd(s.file, True)
        try:
            written = os.pwrite(fd, data, s.offset)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(f"{self.name}: disk full writing {self.path(s.file)}") from None
            raise
        if written != s.length:
            raise DiskFull(f"{self.name}: short write to {self.path(s.file)} (disk full?)")
        return True

    def prepare(self) -> None:
        """Create the destination files at full size (space reserved up front: a full disk is
        an error now, not halfway), keeping what is there, and find the chunks already on disk."""
        m = self.manifest
        need = 0
        for f in m.files:
            p = self.root / f.path
            need += max(0, f.size - (p.stat().st_size if p.exists() else 0))
        free = free_bytes(self.root)
        if need > free:
            raise DiskFull(f"{m.name}: needs {need} more bytes at {self.root}, only {free} free")
        for fi, f in enumerate(m.files):
            p = self.root / f.path
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size > f.size:
                    os.ftruncate(fd, f.size)
                if f.size:
                    os.posix_fallocate(fd, 0, f.size)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFull(f"{m.name}: no space for {p} ({f.size} bytes)") from None
                raise
            self._fds[fi] = fd
        self.done = self.verified_on_disk()

    def verified_on_disk(self) -> set[int]:
        """Chunks whose bytes on disk match their checksums (resume after an interruption)."""
        ok = set()
        for s in self.spans:
            p = self.path(s.file)
            if not p.exists() or p.stat().st_size < s.offset + s.length:
                continue
            try:
                self.read_chunk(s.index)
            except (ChunkCorrupt, OSError):
                continue
            ok.add(s.index)
        return ok

    def verify_files(self) -> None:
        """Every file against its SHA-256 (once complete)."""
        for fi, f in enumerate(self.manifest.files):
            if file_sha256(self.path(fi)) != f.sha256:
                raise ObjectError(f"{self.name}: {f.path} does not match its SHA-256 after the fetch")

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class ObjectStore:
    """The records of one store's objects (``directory``: data_dir/<node id>/p2p)."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.objects: dict[str, LocalObject] = {}

    def _record_path(self, name: str) -> Path:
        return self.dir / f"{quote(name, safe='')}.mpk"

    def load(self) -> list[LocalObject]:
        """Read every record; chunks are re-verified on disk (files may have changed while we were down)."""
        for p in sorted(self.dir.glob("*.mpk")):
            try:
                rec = msgspec.msgpack.decode(p.read_bytes(), type=Record)
                validate(rec.manifest)
            except (msgspec.DecodeError, msgspec.ValidationError, ObjectError) as e:
                log.warning("ignoring unreadable P2P record %s: %s", p, e)
                continue
            obj = LocalObject(rec.manifest, Path(rec.root))
            obj.done = obj.verified_on_disk()
            lost = len(bits(rec.done)) - len(obj.done)
            if lost > 0:
                log.warning("%s: %d chunks recorded as held no longer verify on disk", obj.name, lost)
            self.objects[obj.name] = obj
        return list(self.objects.values())

    def save(self, obj: LocalObject) -> None:
        rec = Record(obj.manifest, str(obj.root), bitmap(obj.done, len(obj.spans)))
        tmp = self._record_path(obj.name).with_suffix(".tmp")
        tmp.write_bytes(msgspec.msgpack.encode(rec))
        os.replace(tmp, self._record_path(obj.name))

    def add(self, obj: LocalObject) -> None:
        old = self.objects.get(obj.name)
        if old is not None and old is not obj:
            old.close()
        self.objects[obj.name] = obj
        self.save(obj)

    def forget(self, name: str) -> bool:
        obj = self.objects.pop(name, None)
        if obj is not None:
            obj.close()
        try:
            self._record_path(name).unlink()
        except FileNotFoundError:
            pass
        return obj is not None

    def close(self) -> None:
        for obj in self.objects.values():
            obj.close()
