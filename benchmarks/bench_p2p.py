"""P2P object distribution across network namespaces (needs root: ip netns, tc).

Four hosts on a bridge, a conductor on host1 and a store on each (mooncake/testing/p2p_hosts.py),
CURVE on every link. One object of ``--size-mb`` MB (one file) is published on host1.

Capped (every host's egress at ``--rate``, tc tbf; on the CURVE cluster, or with ``--capped-plain``
on the plain-TCP one, where chunks go over the bulk ports), ``--reps`` rounds of:
  single   host2 fetches the object alone from the seed;
  seed     hosts 2, 3, 4 fetch at the same time, each only from the seed (``--from host1``);
  p2p      hosts 2, 3, 4 fetch at the same time from every holder (fetchers serve each other).
Between fetches the object is removed and published again (no copies left over).

Uncapped: host2 fetches from host1 alone (CURVE, and plain TCP on a second cluster started
with ``allow_insecure_network``), against a raw TCP socket copy of the same file between
the same two namespaces (``sendfile`` into a socket, ``recv_into`` + write to a file on the
same file system, reserved first with ``posix_fallocate`` as a fetch reserves its files). The
two run in pairs, back to back, the order alternating, each from the same state: the last
copy's file deleted and ``sync`` (no copy pays for the last one's writeback); the ratio is
the median over the pairs of raw / P2P (this machine's other load changes from minute to
minute, not within a pair), also given per order (raw first, P2P first).
A fetch's time runs from the request to the store's report that it is complete (every chunk
checked against its BLAKE3 digest, the files' sizes at the end); its transfer, from its first chunk
request to its last chunk written, is reported too. On the plain-TCP cluster the chunk bytes go
over the holders' bulk ports (mooncake/p2p/bulk.py; the share is reported), under CURVE over ZeroMQ.

    flock /tmp/mooncake-cpu.lock .venv/bin/python benchmarks/bench_p2p.py [--size-mb 300] [--rate 200mbit] \
        [--reps 3] [--uncapped-only] [--capped-plain] [--in-flight N] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mooncake.bench.publish import publish
from mooncake.testing.p2p_hosts import P2PHosts

RECEIVER = """
import os, socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1); print("ready", flush=True)
conn, _ = srv.accept(); t0 = time.monotonic(); buf = bytearray(16 << 20); view = memoryview(buf); total = 0
with open(sys.argv[3], "wb", buffering=0) as f:
    os.posix_fallocate(f.fileno(), 0, int(sys.argv[4]))  # reserved first, as a fetch does
    while (n := conn.recv_into(buf)):
        f.write(view[:n]); total += n
print(total, time.monotonic() - t0, flush=True)
"""
SENDER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
t0 = time.monotonic()
with open(sys.argv[3], "rb") as f:
    s.sendfile(f)
s.close()
"""


