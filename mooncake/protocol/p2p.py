"""P2P messages (``mooncake.p2p``'s: MessagePack, tagged like every mooncake message; torch-free,
like the package's import, so that the ``mooncake p2p`` command starts without torch).

Peers and the CLI talk to a store's P2P socket; the conductor answers the metadata
queries (``Locate``, ``ListObjects``, ``FindStore``, ...) from any key-holder, registered or
not. Chunk bytes travel as one raw frame after a ``ChunkData`` header, zero-copy.
"""

from __future__ import annotations

import msgspec


class P2PMsg(msgspec.Struct, tag_field="t", omit_defaults=True):
    """Base of the P2P messages (same tag field as ``mooncake.protocol.Msg``)."""


class FileEntry(msgspec.Struct, array_like=True, frozen=True):
    path: str  # relative, "/"-separated
    size: int
    sha256: str  # hex


class Manifest(msgspec.Struct, frozen=True):
    """What an object is: its files, chunking and checksums. ``version`` is the SHA-256 of
    everything else: two manifests with the same name and version are the same content.

    Each chunk has two checksums: its BLAKE3 (``digests``, a cryptographic hash), which a fetcher checks before it
    writes the chunk, so that every byte written is bound to ``version`` cryptographically; and
    its xxh3 (``checksums``), which a holder checks, at memory speed, before it serves the chunk
    (to notice a file that changed on its disk)."""

    name: str
    version: str
    chunk_bytes: int
    files: list[FileEntry]
    checksums: list[int]  # xxh3_64 per chunk, chunks of each file in file order
    digests: list[bytes]  # BLAKE3 per chunk (32 bytes each), same order

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class Holder(msgspec.Struct, frozen=True):
    node_id: str
    node_name: str
    endpoint: str  # the holder store's P2P socket
    chunks: bytes  # bitmap: bit i of byte i // 8 (LSB first) set when chunk i is held, verified


# ---- store / CLI / worker -> conductor (metadata)


class Publish(P2PMsg, tag="p2p_publish"):
    """``node_id`` holds all of ``manifest``. Same name with another version: an error."""

    node_id: str
    manifest: Manifest


class Have(P2PMsg, tag="p2p_have"):
    """``node_id`` holds these verified chunks of ``name``@``version`` (``replace``: exactly these)."""

    node_id: str
    name: str
    version: str
    chunks: list[int]
    replace: bool = False


class Fetching(P2PMsg, tag="p2p_fetching"):
    """``node_id`` is fetching these chunks of ``name`` now (replaces what it said before): other
    fetchers prefer chunks nobody is fetching, so that the seed sends each chunk about once."""

    node_id: str
    name: str
    chunks: list[int]


class Locate(P2PMsg, tag="p2p_locate"):
    name: str


class Located(P2PMsg, tag="p2p_located"):
    manifest: Manifest
    holders: list[Holder]
    fetching: list[int] = []  # per chunk: how many stores are fetching it now


class ListObjects(P2PMsg, tag="p2p_list"):
    pass


class ObjectInfo(msgspec.Struct, frozen=True):
    name: str
    version: str
    total_bytes: int
    chunks: int
    holders: dict[str, int]  # node name -> chunks held


class Listing(P2PMsg, tag="p2p_listing"):
    objects: list[ObjectInfo]


class RemoveObject(P2PMsg, tag="p2p_remove"):
    """Forget ``name`` cluster-wide: the conductor drops it and tells its holders to stop serving it."""

    name: str


class FindStore(P2PMsg, tag="p2p_find_store"):
    """The P2P endpoint of the store on node ``node_name``."""

    node_name: str


class StoreAt(P2PMsg, tag="p2p_store_at"):
    node_id: str
    endpoint: str


class Done(P2PMsg, tag="p2p_done"):
    """Generic success reply."""

    message: str = ""


class Failure(P2PMsg, tag="p2p_failure"):
    """Generic error reply; ``code`` for callers that branch on it."""

    message: str
    code: str = "error"


# ---- conductor -> store (over its conductor link)


class Forget(P2PMsg, tag="p2p_forget"):
    name: str
    term: int = 0  # the leader's term (``term_fence.py``); 0: no election


# ---- CLI / worker -> its node's store (P2P socket)


class PutObject(P2PMsg, tag="p2p_put"):
    """Publish the file or directory at ``path`` (on the store's machine) as ``name``; served in place."""

    name: str
    path: str
    key: str = ""  # the node key (mooncake/p2p/node_access.py)


class GetObject(P2PMsg, tag="p2p_get"):
    """Fetch ``name`` into directory ``dest`` (in the background; poll with ``Progress``)."""

    name: str
    dest: str
    only_from: list[str] = []  # node names to fetch from; empty: every holder
    key: str = ""  # the node key (mooncake/p2p/node_access.py)


class Progress(P2PMsg, tag="p2p_progress"):
    """How a fetch goes; with ``wait_s`` the answer waits up to that long for the fetch to end."""

    name: str
    wait_s: float = 0.0
    key: str = ""  # the node key (mooncake/p2p/node_access.py)


class ProgressReport(P2PMsg, tag="p2p_progress_report"):
    name: str
    version: str
    done_bytes: int
    total_bytes: int
    state: str  # "fetching" | "complete" | "failed"
    error: str = ""
    peers: dict[str, int] = {}  # holder node name -> bytes fetched from it
    verify_s: float = 0.0  # of the fetch's time: the final check of the files (sizes) once every chunk is in
    transfer_s: float = 0.0  # of the fetch's time: from its first chunk request to its last chunk written
    bulk_bytes: int = 0  # of done_bytes: received on holders' bulk ports (the rest over ZeroMQ)


# ---- peer -> peer (P2P socket)


class ChunkGet(P2PMsg, tag="p2p_chunk_get"):
    """``bulk``: the asker would take the bytes on the holder's bulk port (clusters without CURVE)."""

    req: int
    name: str
    version: str
    index: int
    bulk: bool = False


class ChunkData(P2PMsg, tag="p2p_chunk"):
    """Reply to ChunkGet: the chunk's bytes follow as one frame; ``missing`` (no frame): not served
    here; ``token`` (no frame): fetch them from the holder's bulk port ``bulk_port`` with this
    one-time token (mooncake/p2p/bulk.py)."""

    req: int
    index: int
    missing: str = ""
    token: bytes = b""
    bulk_port: int = 0


class ChunkBad(P2PMsg, tag="p2p_chunk_bad"):
    """Peer -> holder, no reply: a chunk it sent on its bulk port failed its digest (the holder,
    which sent it without reading it, checks its copy on disk)."""

    name: str
    version: str
    index: int


P2PMessage = (Publish | Have | Fetching | Locate | Located | ListObjects | Listing | RemoveObject | FindStore | StoreAt
              | Done | Failure | Forget | PutObject | GetObject | Progress | ProgressReport | ChunkGet | ChunkData | ChunkBad)

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(P2PMessage)


def bitmap(chunks: list[int] | set[int], n: int) -> bytes:
    out = bytearray((n + 7) // 8)
    for i in chunks:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def bits(bm: bytes) -> list[int]:
    return [i for i in range(len(bm) * 8) if bm[i >> 3] >> (i & 7) & 1]
