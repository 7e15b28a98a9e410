"""A worker keeps few store clients: a store restarted on a new endpoint does not leave
its old client (sockets, shared-memory segments) behind forever."""

from __future__ import annotations

from types import SimpleNamespace

from mooncake.worker import MAX_STORE_CLIENTS, EngineWorker


def test_store_clients_are_a_bounded_lru():
    worker = SimpleNamespace(_stores={}, curve=None, max_message_bytes=16 << 20, rejections=None)
    first = EngineWorker.store(worker, "tcp://127.0.0.1:1")
    assert EngineWorker.store(worker, "tcp://127.0.0.1:1") is first
    for port in range(2, 2 + MAX_STORE_CLIENTS):
        EngineWorker.store(worker, f"tcp://127.0.0.1:{port}")
    assert len(worker._stores) == MAX_STORE_CLIENTS
    assert "tcp://127.0.0.1:1" not in worker._stores and first._closed