def write_object(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    block = os.urandom(4 << 20)
    with open(path, "wb") as f:
        for off in range(0, size, len(block)):
            f.write((off.to_bytes(8, "little") + block[8:])[: size - off])


async def fetch(net: P2PHosts, hosts: list[int], dest: Path, only_seed: bool, reports: list | None = None) -> float:
    """Seconds until every host has the object; ``reports`` gets each fetch's final ProgressReport."""
    clients = [net.client(i) for i in hosts]
    t0 = time.monotonic()
    try:
        got = await asyncio.gather(*(c.get("obj", dest / f"host{i}", only_from=["host1"] if only_seed else None)
                                     for c, i in zip(clients, hosts)))
        if reports is not None:
            reports.extend(got)
        return time.monotonic() - t0
    finally:
        for c in clients:
            c.close()


def republish(net: P2PHosts, src: Path, dest: Path) -> None:
    """Remove the object everywhere and publish it again from host1 alone; fresh destinations."""
    net.cli(1, "rm", "obj")
    r = net.cli(1, "put", "obj", str(src))
    if r.returncode != 0:
        raise SystemExit(f"put failed: {r.stderr}")
    shutil.rmtree(dest, ignore_errors=True)


def raw_tcp_copy(net: P2PHosts, src: Path, dest: Path) -> tuple[float, float]:
    """(seconds from starting the sender to the receiver's last byte written, of which from its
    connection accepted to its last byte written)."""
    h1, h2 = net.hosts[1], net.hosts[2]
    port = 5999
    recv = subprocess.Popen(["ip", "netns", "exec", h2.ns, sys.executable, "-c", RECEIVER, h2.address, str(port),
                             str(dest), str(src.stat().st_size)], stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        subprocess.run(["ip", "netns", "exec", h1.ns, sys.executable, "-c", SENDER, h2.address, str(port), str(src)],
                       check=True)
        got, transfer = recv.stdout.readline().split()
        dt = time.monotonic() - t0
        assert int(got) == src.stat().st_size, got
        return dt, float(transfer)
    finally:
        recv.kill()
        recv.wait()
        dest.unlink(missing_ok=True)


def settle() -> None:
    """Write back every dirty page now, so that no copy pays for the previous one's writeback."""
    os.sync()


def paired(net: P2PHosts, src: Path, work: Path, reps: int) -> list[dict[str, float]]:
    """``reps`` pairs of (raw TCP copy, P2P fetch) host1 -> host2, back to back, the order
    alternating. Each copy starts from the same state: the last copy's file deleted (the
    fetched object removed first, so that the store closes it) and every dirty page written
    back. Per pair: raw, raw_transfer, p2p, p2p_transfer (seconds), ratio (raw / p2p, from
    starting each copy) and raw_first (1.0 when the raw copy went first)."""
    pairs = []
    for rep in range(reps):
        got: dict[str, float] = {"raw_first": 1.0 if rep % 2 == 0 else 0.0}
        for what in (("raw", "p2p") if rep % 2 == 0 else ("p2p", "raw")):
            if what == "raw":
                settle()
                got["raw"], got["raw_transfer"] = raw_tcp_copy(net, src, work / "raw.bin")
            else:
                republish(net, src.parent, work / "dst")
                settle()
                reports: list = []
                got["p2p"] = asyncio.run(fetch(net, [2], work / "dst", only_seed=True, reports=reports))
                got["p2p_transfer"] = reports[0].transfer_s
                got["p2p_bulk"] = reports[0].bulk_bytes / src.stat().st_size
                net.cli(1, "rm", "obj")
                shutil.rmtree(work / "dst", ignore_errors=True)
        got["ratio"] = got["raw"] / got["p2p"]
        print(f"pair {rep}: raw {got['raw']:.2f}s p2p {got['p2p']:.2f}s ratio {got['ratio']:.2f}", flush=True)
        pairs.append(got)
    return pairs


def by_order(pairs: list[dict[str, float]]) -> str:
    """Median raw / P2P over the pairs where the raw copy went first, and where it went second."""
    out = []
    for first, label in ((1.0, "raw first"), (0.0, "P2P first")):
        sel = [p for p in pairs if p["raw_first"] == first]
        if sel:
            out.append(f"{label}: raw {statistics.median(p['raw'] for p in sel):.2f} s, P2P "
                       f"{statistics.median(p['p2p'] for p in sel):.2f} s, "
                       f"{statistics.median(p['ratio'] for p in sel):.2f}× ({len(sel)} pairs)")
    return "; ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--in-flight", type=int, help="[store] p2p_in_flight_per_peer (default: the config's)")
    ap.add_argument("--uncapped-only", action="store_true", help="only the uncapped fetch vs. raw TCP copy")
    ap.add_argument("--capped-plain", action="store_true",
                    help="the capped rounds on the plain-TCP cluster (chunks on the bulk ports), not under CURVE")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args()
    size = args.size_mb * 1000 * 1000
    work = Path(tempfile.mkdtemp(prefix="bench-p2p-"))
    src = work / "src" / "obj.bin"
    write_object(src, size)
    settle()
    rows: dict[str, list[float]] = {"single": [], "seed": [], "p2p": []}
    try:
        def capped(net: P2PHosts) -> None:
            for i in range(1, 5):
                net.set_rate(i, None if args.uncapped_only else args.rate)
            for rep in range(0 if args.uncapped_only else args.reps):
                for mode, hosts in (("single", [2]), ("seed", [2, 3, 4]), ("p2p", [2, 3, 4])):
                    republish(net, src.parent, work / "dst")
                    rows[mode].append(asyncio.run(fetch(net, hosts, work / "dst", only_seed=mode != "p2p")))
                    print(f"rep {rep} {mode}: {rows[mode][-1]:.2f}s", flush=True)
            for i in range(1, 5):
                net.set_rate(i, None)

        with P2PHosts(work / "curve", curve=True, in_flight_per_peer=args.in_flight) as net:
            if not args.capped_plain:
                capped(net)
            curve = paired(net, src, work, args.reps)
        with P2PHosts(work / "plain", curve=False, in_flight_per_peer=args.in_flight) as net:
            if args.capped_plain:
                capped(net)
            plain = paired(net, src, work, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) if v else float("nan") for k, v in rows.items()}
    mb = size / 1e6

    def col(pairs: list[dict[str, float]], key: str) -> float:
        return statistics.median(p[key] for p in pairs)

    def row(label: str, t: float, ratio: str = "") -> str:
        return f"| {label} | {t:.2f} | {mb / t:.0f} | {ratio} |"

    def runs(pairs: list[dict[str, float]]) -> str:
        return "; ".join(f"{p['raw']:.2f} / {p['p2p']:.2f} ({p['ratio']:.2f}×)" for p in pairs)

    lines = [
        f"{args.size_mb} MB object, 16 MiB chunks, 4 hosts (network namespaces), median of {args.reps}.",
        "",
        f"Egress of every host capped at {args.rate} ({'plain TCP, bulk ports' if args.capped_plain else 'CURVE'}):",
        "",
        "| fetch | time (s) | vs. 3 fetches from the seed | vs. single fetch |",
        "|---|---|---|---|",
        f"| 1 host from the seed (single) | {med['single']:.1f} | | 1.00× |",
        f"| 3 hosts, all from the seed | {med['seed']:.1f} | 1.00× | {med['seed'] / med['single']:.2f}× |",
        f"| 3 hosts, P2P | {med['p2p']:.1f} | {med['p2p'] / med['seed']:.2f}× | {med['p2p'] / med['single']:.2f}× |",
        "",
        f"Uncapped, host1 → host2, {args.reps} pairs (raw TCP copy, P2P fetch) back to back per cluster; "
        "ratio: median over the pairs of raw time / P2P time:",
        "",
        "| copy | time (s) | MB/s | raw / P2P, per pair |",
        "|---|---|---|---|",
        row("raw TCP socket copy (sendfile → recv_into + write), from starting the sender, plain cluster",
            col(plain, "raw")),
        row("P2P fetch, plain TCP, from the request", col(plain, "p2p"), f"**{col(plain, 'ratio'):.2f}×**"),
        row("raw TCP socket copy, CURVE cluster", col(curve, "raw")),
        row("P2P fetch, CURVE, from the request", col(curve, "p2p"), f"{col(curve, 'ratio'):.2f}×"),
        row("raw TCP copy, transfer only (connection accepted → last byte written), plain cluster",
            col(plain, "raw_transfer")),
        row("P2P fetch, plain TCP, transfer only (first chunk request → last chunk written)",
            col(plain, "p2p_transfer"),
            f"{statistics.median(p['raw_transfer'] / p['p2p_transfer'] for p in plain):.2f}×"),
        row("P2P fetch, CURVE, transfer only", col(curve, "p2p_transfer"),
            f"{statistics.median(p['raw_transfer'] / p['p2p_transfer'] for p in curve):.2f}×"),
        "",
        f"Capped runs (s): {', '.join(f'{k} {[round(x, 2) for x in v]}' for k, v in rows.items())}.",
        f"Pairs, raw / P2P (s): plain {runs(plain)}; CURVE {runs(curve)}.",
        f"By order, plain: {by_order(plain)}. CURVE: {by_order(curve)}.",
        f"Share of the bytes on the holder's bulk port (mooncake/p2p/bulk.py): plain "
        f"{min(p['p2p_bulk'] for p in plain):.0%}-{max(p['p2p_bulk'] for p in plain):.0%}, CURVE "
        f"{max(p['p2p_bulk'] for p in curve):.0%} (never under CURVE).",
    ]
    text = "\n".join(lines) + "\n"
    publish(text, args.out)


if __name__ == "__main__":
    main()
