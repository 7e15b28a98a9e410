"""Building and checking manifests: an object's files, chunk table and checksums."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import blake3
import xxhash

from mooncake.protocol.p2p import FileEntry, Manifest, encoder

DEFAULT_CHUNK_BYTES = 16 << 20
MAX_FILES = 1 << 16  # files of one object
MAX_CHUNKS = 1 << 17  # chunks of one object (2 TiB at the default chunk size): checking a manifest costs the conductor ~20 ms
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,199}$")


class ObjectError(ValueError):
    """A P2P request that cannot be served; the message says why."""


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ObjectError(f"invalid object name {name!r}: letters, digits and . _ : @ + - (at most 200, "
                          f"starting with a letter or digit)")
    return name


@dataclass(frozen=True)
class Span:
    """Where chunk ``index`` lives: ``length`` bytes at ``offset`` of file ``file``."""

    index: int
    file: int
    offset: int
    length: int


def spans(m: Manifest) -> list[Span]:
    out = []
    for fi, f in enumerate(m.files):
        for off in range(0, f.size, m.chunk_bytes):
            out.append(Span(len(out), fi, off, min(m.chunk_bytes, f.size - off)))
    return out


def checksum(data: bytes | memoryview) -> int:
    """A chunk's fast checksum (xxh3_64): what a holder checks before serving it."""
    return xxhash.xxh3_64_intdigest(data)


def digest(data: bytes | memoryview) -> bytes:
    """A chunk's BLAKE3 (256 bits): what a fetcher checks before it counts the chunk. A cryptographic
    hash like SHA-256, at 2.5x its speed here (4.5 vs 1.7 GB/s on one core); it releases the GIL."""
    return blake3.blake3(data).digest()


def digester() -> "blake3.blake3":
    """An incremental ``digest``: ``update`` it slice by slice, then ``digest()``."""
    return blake3.blake3()


def source_files(path: Path, within: Path | None = None) -> tuple[Path, list[str]]:
    """(root, relative file paths) of a file or a directory tree (regular files, sorted; at most
    MAX_FILES). ``within``: a link in the tree that leads out of it is refused."""
    path = path.expanduser().resolve()
    if path.is_file():
        return path.parent, [path.name]
    if not path.is_dir():
        raise ObjectError(f"{path}: no such file or directory")
    rels = []
    for p in path.rglob("*"):
        if not p.is_file():
            continue
        if within is not None and not p.resolve().is_relative_to(within):
            raise ObjectError(f"{p} links to {p.resolve()}, outside this store's p2p_root ({within})")
        rels.append(p.relative_to(path).as_posix())
        if len(rels) > MAX_FILES:
            raise ObjectError(f"{path}: more than {MAX_FILES} files")
    if not rels:
        raise ObjectError(f"{path}: no files to publish")
    return path, sorted(rels)


def build_manifest(name: str, path: Path, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   within: Path | None = None) -> tuple[Path, Manifest]:
    """(root, manifest) of the file or directory at ``path``; reads every byte once (a blocking call:
    run it in a thread). ``within``: see ``source_files``."""
    check_name(name)
    root, rels = source_files(path, within)
    files, sums, digests = [], [], []
    for rel in rels:
        sha = hashlib.sha256()
        size = 0
        with open(root / rel, "rb", buffering=0) as fh:
            while chunk := fh.read(chunk_bytes):
                sha.update(chunk)
                sums.append(checksum(chunk))
                digests.append(digest(chunk))
                size += len(chunk)
        files.append(FileEntry(rel, size, sha.hexdigest()))
    version = content_version(name, chunk_bytes, files, sums, digests)
    return root, Manifest(name, version, chunk_bytes, files, sums, digests)


def content_version(name: str, chunk_bytes: int, files: list[FileEntry], sums: list[int], digests: list[bytes]) -> str:
    return hashlib.sha256(encoder.encode([name, chunk_bytes, files, sums, digests])).hexdigest()


def validate(m: Manifest) -> Manifest:
    """Refuse a manifest that is inconsistent or would write outside its destination."""
    check_name(m.name)
    if m.chunk_bytes < 4096:
        raise ObjectError(f"{m.name}: chunk size {m.chunk_bytes} too small")
    if len(m.files) > MAX_FILES:
        raise ObjectError(f"{m.name}: {len(m.files)} files, more than {MAX_FILES}")
    for f in m.files:
        p = PurePosixPath(f.path)
        if p.is_absolute() or ".." in p.parts or not f.path or "\\" in f.path or f.size < 0:
            raise ObjectError(f"{m.name}: unsafe file path {f.path!r}")
    n = sum(-(-f.size // m.chunk_bytes) for f in m.files)  # counted, not listed: a size may be anything
    if n > MAX_CHUNKS:
        raise ObjectError(f"{m.name}: {n} chunks of {m.chunk_bytes} bytes, more than {MAX_CHUNKS}")
    if len(m.checksums) != n or len(m.digests) != n or any(len(d) != 32 for d in m.digests):
        raise ObjectError(f"{m.name}: {len(m.checksums)} checksums and {len(m.digests)} BLAKE3 digests for {n} chunks")
    if content_version(m.name, m.chunk_bytes, m.files, m.checksums, m.digests) != m.version:
        raise ObjectError(f"{m.name}: version does not match its content description")
    return m


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    p = path
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize
