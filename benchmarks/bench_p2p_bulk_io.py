"""The bulk path's I/O in threads (mooncake/p2p/bulk.py, bulk_server.py) against the same I/O on the event loop
(``loop.sock_sendfile`` on the holder, ``loop.sock_recv_into`` on the fetcher, hashing and
writing each 1 MiB slice on the loop; in a thread, ``recv_into`` with or without ``MSG_WAITALL``), over loopback in one process pair: a holder process
serving one file of ``--size-mb`` MB in 16 MiB chunks, one connection, chunk after chunk, and
a fetcher that hashes (BLAKE3) and writes each slice into a reserved file. Median of
``--reps`` runs per variant, the variants interleaved; each run after ``sync``.

    flock /tmp/mooncake-cpu.lock .venv/bin/python benchmarks/bench_p2p_bulk_io.py [--size-mb 1000] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import blake3

CHUNK = 16 << 20
SLICE = 1 << 20


def holder(path: str, port_q: mp.Queue, on_loop: bool) -> None:
    async def main() -> None:
        srv = socket.create_server(("127.0.0.1", 0))
        srv.setblocking(False)
        port_q.put(srv.getsockname()[1])
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(srv)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            for off in range(0, size, CHUNK):
                n = min(CHUNK, size - off)
                if on_loop:
                    conn.setblocking(False)
                    await loop.sock_sendfile(conn, f, off, n, fallback=False)
                else:
                    conn.setblocking(True)

                    def send(off: int = off, n: int = n) -> None:
                        sent = 0
                        while sent < n:
                            sent += os.sendfile(conn.fileno(), f.fileno(), off + sent, n - sent)

                    await asyncio.to_thread(send)
        conn.close()

    asyncio.run(main())


def fetch(port: int, dest: str, size: int, on_loop: bool, waitall: bool) -> float:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        sock = socket.create_connection(("127.0.0.1", port))
        fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(fd, 0, size)
        buf = bytearray(SLICE)
        view = memoryview(buf)
        t0 = time.monotonic()

        def chunk_in_thread(off: int, n: int) -> None:
            h = blake3.blake3()
            pos = 0
            while pos < n:
                want, got = min(SLICE, n - pos), 0
                while got < want:
                    got += sock.recv_into(view[got:want], want - got, flags)
                h.update(view[:want])
                os.pwrite(fd, view[:want], off + pos)
                pos += want

        async def chunk_on_loop(off: int, n: int) -> None:
            h = blake3.blake3()
            pos = 0
            while pos < n:
                want, got = min(SLICE, n - pos), 0
                while got < want:
                    got += await loop.sock_recv_into(sock, view[got:want])
                h.update(view[:want])
                os.pwrite(fd, view[:want], off + pos)
                pos += want

        sock.setblocking(not on_loop)
        flags = socket.MSG_WAITALL if waitall else 0
        for off in range(0, size, CHUNK):
            if on_loop:
                await chunk_on_loop(off, min(CHUNK, size - off))
            else:
                await asyncio.to_thread(chunk_in_thread, off, min(CHUNK, size - off))
        dt = time.monotonic() - t0
        os.close(fd)
        sock.close()
        return dt

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    size = args.size_mb * 1000 * 1000
    work = Path(tempfile.mkdtemp(prefix="bench-bulk-io-"))
    src, dst = work / "src.bin", work / "dst.bin"
    with open(src, "wb") as f:
        block = os.urandom(4 << 20)
        for off in range(0, size, len(block)):
            f.write(block[: size - off])
    # name: (holder on the loop, fetcher on the loop, fetcher's recv_into waits for a whole slice)
    variants = {"threads (both ends), MSG_WAITALL": (False, False, True), "threads (both ends)": (False, False, False),
                "loop (both ends)": (True, True, False), "holder thread, fetcher loop": (False, True, False),
                "holder loop, fetcher thread": (True, False, False)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    ctx = mp.get_context("spawn")
    try:
        for _ in range(args.reps):
            for name, (holder_loop, fetcher_loop, waitall) in variants.items():
                dst.unlink(missing_ok=True)
                os.sync()
                q = ctx.Queue()
                p = ctx.Process(target=holder, args=(str(src), q, holder_loop))
                p.start()
                times[name].append(fetch(q.get(), str(dst), size, fetcher_loop, waitall))
                p.join()
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name} | {med:.2f} | {args.size_mb / med:.0f} | {', '.join(f'{t:.2f}' for t in ts)} |")
    finally:
        for p in (src, dst):
            p.unlink(missing_ok=True)
        work.rmdir()


if __name__ == "__main__":
    main()
