"""The persistent tier interface: a tier whose blocks outlive the process (LMDB), below the memory
tiers. ``Placement`` and ``Durability`` use it, and only it, for what memory tiers do not do:
staged writes flushed in batches, and write-through copies of blocks held above it.

A store has at most one persistent tier, its last (``Placement`` refuses others): every block
held above it can move down into it (shutdown), and a hit in it can leave its record as the copy.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Sequence

from .base import StoredBlock, Tier


class PersistentTier(Tier):
    """A ``Tier`` on a durable medium. ``put`` may stage a record that ``flush`` writes; a
    write-through *copy* is a record of a block held in a tier above (it counts in ``used_bytes``,
    not in ``keys()``)."""

    map_full: int  # writes refused because the medium was full (a failed flush then shrinks capacity)

    @abstractmethod
    def flush(self) -> list[tuple[bytes, StoredBlock]]:
        """Write the staged records in one transaction; those that could not be written (their
        accounting undone), to be placed elsewhere or dropped."""

    @abstractmethod
    def reserve_copy(self, key: bytes, nbytes: int) -> bool:
        """Account a copy whose record ``write_records`` writes outside the store's lock; False if
        it does not fit (or ``key`` is here already)."""

    @abstractmethod
    def write_records(self, items: list[tuple[bytes, StoredBlock]]) -> Exception | None:
        """Write reserved copies' records (no accounting: may run without the store's lock); the error, if any."""

    @abstractmethod
    def end_copies(self, keys: list[bytes], error: Exception | None) -> None:
        """Settle reserved copies after ``write_records``: a failed write un-accounts them."""

    @abstractmethod
    def to_copy(self, key: bytes) -> None:
        """A resident block moving up (promotion) leaves its record here as its copy."""

    @abstractmethod
    def drop_copy(self, key: bytes) -> int:
        """Forget ``key``'s copy (its block left the store); the bytes freed."""

    @property
    @abstractmethod
    def copy_bytes(self) -> int:
        """Bytes accounted to copies."""


def persistent_index(tiers: Sequence[Tier]) -> int | None:
    """The index of ``tiers``' persistent tier, None without one. Refuses a second persistent tier,
    and one above a memory tier."""
    found = [i for i, t in enumerate(tiers) if isinstance(t, PersistentTier)]
    if len(found) > 1:
        raise ValueError(f"a store has at most one persistent tier, got {[tiers[i].name for i in found]}")
    if found and found[0] != len(tiers) - 1:
        raise ValueError(f"the persistent tier {tiers[found[0]].name!r} must be the store's last")
    return found[0] if found else None
