"""The one interface through which a request's KV moves between processes.

After vLLM's KV connector: a planning half decides what to load, from where, and what to save;
a worker half does it (start loading, wait for a layer, save a layer or whole blocks, wait for
the saves, what is still in flight). Saving goes to the decode instance (block-wise or layer-wise)
and to the node's store; loading comes from stores (whole blocks, or a stream of layers).
``PrefillKV`` (``prefill_kv.py``) is the prefill's; decode's end is the ingress (``ingress.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from mooncake import protocol as P
from mooncake.engine.sequence import Sequence


class KVConnector(ABC):
    """One request's KV across processes (see the module docstring)."""

    # ---- planning half: what to load, from where, what to save

    @abstractmethod
    def load_plan(self, have: int) -> list[P.FetchPlan]:
        """The store reads that continue the ``have`` blocks already cached, contiguous and in order
        (empty: nothing to load)."""

    @abstractmethod
    def store_start(self, cached: int) -> int:
        """The first block to write to the store when ``cached`` leading blocks came from a cache."""

    @abstractmethod
    def save_plan(self, saved: int, full: int) -> tuple[int, int]:
        """Blocks ``[first, end)`` to write to the store now that ``full`` blocks are whole and the
        ones before ``saved`` are written (empty when there is nothing to write)."""

    # ---- worker half: start loading, wait for a layer, save, wait for saves, what is in flight

    @abstractmethod
    async def start_load(self, have: int) -> tuple[int, float]:
        """Begin loading what ``load_plan(have)`` names; (blocks loaded whole, seconds spent)."""

    @abstractmethod
    async def attach(self, seq: Sequence, have: int) -> int:
        """The sequence the request's KV goes into and out of (its blocks are held); how many
        blocks a load still brings into it layer by layer (0: none)."""

    @abstractmethod
    def wait_for_layer(self, layer: int) -> None:
        """Until ``layer`` of the loading prefix is in the pool (the engine thread)."""

    @abstractmethod
    def save_layer(self, layer: int, first: int, kv: torch.Tensor) -> None:
        """One layer ``[n, 2, Hkv, T, D]`` of the blocks from ``first`` leaves (the engine thread)."""

    @abstractmethod
    async def save_blocks(self, first: int, last: int | None) -> None:
        """The sequence's computed blocks ``[first, last)`` leave whole (``last`` None: to its end)."""

    @abstractmethod
    async def save_to_store(self, saved: int, full: int) -> int:
        """Write what ``save_plan(saved, full)`` names to the store in the background; the new ``saved``."""

    @abstractmethod
    def check(self) -> None:
        """Raise what stopped the saves early (a send that timed out, an abort)."""

    @abstractmethod
    async def wait_for_save(self) -> None:
        """Until every save queued has been handed to the socket; raise what stopped them."""

    @abstractmethod
    def in_flight(self) -> int:
        """Bytes queued to leave and not yet sent (0: every save so far finished)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop loading and saving (the request ended, one way or another)."""
