"""LMDB tier: blocks on SSD, one LMDB record per block (``lmdb_record.py``), verified on every read.

A record whose header or checksum does not check out is deleted, counted in
``corrupt`` and reported as a miss. The environment's ``map_size`` is the byte
capacity plus headroom (LMDB page overhead, free pages not yet reusable); the
capacity itself is enforced here by counting tensor bytes. ``put`` stages a
block (accounted at once) and ``flush`` writes everything staged in one write
transaction; the store flushes at the end of each operation, and runs its
operations off the event loop. Reads use ``buffers=True`` and make exactly one
copy, from the map into a fresh tensor. Commits are not fsync'ed
(``sync=False``): data survives a process crash, not a power loss; ``close`` syncs.

Write-through copies (``[store] ssd_admission = "write_through"``): besides its
own (resident) blocks the tier holds durable copies of blocks that live in a
tier above. A copy takes disk space (counted in ``used_bytes``) but is not a
resident block: when its block is demoted here ``put`` adopts the copy without
writing, when its block leaves the store the store drops the copy. After a
crash every record on disk is recovered as a resident block.

Faults, none of which stops the store: the directory is locked for one store
(``dir_lock.py``; a second store fails at start); an environment LMDB cannot
open or read is moved aside (``data.mdb`` -> ``data.mdb.corrupt-<UTC time>``)
and the tier starts empty; a write that hits the map size (``map_full``) or the
disk (no space, I/O error: ``write_errors``) fails soft: ``flush`` returns the
resident blocks it could not write, and the store evicts and retries, or drops.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import lmdb

from .base import StoredBlock, checked_capacity
from .dir_lock import DirLock
from .lmdb_record import CorruptRecord, decode_record, encode_record, parse_header
from .persistent import PersistentTier

log = logging.getLogger(__name__)
MiB = 1 << 20
CORRUPT_ENV_ERRORS = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError,
                      lmdb.VersionMismatchError, lmdb.PanicError, lmdb.IncompatibleError)


class LmdbTier(PersistentTier):
    name = "lmdb"

    def __init__(self, path: str | Path, capacity_bytes: int, headroom: float = 0.25,
                 map_bytes: int | None = None) -> None:
        """``map_bytes`` overrides the LMDB map size (tests of a full map)."""
        self.capacity_bytes, self.used_bytes = checked_capacity(capacity_bytes), 0
        self.path = Path(path).expanduser()
        self.map_size = map_bytes or int(capacity_bytes * (1 + headroom)) + 64 * MiB
        self.corrupt = 0  # records that failed their check (deleted)
        self.map_full = 0  # writes that hit the map size
        self.write_errors = 0  # writes that failed otherwise (disk full, I/O error)
        self.moved_aside: Path | None = None  # where a corrupt environment went
        self._sizes: dict[bytes, int] = {}  # resident blocks
        self._copies: dict[bytes, int] = {}  # write-through copies of blocks held above
        self._pending: dict[bytes, StoredBlock] = {}  # staged records (resident or copy)
        self._writing: set[bytes] = set()  # copies reserved, their records being written unlocked
        self.lock = DirLock(self.path)
        try:
            self.env = self._open_and_recover()
        except BaseException:
            self.lock.release()
            raise

    # ---- opening, recovery, corruption

    def _open(self) -> lmdb.Environment:
        return lmdb.open(str(self.path), map_size=self.map_size, subdir=True, sync=False,
                         metasync=False, readahead=False, max_dbs=0)

    def _open_and_recover(self) -> lmdb.Environment:
        env = None
        try:
            env = self._open()
            self._recover(env)
            return env
        except CORRUPT_ENV_ERRORS as e:
            if env is not None:
                env.close()
            self._sizes.clear()
            self.used_bytes = 0
            self.moved_aside = self._move_aside()
            log.error("LMDB environment in %s is corrupt (%s: %s): moved aside to %s; this store starts empty",
                      self.path, type(e).__name__, e, self.moved_aside)
            return self._open()

    def _move_aside(self) -> Path:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        for name in ("lock.mdb", "data.mdb"):
            f = self.path / name
            if f.exists():
                f.rename(self.path / f"{name}.corrupt-{stamp}")
        return self.path / f"data.mdb.corrupt-{stamp}"

    def _recover(self, env: lmdb.Environment) -> None:
        bad = []
        with env.begin(buffers=True) as txn:
            for k, v in txn.cursor():
                try:  # headers only: the data is verified when read
                    hdr, _ = parse_header(v)
                except CorruptRecord:
                    bad.append(bytes(k))
                    continue
                self._sizes[bytes(k)] = hdr.nbytes
                self.used_bytes += hdr.nbytes
        if bad:
            with env.begin(write=True) as txn:
                for k in bad:
                    txn.delete(k)
            self.corrupt += len(bad)

    # ---- writes

    def put(self, key: bytes, block: StoredBlock) -> bool:
        if key in self._copies:  # the write-through copy becomes the block: nothing to write
            self._sizes[key] = self._copies.pop(key)
            if key in self._writing:  # ...unless its record may not be there yet: write it again
                self._pending[key] = block
            return True
        n = block.nbytes
        self.delete(key)
        if not self.fits(n):
            return False
        self._pending[key] = block
        self._sizes[key] = n
        self.used_bytes += n
        return True

    def flush(self) -> list[tuple[bytes, StoredBlock]]:
        """Write the staged records in one transaction. Returns the resident blocks that could
        not be written (map full, disk full: no longer held here); failed copies are dropped."""
        if not self._pending:
            return []
        items, self._pending = list(self._pending.items()), {}
        try:
            with self.env.begin(write=True) as txn:
                for key, block in items:
                    txn.put(key, encode_record(block))
            return []
        except lmdb.MapFullError:
            self.map_full += 1
            log.warning("LMDB map of %s is full (%d bytes): %d blocks not written", self.path, self.map_size,
                        len(items))
        except lmdb.Error as e:  # no space left, I/O error: fail soft, serving goes on
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 100 == 0:
                log.error("LMDB write to %s failed (%s: %s), %d times so far: %d blocks not written",
                          self.path, type(e).__name__, e, self.write_errors, len(items))
        failed = []
        for key, block in items:
            if key in self._sizes:
                self.used_bytes -= self._sizes.pop(key)
                failed.append((key, block))
            elif key in self._copies:
                self.used_bytes -= self._copies.pop(key)
        return failed

    def _delete_records(self, keys: list[bytes]) -> None:
        try:
            with self.env.begin(write=True) as txn:
                for k in keys:
                    txn.delete(k)
        except lmdb.Error as e:  # the records stay on disk: a restart finds them again (still valid)
            self.write_errors += 1
            log.error("LMDB delete in %s failed (%s: %s)", self.path, type(e).__name__, e)

    def delete(self, key: bytes) -> int:
        return self._drop(self._sizes, key)

    def _drop(self, held: dict[bytes, int], key: bytes) -> int:
        """Forget ``key`` from ``held`` (resident blocks or copies) and delete its record."""
        n = held.pop(key, None)
        if n is None:
            return 0
        self.used_bytes -= n
        if self._pending.pop(key, None) is None:
            self._delete_records([key])
        return n

    # ---- write-through copies

    def reserve_copy(self, key: bytes, nbytes: int) -> bool:
        """Account a copy whose record ``write_records`` writes outside the store's lock;
        ``end_copies`` settles it. False if it does not fit."""
        if key in self._sizes or key in self._copies or not self.fits(nbytes):
            return False
        self._copies[key] = nbytes
        self._writing.add(key)
        self.used_bytes += nbytes
        return True

    def write_records(self, items: list[tuple[bytes, StoredBlock]]) -> Exception | None:
        """Encode and write records in one transaction; touches no accounting, so it may run
        without the store's lock (LMDB serialises write transactions). The error, if any."""
        try:
            with self.env.begin(write=True) as txn:
                for key, block in items:
                    txn.put(key, encode_record(block))
            return None
        except lmdb.Error as e:
            return e

    def end_copies(self, keys: list[bytes], error: Exception | None) -> None:
        """Settle reserved copies after ``write_records``: a failed write un-accounts them; a
        record whose block left the store meanwhile is deleted."""
        if error is not None:
            self.map_full += isinstance(error, lmdb.MapFullError)
            self.write_errors += not isinstance(error, lmdb.MapFullError)
            log.error("LMDB write-through to %s failed (%s: %s): %d copies not written", self.path,
                      type(error).__name__, error, len(keys))
        orphans = []
        for key in keys:
            self._writing.discard(key)
            if error is not None and key in self._copies:
                self.used_bytes -= self._copies.pop(key)
            elif error is None and key not in self._copies and key not in self._sizes:
                orphans.append(key)
        if orphans:
            self._delete_records(orphans)

    def has_copy(self, key: bytes) -> bool:
        return key in self._copies

    def to_copy(self, key: bytes) -> None:
        """A resident block moving up (promotion) leaves its record here as its copy."""
        n = self._sizes.pop(key, None)
        if n is not None:
            self._copies[key] = n

    def drop_copy(self, key: bytes) -> int:
        return self._drop(self._copies, key)

    @property
    def copy_bytes(self) -> int:
        return sum(self._copies.values())

    # ---- reads

    def get(self, key: bytes) -> StoredBlock | None:
        staged = self._pending.get(key)
        if staged is not None:
            return staged
        if key not in self._sizes:
            return None
        with self.env.begin(buffers=True) as txn:
            v = txn.get(key)
            block = None if v is None else decode_record(v)
        if block is None:
            self.corrupt += 1
            self.delete(key)
        return block

    def contains(self, key: bytes) -> bool:
        return key in self._sizes

    def nbytes_of(self, key: bytes) -> int | None:
        return self._sizes.get(key)

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._sizes))

    def __len__(self) -> int:
        return len(self._sizes)

    def close(self) -> None:
        self.flush()
        self.env.sync(True)
        self.env.close()
        self.lock.release()
