"""Which prompt blocks recur: what the store's write admission goes by (``write_admission.py``).

A block hash is *sighted* when a request's prompt holds it. ``Sightings`` remembers the hashes of
recent requests in two Bloom filters, this generation's and the last one's: a generation ends after
``per_generation`` new hashes, so a hash is remembered for between one and two generations, in
fixed memory (two bit arrays of ``2**log2_bits`` bits, 8 MiB each by default), and a hash never
sighted reads as sighted only by a false positive (about 2 in 10,000 with both generations full).
Keys are block hashes (random bytes) or the simulator's block ids (small integers): the first 16
bytes of each are mixed to 64 bits and spread by multiplying with odd constants, in numpy, a
chain's blocks at once (a few microseconds for a thousand blocks).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F], dtype=np.uint64)  # the key's two halves to 64 bits
_SPREAD = np.array([0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD, 0x165667B19E3779F9], dtype=np.uint64)  # one per probe


class Sightings:
    def __init__(self, per_generation: int = 1 << 20, log2_bits: int = 26) -> None:
        self.per_generation = per_generation
        self._shift = np.uint64(64 - log2_bits)
        self._now = np.zeros(1 << (log2_bits - 3), dtype=np.uint8)
        self._before = np.zeros_like(self._now)
        self._added = 0  # new hashes this generation

    def seen_run(self, hashes: Sequence[bytes], record: bool = True) -> int:
        """How many leading ``hashes`` were sighted before (a chain's: its whole prefix recurs up to
        there); then, with ``record``, every one of them is recorded as sighted now."""
        if not len(hashes):
            return 0
        probes = self._probes(hashes)  # [n, 3] bit positions
        in_now = self._has(self._now, probes)
        seen = in_now | self._has(self._before, probes)
        run = int(np.argmin(seen)) if not seen.all() else len(hashes)
        if record:
            new = probes[~in_now]
            if self._added + len(new) > self.per_generation:
                self._before, self._now = self._now, np.zeros_like(self._now)
                self._added = 0
                new = probes
            np.bitwise_or.at(self._now, (new >> np.uint64(3)).astype(np.int64).ravel(),
                             (np.uint8(1) << (new & np.uint64(7)).astype(np.uint8)).ravel())
            self._added += len(new)
        return run

    def _probes(self, hashes: Sequence[bytes]) -> np.ndarray:
        raw = b"".join(bytes(h[:16]).ljust(16, b"\0") for h in hashes)
        halves = np.frombuffer(raw, dtype="<u8").reshape(-1, 2)
        x = (halves * _MIX).sum(axis=1, dtype=np.uint64)  # wraps mod 2**64, as meant
        return (x[:, None] * _SPREAD[None, :]) >> self._shift

    @staticmethod
    def _has(bits: np.ndarray, probes: np.ndarray) -> np.ndarray:
        got = bits[(probes >> np.uint64(3)).astype(np.int64)] >> (probes & np.uint64(7)).astype(np.uint8)
        return (got & 1).all(axis=1)
