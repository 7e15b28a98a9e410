"""P2P object distribution across network namespaces (needs root: ip netns, tc).

Four hosts on a bridge, a conductor on host1 and a store on each (tests/p2p_hosts.py),
CURVE on every link. One object of ``--size-mb`` MB (one file) is published on host1.

Capped (every host's egress at ``--rate``, tc tbf), ``--reps`` rounds of:
  single   host2 fetches the object alone from the seed;
  seed     hosts 2, 3, 4 fetch at the same time, each only from the seed (``--from host1``);
  p2p      hosts 2, 3, 4 fetch at the same time from every holder (fetchers serve each other).
Between fetches the object is removed and published again (no copies left over).

Uncapped: host2 fetches from host1 alone (CURVE, and plain TCP on a second cluster started
with ``allow_insecure_network``), against a raw TCP socket copy of the same file between
the same two namespaces (``sendfile`` into a socket, ``recv_into`` + write to a file).
A fetch's time includes checking every chunk and each file's SHA-256 at the end.

    flock /tmp/mooncake-cpu.lock .venv/bin/python benchmarks/bench_p2p.py [--size-mb 300] [--rate 200mbit] [--reps 3] [--out FILE]
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from p2p_hosts import P2PHosts  # noqa: E402

RECEIVER = """
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1); print("ready", flush=True)
conn, _ = srv.accept(); buf = bytearray(16 << 20); view = memoryview(buf); total = 0
with open(sys.argv[3], "wb", buffering=0) as f:
    while (n := conn.recv_into(buf)):
        f.write(view[:n]); total += n
print(total, flush=True)
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


async def fetch(net: P2PHosts, hosts: list[int], dest: Path, only_seed: bool, checks: list | None = None) -> float:
    """Seconds until every host has the object; ``checks`` gets each fetch's final SHA-256 check time."""
    clients = [net.client(i) for i in hosts]
    t0 = time.monotonic()
    try:
        reports = await asyncio.gather(*(c.get("obj", dest / f"host{i}", only_from=["host1"] if only_seed else None)
                                         for c, i in zip(clients, hosts)))
        if checks is not None:
            checks.extend(r.verify_s for r in reports)
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


def raw_tcp_copy(net: P2PHosts, src: Path, dest: Path) -> float:
    h1, h2 = net.hosts[1], net.hosts[2]
    port = 5999
    recv = subprocess.Popen(["ip", "netns", "exec", h2.ns, sys.executable, "-c", RECEIVER, h2.address, str(port),
                             str(dest)], stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        subprocess.run(["ip", "netns", "exec", h1.ns, sys.executable, "-c", SENDER, h2.address, str(port), str(src)],
                       check=True)
        got = int(recv.stdout.readline())
        dt = time.monotonic() - t0
        assert got == src.stat().st_size, got
        return dt
    finally:
        recv.kill()
        recv.wait()
        dest.unlink(missing_ok=True)


def uncapped(net: P2PHosts, src: Path, work: Path, reps: int) -> tuple[list[float], list[float]]:
    """(fetch times, of which the final SHA-256 checks)."""
    times: list[float] = []
    checks: list[float] = []
    for _ in range(reps):
        republish(net, src.parent, work / "dst")
        times.append(asyncio.run(fetch(net, [2], work / "dst", only_seed=True, checks=checks)))
    return times, checks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args()
    size = args.size_mb * 1000 * 1000
    work = Path(tempfile.mkdtemp(prefix="bench-p2p-"))
    src = work / "src" / "obj.bin"
    write_object(src, size)
    rows: dict[str, list[float]] = {"single": [], "seed": [], "p2p": []}
    try:
        with P2PHosts(work / "curve", curve=True) as net:
            for i in range(1, 5):
                net.set_rate(i, args.rate)
            for rep in range(args.reps):
                for mode, hosts in (("single", [2]), ("seed", [2, 3, 4]), ("p2p", [2, 3, 4])):
                    republish(net, src.parent, work / "dst")
                    rows[mode].append(asyncio.run(fetch(net, hosts, work / "dst", only_seed=mode != "p2p")))
                    print(f"rep {rep} {mode}: {rows[mode][-1]:.2f}s", flush=True)
            for i in range(1, 5):
                net.set_rate(i, None)
            raw = []
            for _ in range(args.reps):
                raw.append(raw_tcp_copy(net, src, work / "raw.bin"))
            curve_times, _ = uncapped(net, src, work, args.reps)
            print(f"raw {raw} curve {curve_times}", flush=True)
        with P2PHosts(work / "plain", curve=False) as net:
            plain_times, plain_checks = uncapped(net, src, work, args.reps)
            raw_plain = [raw_tcp_copy(net, src, work / "raw.bin") for _ in range(args.reps)]
            print(f"plain {plain_times} raw {raw_plain}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    raw_all = raw + raw_plain
    mb = size / 1e6
    raw_med = statistics.median(raw_all)
    transfer = [t - c for t, c in zip(plain_times, plain_checks)]
    lines = [
        f"{args.size_mb} MB object, 16 MiB chunks, 4 hosts (network namespaces), CURVE, median of {args.reps}.",
        "",
        f"Egress of every host capped at {args.rate}:",
        "",
        "| fetch | time (s) | vs. 3 fetches from the seed | vs. single fetch |",
        "|---|---|---|---|",
        f"| 1 host from the seed (single) | {med['single']:.1f} | | 1.00× |",
        f"| 3 hosts, all from the seed | {med['seed']:.1f} | 1.00× | {med['seed'] / med['single']:.2f}× |",
        f"| 3 hosts, P2P | {med['p2p']:.1f} | {med['p2p'] / med['seed']:.2f}× | {med['p2p'] / med['single']:.2f}× |",
        "",
        "Uncapped, host1 → host2:",
        "",
        "| copy | time (s) | MB/s | vs. raw TCP |",
        "|---|---|---|---|",
        f"| raw TCP socket copy (sendfile → recv_into + write) | {raw_med:.2f} | {mb / raw_med:.0f} | 1.00× |",
        f"| P2P fetch, plain TCP | {statistics.median(plain_times):.2f} | {mb / statistics.median(plain_times):.0f} "
        f"| {raw_med / statistics.median(plain_times):.2f}× |",
        f"| P2P fetch, plain TCP, less its final SHA-256 check ({statistics.median(plain_checks):.2f} s) "
        f"| {statistics.median(transfer):.2f} | {mb / statistics.median(transfer):.0f} "
        f"| {raw_med / statistics.median(transfer):.2f}× |",
        f"| P2P fetch, CURVE | {statistics.median(curve_times):.2f} | {mb / statistics.median(curve_times):.0f} "
        f"| {raw_med / statistics.median(curve_times):.2f}× |",
        "",
        f"All runs (s): {', '.join(f'{k} {[round(x, 2) for x in v]}' for k, v in rows.items())}; "
        f"raw {[round(x, 2) for x in raw_all]}; plain {[round(x, 2) for x in plain_times]}; "
        f"curve {[round(x, 2) for x in curve_times]}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
