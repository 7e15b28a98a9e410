"""Which prompt blocks recur: what the store's write admission goes by (``write_admission.py``).

A block hash is *sighted* when a request's prompt holds it. ``Sightings`` remembers the hashes of
recent requests in two Bloom filters, this generation's and the last one's: a generation ends after
``per_generation`` new hashes, so a hash is remembered for between one and two generations, in
fixed memory (two bit arrays of ``bits``), and a hash never sighted reads as sighted only by a
false positive (about 1 in 10,000 at a full generation with the defaults). Keys are block hashes
(random bytes) or the simulator's block ids (small integers): each is folded to 61 bits and spread
by multiplying with odd constants, so both land uniformly.
"""

from __future__ import annotations

from typing import Sequence

_MASK = (1 << 64) - 1
_PRIME = (1 << 61) - 1  # folds a key's first 16 bytes to 61 bits
_SPREAD = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9)  # odd 64-bit constants, one per probe


class Sightings:
    def __init__(self, per_generation: int = 1 << 20, log2_bits: int = 26) -> None:
        self.per_generation = per_generation
        self._shift = 64 - log2_bits
        self._now = bytearray(1 << (log2_bits - 3))
        self._before = bytearray(len(self._now))
        self._added = 0  # new hashes this generation

    def seen_run(self, hashes: Sequence[bytes], record: bool = True) -> int:
        """How many leading ``hashes`` were sighted before (a chain's: its whole prefix recurs up to
        there); then, with ``record``, every one of them is recorded as sighted now."""
        probes = [self._probes(h) for h in hashes]
        run = 0
        for ps in probes:
            if not (self._has(self._now, ps) or self._has(self._before, ps)):
                break
            run += 1
        for ps in probes if record else ():
            if not self._has(self._now, ps):
                self._add(ps)
        return run

    @staticmethod
    def _has(bits: bytearray, probes: list[int]) -> bool:
        return all(bits[p >> 3] >> (p & 7) & 1 for p in probes)

    def _probes(self, h: bytes) -> list[int]:
        x = int.from_bytes(h[:16], "little") % _PRIME
        return [((x * m) & _MASK) >> self._shift for m in _SPREAD]

    def _add(self, probes: list[int]) -> None:
        if self._added >= self.per_generation:
            self._before, self._now = self._now, bytearray(len(self._now))
            self._added = 0
        for p in probes:
            self._now[p >> 3] |= 1 << (p & 7)
        self._added += 1
