"""A store's P2P objects on disk.

Layout under ``data_dir/<store node id>/p2p/``: one record per object,
``<quoted name>.mpk`` (MessagePack: manifest, root directory, verified-chunk bitmap).
An object's files stay where they are: a published object is served in place from
the published path, a fetched one from its destination directory. Objects are pinned:
nothing evicts them; only ``forget`` (``mooncake p2p rm``) drops a record, never the files.

A fetcher checks every chunk against its BLAKE3 digest (cryptographic) before it counts it
(done, announced, served), and so every chunk it finds on disk when a fetch resumes. A
received chunk is hashed and written in one pass, slice by slice (``WRITE_SLICE``): each
slice is written while it is still in the CPU's cache, where hashing the whole chunk and then
writing it read it from memory twice (the dearest step of a fetch after the socket: BENCHMARKS.md
section 18). A chunk that fails its digest is not counted and is asked again, and its good copy
overwrites it; a fetch that ends before it does leaves the chunk uncounted, and a resumed fetch
checks it again. Each byte of a file lies in exactly one chunk, the files are created at their
exact sizes, and the chunk digests are part of what the object's version (a SHA-256) covers:
once every chunk is in, each file is the published one (its SHA-256 in the manifest) without
reading it again, short of a collision in BLAKE3; the fetch ends with a check of the sizes. A holder checks each chunk
against its xxh3 (far cheaper) before serving it, and when it reloads its records: that
catches a file changed on its disk, and the fetcher's check catches anything else.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator
from urllib.parse import quote

import msgspec

from mooncake.p2p.manifest import ObjectError, Span, checksum, digest, digester, free_bytes, spans, validate
from mooncake.protocol.p2p import Manifest, bitmap, bits

log = logging.getLogger(__name__)
WRITE_SLICE = 1 << 20  # bytes hashed then written at a time: well within a core's cache


class Record(msgspec.Struct):
    manifest: Manifest
    root: str
    done: bytes


class ChunkCorrupt(ObjectError):
    """A chunk on disk no longer matches its checksum (the file changed under us)."""


class NotHeld(ObjectError):
    """The object was dropped (``mooncake p2p rm``, or replaced) while a read or write was asked."""


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
        self._io = threading.Condition()  # guards the fds; close() waits for reads and writes under way
        self._active = 0
        self._closed = False
        self._writing = threading.Lock()  # one pwrite at a time (see write_slices)

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

    @contextmanager
    def _fd(self, file: int, write: bool) -> Iterator[int]:
        """The file's descriptor, held open until the block ends (``close`` waits: a descriptor
        closed under a read or write could be reused by another file before the call lands)."""
        with self._io:
            if self._closed:
                raise NotHeld(f"{self.name} is no longer held here")
            fd = self._fds.get(file)
            if fd is None:
                fd = os.open(self.path(file), os.O_RDWR if write else os.O_RDONLY)
                self._fds[file] = fd
            self._active += 1
        try:
            yield fd
        finally:
            with self._io:
                self._active -= 1
                self._io.notify_all()

    def read_chunk(self, index: int, strong: bool = False) -> bytes:
        """The chunk's bytes, checked against its xxh3 (``strong``: its BLAKE3 digest); ChunkCorrupt if
        they do not match."""
        s = self.spans[index]
        with self._fd(s.file, False) as fd:
            data = os.pread(fd, s.length, s.offset)
        ok = len(data) == s.length and (digest(data) == self.manifest.digests[index] if strong
                                        else checksum(data) == self.manifest.checksums[index])
        if not ok:
            raise ChunkCorrupt(f"{self.name}: chunk {index} of {self.manifest.files[s.file].path} is corrupt on disk")
        return data

    @contextmanager
    def span_fd(self, index: int) -> Iterator[tuple[int, Span]]:
        """A descriptor of the file chunk ``index`` lies in, and its span (to serve it with
        ``sendfile``: mooncake/p2p/bulk_server.py); NotHeld once the object is dropped."""
        s = self.spans[index]
        with self._fd(s.file, False) as fd:
            yield fd, s

    def write_chunk(self, index: int, data: memoryview | bytes) -> bool:
        """Write a received chunk, hashing it on the way; True if it matches its BLAKE3 digest.
        False: a short chunk (nothing written) or a wrong one (written, but not to be counted: the
        caller asks for it again, and the next copy overwrites it)."""
        s = self.spans[index]
        if len(data) != s.length:
            return False
        view = memoryview(data).cast("B")
        return self.write_slices(index, (view[start:start + WRITE_SLICE] for start in range(0, s.length, WRITE_SLICE)))

    def write_slices(self, index: int, slices: Iterable[memoryview]) -> bool:
        """Write chunk ``index`` from consecutive ``slices`` (each hashed, then written while it is
        still in cache); True if they make up the whole chunk and match its BLAKE3 digest. An
        exception from ``slices`` (a stream cut off) propagates; what was written stays uncounted."""
        s = self.spans[index]
        h = digester()
        pos = 0
        try:
            with self._fd(s.file, True) as fd:
                for part in slices:
                    if pos + len(part) > s.length:
                        return False
                    h.update(part)
                    with self._writing:  # the kernel serializes writes to a file anyway (its inode lock),
                        n = os.pwrite(fd, part, s.offset + pos)  # but its waiters spin: here they sleep
                    if n != len(part):
                        raise DiskFull(f"{self.name}: short write to {self.path(s.file)} (disk full?)")
                    pos += len(part)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(f"{self.name}: disk full writing {self.path(s.file)}") from None
            raise
        return pos == s.length and h.digest() == self.manifest.digests[index]

    def prepare(self) -> None:
        """Create the destination files at full size (space reserved up front: a full disk is
        an error now, not halfway), keeping what is there, and find the chunks already on disk."""
        m = self.manifest
        need = 0
        before: dict[int, int] = {}  # file -> bytes it held before: only these can hold chunks already
        root = self.root.resolve()
        for fi, f in enumerate(m.files):
            p = self.root / f.path
            if not p.resolve().is_relative_to(root):  # a link already there must not lead the write out
                raise ObjectError(f"{m.name}: {p} leads outside {self.root} (a link): not written")
            before[fi] = p.stat().st_size if p.is_file() else 0
            need += max(0, f.size - before[fi])
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
            with self._io:
                closed, kept = self._closed, not self._closed and fi not in self._fds
                if kept:
                    self._fds[fi] = fd
            if not kept:
                os.close(fd)
            if closed:
                raise NotHeld(f"{m.name} is no longer held here")
        self.done = self.verified_on_disk(before, strong=True)

    def verified_on_disk(self, sizes: dict[int, int] | None = None, strong: bool = False) -> set[int]:
        """Chunks whose bytes on disk match their xxh3 (``strong``: their BLAKE3 digest), among those
        that lie within ``sizes[file]`` bytes (default: the files' sizes now). A fetch resumes
        from the chunks that match their digests in what its files held before it reserved them."""
        ok = set()
        for s in self.spans:
            if sizes is not None:
                have = sizes.get(s.file, 0)
            else:
                p = self.path(s.file)
                have = p.stat().st_size if p.is_file() else 0
            if have < s.offset + s.length:
                continue
            try:
                self.read_chunk(s.index, strong)
            except (ChunkCorrupt, OSError):
                continue
            ok.add(s.index)
        return ok

    def verify_files(self) -> None:
        """Once every chunk is in: each file has its size (its bytes were each checked against
        their chunk's digest when written, see the module's docstring)."""
        for fi, f in enumerate(self.manifest.files):
            size = self.path(fi).stat().st_size
            if size != f.size:
                raise ObjectError(f"{self.name}: {f.path} is {size} bytes after the fetch, not {f.size}")

    def close(self) -> None:
        """Close the files once the reads and writes under way have ended; later ones raise NotHeld."""
        with self._io:
            self._closed = True
            self._io.wait_for(lambda: self._active == 0)
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

    def load(self, within: Path) -> list[LocalObject]:
        """Read every record; chunks are re-verified on disk (files may have changed while we were down).
        A record of an object outside ``within`` (the store's p2p_root now) is left unserved."""
        for p in sorted(self.dir.glob("*.mpk")):
            try:
                rec = msgspec.msgpack.decode(p.read_bytes(), type=Record)
                validate(rec.manifest)
            except (msgspec.DecodeError, msgspec.ValidationError, ObjectError) as e:
                log.warning("ignoring unreadable P2P record %s: %s", p, e)
                continue
            if not Path(rec.root).resolve().is_relative_to(within):
                log.warning("not serving P2P object %s: %s is outside p2p_root (%s)", rec.manifest.name, rec.root,
                            within)
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
