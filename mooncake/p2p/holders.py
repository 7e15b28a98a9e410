"""The holders one fetch pulls an object's chunks from: each holder's connection and what is in
flight to it, the set of holders connected and banned, and which chunk to ask of which holder.

Depth: each holder gets at most ``in_flight_per_peer`` chunk requests at a time, twice that
once it delivers at ``FAST_HOLDER_BYTES_PER_S`` or more (on a fast link the holder's read of
the next chunk takes about as long as the last one's transfer: with more requests queued it
reads ahead and the link never waits; on a slow link more requests would only commit more
chunks to that holder, where another could soon serve them). Choice: a free slot goes to the
least-loaded holder first, and asks it for the rarest chunk it has (fewest holders; ties in an
order random per fetch, so that concurrent fetchers start on different chunks and soon serve
each other).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Iterator

import zmq
import zmq.asyncio

from mooncake.p2p.bulk import BulkLink
from mooncake.protocol.p2p import Holder, bits
from mooncake.sockets import limit_message_size, recv_multipart

FAST_HOLDER_BYTES_PER_S = 100e6  # a holder delivering this or more gets twice the requests in flight


@dataclass(eq=False)
class Peer:
    """One holder as a fetch sees it: its sockets, the chunks it has, the requests in flight to it."""

    node_id: str
    name: str
    endpoint: str
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    chunks: set[int] = field(default_factory=set)
    in_flight: dict[int, tuple[int, float]] = field(default_factory=dict)  # req -> (chunk, sent at)
    bad: set[int] = field(default_factory=set)  # chunks that failed verification from this peer
    last_reply: float = 0.0
    tasks: list[asyncio.Task] = field(default_factory=list)
    rate: float = 0.0  # bytes/s this holder delivers (moving average; 0 until its first chunk)
    bulk: BulkLink | None = None  # its bulk port (None: every chunk over ZeroMQ)

    def delivered(self, nbytes: int, sent_at: float, now: float) -> None:
        """A chunk of ``nbytes`` asked at ``sent_at`` arrived ``now``: its link was busy with it
        since the later of its request and the last reply (requests queue behind each other)."""
        busy = max(now - max(sent_at, self.last_reply), 1e-6)
        sample = nbytes / busy
        self.rate = sample if self.rate == 0.0 else 0.5 * (self.rate + sample)
        self.last_reply = now

    def close(self) -> None:
        """Close its sockets and bulk link; its chunks in flight are forgotten (wanted again)."""
        for t in self.tasks:
            t.cancel()
        self.in_flight.clear()
        if self.bulk is not None:
            self.bulk.close()
        self.monitor.close(0)
        self.sock.close(0)


def open_peer(ctx: zmq.asyncio.Context, curve: object | None, node_id: str, name: str, endpoint: str,
              max_message: int, bulk: BulkLink | None, events: asyncio.Queue) -> Peer:
    """Connect to a holder; its replies arrive on ``events`` as ``(peer, frames)``, a disconnection
    (or a refused connection: its process is gone) as ``(peer, None)``, so that its chunks go
    elsewhere at once."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    limit_message_size(sock, max_message)
    if curve is not None:
        curve.client(sock, "store")  # type: ignore[attr-defined]
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
    sock.connect(endpoint)
    peer = Peer(node_id, name, endpoint, sock, monitor, last_reply=time.monotonic(), bulk=bulk)

    async def read() -> None:
        while True:
            events.put_nowait((peer, await recv_multipart(sock)))

    async def watch() -> None:
        await recv_multipart(monitor)  # disconnected, or a connection attempt failed
        events.put_nowait((peer, None))

    peer.tasks = [asyncio.create_task(read()), asyncio.create_task(watch())]
    return peer


