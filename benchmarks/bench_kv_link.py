"""The prefill -> decode KV link: GB/s with and without CURVE, in the same run.

A sender process pushes ``--transfers`` KVTransfer messages of ``--blocks`` blocks each
(the bundled SmolLM2-135M's block, float32: [30, 2, 3, 16, 64], 720 KiB) through the
real link (``mooncake.kv.link``: decode's PULL ingress, prefill's PUSH egress, the role
keys of ``mooncake keys``); the receiver decodes each message as decode does (block
shape checked). Modes alternate for ``--rounds`` rounds, fresh sockets each; the
figure is the median round. ``--checksums`` adds the per-block xxh3_64 both ends
compute (prefill on export, decode on admission).

    .venv/bin/python benchmarks/bench_kv_link.py [--rounds 5] [--transfers 48] [--blocks 8]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time

import torch
import zmq.asyncio

from mooncake import protocol as P
from mooncake.kv.integrity import checksums, first_corrupt
from mooncake.kv.link import bind_kv_ingress, connect_kv_egress
from mooncake.security import Curve, generate_keys
from mooncake.sockets import recv_multipart, send_multipart

BLOCK = (30, 2, 3, 16, 64)


def _receiver(keys: str | None, transfers: int, verify: bool, ready: mp.Queue, done: mp.Queue) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        curve = Curve(keys, "decode") if keys else None
        sock, endpoint = bind_kv_ingress(ctx, curve, "127.0.0.1", 0, 64 << 20)
        ready.put(endpoint)
        nbytes = 0
        for _ in range(transfers):
            frames = await recv_multipart(sock)
            msg, tensors = P.decode(frames, block_shape=BLOCK)
            if verify:
                assert first_corrupt(tensors, msg.checksums) is None
            nbytes += sum(t.numel() * t.element_size() for t in tensors)
        done.put((nbytes, time.perf_counter()))
        if curve is not None:
            curve.stop()
        sock.close(0)
        ctx.term()

    asyncio.run(main())


async def _send(endpoint: str, keys: str | None, kv: torch.Tensor, transfers: int, verify: bool) -> None:
    ctx = zmq.asyncio.Context()
    curve = Curve(keys, "prefill") if keys else None
    sock = connect_kv_egress(ctx, curve, endpoint)
    for i in range(transfers):
        msg = P.KVTransfer(f"r{i}", 0, token=b"t" * 16, checksums=checksums(kv) if verify else [])
        await send_multipart(sock, P.encode(msg, list(kv.unbind(0))))
    sock.close(linger=-1)  # lets the queue drain
    ctx.term()


def one_round(keys: str | None, kv: torch.Tensor, transfers: int, verify: bool) -> float:
    """GB/s of one round: KV bytes received over the time from the first send (a fresh connection: its
    handshake included, ~ms against a round of hundreds of MB) to the last message decoded."""
    ready, done = mp.Queue(), mp.Queue()
    proc = mp.Process(target=_receiver, args=(keys, transfers, verify, ready, done))
    proc.start()
    endpoint = ready.get(timeout=60)
    t0 = time.perf_counter()
    asyncio.run(_send(endpoint, keys, kv, transfers, verify))
    nbytes, t_end = done.get(timeout=300)
    proc.join(30)
    return nbytes / (t_end - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--transfers", type=int, default=48)
    p.add_argument("--blocks", type=int, default=8)
    args = p.parse_args()
    keys = tempfile.mkdtemp(prefix="mooncake-keys-")
    generate_keys(keys)
    kv = torch.randn(args.blocks, *BLOCK)
    modes = {"plain": (None, False), "curve": (keys, False), "plain+checksums": (None, True),
             "curve+checksums": (keys, True)}
    results: dict[str, list[float]] = {m: [] for m in modes}
    one_round(keys, kv, 4, False)  # warm-up (imports, page cache)
    for _ in range(args.rounds):
        for mode, (k, verify) in modes.items():
            results[mode].append(one_round(k, kv, args.transfers, verify))
    mb = args.transfers * args.blocks * kv[0].numel() * 4 / 1e6
    print(f"{args.transfers} transfers x {args.blocks} blocks of {list(BLOCK)} float32 ({mb:.0f} MB per round), "
          f"{args.rounds} rounds, median GB/s:")
    base = statistics.median(results["plain"])
    for mode, xs in results.items():
        med = statistics.median(xs)
        print(f"  {mode:16s} {med:6.2f} GB/s  ({med / base:.2f} x plain)   rounds: {', '.join(f'{x:.2f}' for x in xs)}")
    t0 = time.perf_counter()
    for _ in range(20):
        checksums(kv)
    print(f"  xxh3_64 checksums alone: {20 * kv.numel() * 4 / (time.perf_counter() - t0) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
