"""A worker keeps few store clients: a store restarted on a new endpoint does not leave
its old client (sockets, shared-memory segments) behind forever."""

from __future__ import annotations

from mooncake.config import SecurityConfig
from mooncake.kv.store_clients import MAX_STORE_CLIENTS, StoreClients


def test_store_clients_are_a_bounded_lru():
    stores = StoreClients(None, 16 << 20, None, SecurityConfig())
    first = stores.client("tcp://127.0.0.1:1")
    assert stores.client("tcp://127.0.0.1:1") is first
    for port in range(2, 2 + MAX_STORE_CLIENTS):
        stores.client(f"tcp://127.0.0.1:{port}")
    assert len(stores) == MAX_STORE_CLIENTS
    assert "tcp://127.0.0.1:1" not in stores and first._closed
