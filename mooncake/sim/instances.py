"""Virtual instances: what each simulated prefill, decode, colocated and store instance holds.

They keep the KV index current as their caches change (as the real roles do with
their stored/removed events). Timing is the simulator's business.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mooncake.protocol import NodeInfo
from mooncake.sched.node_registry import Node
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.plan import Plan
from mooncake.sim.block_lru import Inserted, LRUBlocks
from mooncake.sim.workload import SimRequest


def virtual_node(node_id: str, role: str, machine: str, step_tokens: int = 0) -> Node:
    endpoints = {"store": f"sim://{node_id}"} if role == "store" else {}
    return Node(node_id, role, b"", endpoints, NodeInfo(node_name=machine, pid=0, step_tokens=step_tokens),
                last_seen=0.0)


def queue_by_rank(queue: deque, item: Any, rank_of: Callable[[Any], int]) -> None:
    """Queue ``item`` behind every item of its rank or a lower one (ahead of the rest)."""
    i, key = len(queue), rank_of(item)
    while i and rank_of(queue[i - 1]) > key:
        i -= 1
    queue.insert(i, item)


class StoreInstance:
    """A store node: a DRAM tier over an LMDB tier (on SSD), LRU each; eviction from DRAM demotes,
    a read from LMDB promotes; tiers are exclusive (the tier names are the live store's)."""

    def __init__(self, node: Node, index: KVIndex, dram_blocks: int, lmdb_blocks: int) -> None:
        self.node = node
        self.index = index
        self.dram = LRUBlocks(dram_blocks)
        self.lmdb = LRUBlocks(lmdb_blocks)

    def tier_of(self, h: bytes) -> str | None:
        if h in self.dram:
            return "dram"
        if h in self.lmdb:
            return "lmdb"
        return None

    def put(self, hashes: Sequence[bytes], flex: bool = False) -> None:
        """Write blocks to DRAM (touching those held there), demoting what falls out; ``flex``:
        for a flex request (its blocks displace only other flex blocks)."""
        ins = self.dram.insert(hashes, flex)
        if len(self.lmdb):
            for h in ins.added:  # a block written again moves up: tiers are exclusive
                self.lmdb.discard(h)
        if ins.added:
            self.index.add(self.node.node_id, "dram", ins.added)
        self._demote(ins)

    def read(self, h: bytes, flex: bool = False) -> None:
        """A prefill instance read ``h`` (for a flex request or another): touch it, promoting it
        from LMDB to DRAM."""
        if self.dram.touch(h, flex):
            return
        if h in self.lmdb:
            self.put([h], flex and self.lmdb.is_flex(h))

    def _demote(self, ins: Inserted) -> None:
        """DRAM's evictions go to LMDB (flex ones as flex); what neither tier holds leaves the index."""
        if not ins.evicted:
            return
        node_id = self.node.node_id
        flex = set(ins.evicted_flex)
        gone: list[bytes] = []
        for group, is_flex in ((ins.evicted_flex, True), ([h for h in ins.evicted if h not in flex], False)):
            if group:
                moved = self.lmdb.insert(group, is_flex)
                if moved.added:
                    self.index.add(node_id, "lmdb", moved.added)
                gone += moved.evicted + group
        gone = [h for h in dict.fromkeys(gone) if h not in self.lmdb and h not in self.dram]
        if gone:
            self.index.remove(node_id, gone)


@dataclass
class Prefiller:
    """What an instance that computes prompts holds: its device prefix cache, the store beside it."""

    node: Node
    cache: LRUBlocks  # device prefix cache
    store: StoreInstance | None  # the store on the same machine

    def cache_blocks(self, index: KVIndex, hashes: Sequence[bytes], flex: bool = False) -> None:
        ins = self.cache.insert(hashes, flex)
        if ins.added:
            index.add(self.node.node_id, "device", ins.added)
        if ins.evicted:
            index.remove(self.node.node_id, ins.evicted)


@dataclass
class PrefillInstance(Prefiller):
    queue: deque = field(default_factory=deque)  # (request, plan) in arrival order
    busy_s: float = 0.0
    job: tuple | None = None  # the prefill computing now (None: idle): (request, plan, n_new, cached, compute_s, work_s, start)
    work_left: float = 0.0  # of the job, in seconds at the instance's own speed
    work_since: float = 0.0  # when work_left was last brought up to date
    version: int = 0  # invalidates the end event scheduled before a change of speed


@dataclass
class DecodeSeq:
    req_id: str
    remaining: float  # tokens still to generate
    kv_tokens: float  # KV it holds now (grows by one per token)
    reserved: int  # KV tokens reserved for it (prompt + output)
    rank: int = 1  # its class's (``sched/request_class.py``): waiting sequences join by it, then arrival


@dataclass
class DecodeInstance:
    """A decode instance's continuous batch. Between membership changes every step takes
    the same time, so the batch advances analytically from one change to the next."""

    node: Node
    kv_capacity: int
    max_batch: int
    active: dict[str, DecodeSeq] = field(default_factory=dict)
    waiting: deque = field(default_factory=deque)  # DecodeSeq waiting for KV room or a batch slot
    kv_reserved: int = 0
    step_s: float = 0.0
    updated_at: float = 0.0
    version: int = 0  # invalidates the completion event scheduled before a change

    def fits(self, seq: DecodeSeq) -> bool:
        if not self.active:  # an empty instance takes anything (a prompt larger than its pool runs alone)
            return True
        return len(self.active) < self.max_batch and self.kv_reserved + seq.reserved <= self.kv_capacity

    def advance(self, now: float, gaps: list[tuple[float, float]]) -> None:
        """Generate the tokens of the steps since the last update; records (step, count) gaps."""
        dt = now - self.updated_at
        self.updated_at = now
        if dt <= 0 or not self.active or self.step_s <= 0:
            return
        steps = dt / self.step_s
        gaps.append((self.step_s, steps * len(self.active)))
        for s in self.active.values():
            s.remaining -= steps
            s.kv_tokens += steps

    def retire_finished(self) -> list[str]:
        """Take the sequences that have no token left out of the batch, their KV with them;
        returns their request ids."""
        done = [s for s in self.active.values() if s.remaining <= 1e-6]
        for seq in done:
            del self.active[seq.req_id]
            self.kv_reserved -= seq.reserved
        return [seq.req_id for seq in done]


@dataclass
class Prompt:
    req: SimRequest
    plan: Plan
    cached: int  # prompt tokens reused
    n_new: int  # prompt tokens to compute
    reserved: int  # KV tokens reserved for the request
    done: int = 0  # tokens computed so far
    compute_s: float = 0.0  # its share of the steps' time, by tokens (what the live engine reports)
    ready: bool = False  # its prefix is loaded: its chunks may run


@dataclass
class ColocatedInstance(Prefiller):
    """A colocated instance's state (its steps: ``colocated_steps.py``)."""

    batch: DecodeInstance  # its decoding sequences, its KV reservations (prompts' too), its step time
    step_tokens: int  # tokens per step while it decodes
    queue: deque = field(default_factory=deque)  # (request, plan) waiting for KV room, by class
    prompts: list[Prompt] = field(default_factory=list)  # reserved, not yet prefilled, in order
    carrying: list[tuple[Prompt, int]] = field(default_factory=list)  # the step under way's chunks ([]: none)
    running: bool = False  # a step (or a run of decode steps) is under way
    own_step_s: float = 0.0  # that step's time at the instance's own speed
    step_started: float = 0.0
    work_left: float = 0.0  # of a step with chunks, in seconds at the instance's own speed
    work_since: float = 0.0  # when work_left was last brought up to date
    version: int = 0  # invalidates the boundary event scheduled before a change