class Holders:
    """The holders a fetch is connected to (``peers``, by node id), and those it keeps away for a while."""

    def __init__(self, ctx: zmq.asyncio.Context, curve: object | None, max_message: int, events: asyncio.Queue,
                 bulk_timeout_s: float | None) -> None:
        """``events``: where every holder's replies arrive (``open_peer``); ``bulk_timeout_s``: the
        timeout of each holder's bulk link (None: no bulk, every chunk over ZeroMQ)."""
        self.ctx, self.curve, self.max_message, self.events = ctx, curve, max_message, events
        self.bulk_timeout_s = bulk_timeout_s
        self.peers: dict[str, Peer] = {}
        self.banned: dict[str, float] = {}  # node id -> until when (disconnected or silent)

    def current(self, peer: Peer) -> bool:
        """``peer`` is still connected (not dropped since)."""
        return self.peers.get(peer.node_id) is peer

    def in_flight(self) -> set[int]:
        return {c for p in self.peers.values() for c, _ in p.in_flight.values()}

    def update(self, holders: list[Holder], own_node_id: str, only_from: set[str]) -> None:
        """Follow the conductor's holder list: connect to new holders (not this store, not banned, among
        ``only_from`` if given), reconnect those that moved, drop those gone; refresh what each holds."""
        now = time.monotonic()
        seen = set()
        for h in holders:
            if h.node_id == own_node_id or self.banned.get(h.node_id, 0) > now or \
                    (only_from and h.node_name not in only_from):
                continue
            seen.add(h.node_id)
            peer = self.peers.get(h.node_id)
            if peer is not None and peer.endpoint != h.endpoint:  # restarted elsewhere
                self.drop(peer)
                peer = None
            if peer is None:
                bulk = BulkLink(h.endpoint, self.bulk_timeout_s, h.node_name) if self.bulk_timeout_s is not None else None
                peer = self.peers[h.node_id] = open_peer(self.ctx, self.curve, h.node_id, h.node_name, h.endpoint,
                                                         self.max_message, bulk, self.events)
            peer.chunks = set(bits(h.chunks))
        for node_id in set(self.peers) - seen:
            self.drop(self.peers[node_id])

    def drop(self, peer: Peer) -> None:
        """Close a holder's sockets; its chunks in flight become wanted again."""
        peer.close()
        if self.current(peer):
            del self.peers[peer.node_id]

    def ban(self, peer: Peer, seconds: float) -> None:
        """Drop a holder and ignore it in the holder list for ``seconds``."""
        self.banned[peer.node_id] = time.monotonic() + seconds
        self.drop(peer)

    def close(self) -> None:
        for p in list(self.peers.values()):
            self.drop(p)


def in_flight_for(peer: Peer, base: int) -> int:
    """Chunk requests to keep in flight to ``peer``: ``base``, twice that on a fast link."""
    return 2 * base if peer.rate >= FAST_HOLDER_BYTES_PER_S else base


def choose_requests(peers: list[Peer], wanted: list[int], others_fetching: list[int], rank: dict[int, int],
                    base: int) -> Iterator[tuple[Peer, int]]:
    """The requests that fill the holders' free slots, one at a time: ``(holder, chunk)``, least-loaded
    holder first, the rarest chunk it has first (a chunk other stores are fetching, ``others_fetching``,
    counts as held by them: it soon is; ties by ``rank``). The caller sends each before the next."""
    holders = {c: others_fetching[c] if c < len(others_fetching) else 0 for c in wanted}
    for p in peers:
        for c in p.chunks:
            if c in holders:
                holders[c] += 1
    wanted_set = set(wanted)
    while wanted_set:
        free = [p for p in peers if len(p.in_flight) < in_flight_for(p, base)]
        free.sort(key=lambda p: len(p.in_flight))
        for peer in free:
            cands = [c for c in wanted_set if c in peer.chunks and c not in peer.bad]
            if cands:
                chunk = min(cands, key=lambda c: (holders[c], rank[c]))
                yield peer, chunk
                wanted_set.discard(chunk)
                break
        else:
            return
