"""Paged KV cache bookkeeping: reference-counted blocks and the device prefix cache.

The pool tensor is ``[num_blocks, num_layers, 2, num_kv_heads, block_tokens, head_dim]``
(one block = ``pool[i]``, index 0 = K after RoPE, 1 = V). One layer of a run of blocks,
``pool[blocks, layer]`` = ``[n, 2, num_kv_heads, block_tokens, head_dim]``, is what layer-wise
transfer moves (``mooncake/kv/layers.py``). ``BlockManager`` knows nothing of tensors: it owns which
block holds what.

Every block is in exactly one of three states:

- free: holds nothing (``free`` deque),
- cached: holds a full block keyed by its chained hash, referenced by nobody;
  evictable, kept in LRU order (OrderedDicts, oldest first: O(1) touch/evict) in one of three
  segments: ``flex_lru``, the blocks only flex requests (``sched/request_class.py``) have
  held since they were cached; ``session_lru``, the blocks a request of a session left kept
  until a time (its ``Sampling.keep_s`` after its turn, ``[classes] session_ttl_s``), in that
  order; and ``lru``, every other one. Eviction empties ``flex_lru`` first, then ``lru``,
  then ``session_lru``, so a flex scan of unique prompts displaces other flex blocks, never an
  interactive prefix, while flex work is cached at all, and a session's prefix outlives
  everything but other sessions' until its time is up (then it is the oldest of ``lru``),
  or until the tenant that kept it last keeps more than ``session_blocks_per_key`` blocks (its
  oldest kept ones then become the oldest of ``lru``: ``keepers``, ``mooncake/tenant_quota.py``),
- referenced: ``ref[b] > 0`` (a sequence or an in-flight import uses it); it may
  also be keyed in the prefix cache.

Invariant: ``len(free) + len(lru) + len(flex_lru) + len(session_lru) + #referenced == num_blocks``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Callable

import torch

from mooncake.blocks import BlockHash
from mooncake.deadline_heap import DeadlineHeap
from mooncake.tenant_quota import TenantQuota

BlockEventFn = Callable[[str, list[BlockHash]], None]


def allocate_pool(num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """Zeroed so that padding reads in attention are finite (masked to weight 0)."""
    return torch.zeros((num_blocks, *block_shape), dtype=dtype, device=device)


class BlockManager:
    def __init__(self, num_blocks: int, on_event: Callable[[], BlockEventFn | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, session_blocks_per_key: int = 0,
                 session_share_per_key: float = 0.0) -> None:
        """``session_blocks_per_key``, ``session_share_per_key`` (of ``num_blocks``): what one tenant
        may keep at once (``tenant_quota.py``; 0: no limit)."""
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash_of: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self.free: deque[int] = deque(range(num_blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.flex_lru: OrderedDict[int, None] = OrderedDict()
        self.flex: set[int] = set()  # blocks held only by flex requests since they were allocated
        self.session_lru: OrderedDict[int, None] = OrderedDict()  # soonest to expire first
        self.kept_until: dict[int, float] = {}  # blocks a session keeps (referenced ones too): until when
        self.keepers: TenantQuota[int] = TenantQuota(session_blocks_per_key, session_share_per_key)  # of kept_until: whose
        self.keepers.capacity = num_blocks
        self._deadlines: DeadlineHeap[int] = DeadlineHeap(
            lambda b, until: b in self.session_lru and self.kept_until.get(b) == until)  # else: released or kept longer since
        self.evicted = {"flex": 0, "other": 0, "session": 0}  # cached blocks evicted, by segment
        self._on_event = on_event
        self._clock = clock

    # ------------------------------------------------------------ queries

    def num_available(self) -> int:
        return len(self.free) + self.num_cached()

    def num_cached(self) -> int:
        """Unreferenced cached blocks (evictable)."""
        return len(self.lru) + len(self.flex_lru) + len(self.session_lru)

    def num_referenced(self) -> int:
        return self.num_blocks - self.num_available()

    def cached_prefix(self, hashes: list[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    # ------------------------------------------------------------ changes

    def allocate(self, n: int, flex: bool = False) -> list[int] | None:
        """``n`` blocks with ref 1, evicting least recently used cached blocks (flex ones first);
        None if impossible. ``flex``: for a flex request."""
        if n > self.num_available():
            return None
        self.expire_sessions()
        out: list[int] = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                segment = "flex" if self.flex_lru else "other" if self.lru else "session"
                b, _ = self._segment(b=None, name=segment).popitem(last=False)
                self._stop_keeping(b)
                self.evicted[segment] += 1
                h = self.hash_of[b]
                assert h is not None
                del self.cached[h]
                self.hash_of[b] = None
                evicted.append(h)
            self.ref[b] = 1
            if flex:
                self.flex.add(b)
            else:
                self.flex.discard(b)
            out.append(b)
        if evicted:
            self._emit("removed", evicted)
        return out

    def acquire(self, hashes: list[BlockHash], flex: bool = False) -> list[int]:
        """Take a reference on the cached blocks of ``hashes`` (all must be present); ``flex``:
        for a flex request (a block any other request takes is no longer flex)."""
        blocks = [self.cached[h] for h in hashes]  # all present, or nothing is taken
        taken = 0
        try:
            for b in blocks:
                if self.ref[b] == 0:
                    self._segment(b).pop(b)
                self.ref[b] += 1
                taken += 1
                if not flex:
                    self.flex.discard(b)
        except BaseException:
            self.release(blocks[:taken])  # no reference left behind
            raise
        return blocks

    def register(self, blocks: list[int], hashes: list[BlockHash]) -> int:
        """Key referenced, full blocks in the prefix cache; one "stored" event. A hash already
        cached elsewhere leaves its block unkeyed (it returns to the free list when released).
        Returns how many were keyed."""
        stored: list[BlockHash] = []
        for b, h in zip(blocks, hashes):
            if h in self.cached or self.hash_of[b] is not None:
                continue
            self.cached[h] = b
            self.hash_of[b] = h
            stored.append(h)
        if stored:
            self._emit("stored", stored)
        return len(stored)

    def touch(self, blocks: list[int]) -> None:
        """Mark unreferenced cached blocks as most recently used (a session's stay in expiry order)."""
        for b in blocks:
            if b in self.lru:
                self.lru.move_to_end(b)
            elif b in self.flex_lru:
                self.flex_lru.move_to_end(b)

    def release(self, blocks: list[int], keep_s: float = 0.0, tenant: str = "") -> None:
        """Drop one reference on each; in reverse, so a chain's leading blocks are evicted last.
        ``keep_s``: the cached ones a request of a session leaves are kept that long (evicted
        after every block no session keeps, until then), by ``tenant`` (the sender's)."""
        now = self._clock()
        until = now + keep_s if keep_s > 0 else 0.0
        for b in reversed(blocks):
            r = self.ref[b]
            if r <= 0:
                raise RuntimeError("block %d released more often than referenced" % b)
            self.ref[b] = r - 1
            if r > 1:  # another holder releases it last: the session's time goes with the block
                if until and self.hash_of[b] is not None:
                    self.kept_until[b] = max(until, self.kept_until.get(b, 0.0))
                    self._keep(b, tenant)
            else:
                kept = max(until, self.kept_until.pop(b, 0.0))
                if self.hash_of[b] is not None and kept > now:
                    self.flex.discard(b)
                    self.session_lru[b] = None
                    self.kept_until[b] = kept
                    self._deadlines.push(b, kept, len(self.session_lru))
                    if until:  # else kept by whoever kept it before
                        self._keep(b, tenant)
                    continue
                self.keepers.drop(b)
                if self.hash_of[b] is None:
                    self.flex.discard(b)
                    self.free.append(b)
                elif b in self.flex:
                    self.flex_lru[b] = None
                else:
                    self.lru[b] = None

    def _keep(self, b: int, tenant: str) -> None:
        """``tenant`` keeps ``b`` (in ``kept_until``); its oldest kept blocks past its quota become
        ordinary: an unreferenced one the oldest of ``lru`` (as if its time were up)."""
        for old in self.keepers.keep(b, tenant):
            del self.kept_until[old]
            if old in self.session_lru:
                del self.session_lru[old]
                self.lru[old] = None
                self.lru.move_to_end(old, last=False)

    def _stop_keeping(self, b: int) -> None:
        self.kept_until.pop(b, None)
        self.keepers.drop(b)

    def forget(self, hashes: list[BlockHash]) -> int:
        """Drop the unreferenced cached blocks of ``hashes`` from the prefix cache (they become
        free); one "removed" event. Referenced or absent ones are left alone. Returns how many."""
        removed: list[BlockHash] = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None or self.ref[b]:
                continue
            self._segment(b).pop(b)
            self._stop_keeping(b)
            del self.cached[h]
            self.flex.discard(b)
            self.hash_of[b] = None
            self.free.append(b)
            removed.append(h)
        if removed:
            self._emit("removed", removed)
        return len(removed)

    def check(self) -> None:
        """Assert the accounting invariant (tests)."""
        referenced = sum(1 for r in self.ref if r > 0)
        assert len(self.free) + self.num_cached() + referenced == self.num_blocks
        assert all(self.ref[b] == 0 and self.hash_of[b] is None for b in self.free)
        assert all(self.ref[b] == 0 and self.hash_of[b] is not None
                   for b in (*self.lru, *self.flex_lru, *self.session_lru))
        assert not set(self.lru) & set(self.flex_lru) and set(self.flex_lru) <= self.flex
        assert not set(self.session_lru) & (set(self.lru) | self.flex) and set(self.session_lru) <= set(self.kept_until)
        assert all(b in self.session_lru or self.ref[b] for b in self.kept_until)
        self.keepers.check(self.kept_until)  # each kept block has one owner; none past its quota
        assert not self.flex & set(self.free)
        assert all(self.hash_of[b] == h for h, b in self.cached.items())
        assert len(set(self.free)) == len(self.free) and not set(self.free) & set(self.lru)

    def _segment(self, b: int | None, name: str = "") -> OrderedDict:
        """The LRU segment holding cached block ``b`` (or the one ``name``d)."""
        if name == "flex" or b in self.flex_lru:
            return self.flex_lru
        return self.session_lru if name == "session" or b in self.session_lru else self.lru

    def expire_sessions(self) -> None:
        """Blocks whose session's time is up join ``lru`` as its oldest."""
        expired = []
        for b in self._deadlines.due(self._clock()):
            del self.session_lru[b], self.kept_until[b]
            self.keepers.drop(b)
            expired.append(b)
        for b in reversed(expired):
            self.lru[b] = None
            self.lru.move_to_end(b, last=False)

    def _emit(self, kind: str, hashes: list[BlockHash]) -> None:
        fn = self._on_event()
        if fn is not None:
            fn(kind, hashes)
