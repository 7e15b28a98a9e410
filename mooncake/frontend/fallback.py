"""Placing attempts without a conductor: what a frontend does while none leads (an election,
etcd unreachable, every conductor down), so that requests are served instead of failed.

It places over the workers the conductor last described (``ClusterView.workers``): the
prefill (or colocated instance, which then decodes too) chosen by prefix affinity (rendezvous
hashing of the prompt's first block, so one system prompt keeps landing where its KV is) unless
that instance holds ``AFFINITY_SLACK`` more of this frontend's attempts than the least loaded
one; a prefill's decode the one with the fewest of them. The frontend then drives the attempt as it drives a conductor's (``attempt_driver.py``);
the route says it is unplanned, so that a conductor leading again leaves it to run to its end.
No store is read or written for these attempts (the prefill reuses its own device cache),
and no cluster limit is checked beyond the context length.
"""

from __future__ import annotations

import secrets
import zlib
from collections import Counter

from mooncake import protocol as P

AFFINITY_SLACK = 2  # attempts more than the least loaded prefill that prefix affinity may cost


class FallbackPlacer:
    def __init__(self) -> None:
        self.workers: dict[str, P.WorkerRef] = {}  # the last known, by node id

    def can_place(self, workers: list[P.WorkerRef]) -> bool:
        """Whether ``workers`` (the conductor's last word on them) have a prefill and a decode;
        they are the ones placed over from now on."""
        self.workers = {w.node_id: w for w in workers}
        roles = {w.role for w in self.workers.values()}
        return {"prefill", "decode"} <= roles or "colocated" in roles

    def place(self, msg: P.Submit, max_model_len: int, load: Counter[str]) -> P.Admitted:
        """A route for ``msg``'s attempt (``load``: node id -> this frontend's attempts on it);
        ``can_place`` must have said yes."""
        decodes = [w for w in self.workers.values() if w.role == "decode"]
        # a prefill (when a decode is there to pair it with) or a colocated instance, which decodes too
        prefills = [w for w in self.workers.values() if w.role == "colocated" or (w.role == "prefill" and decodes)]
        key = msg.hashes[0] if msg.hashes else msg.root
        least = min(load[w.node_id] for w in prefills)
        near = [w for w in prefills if load[w.node_id] <= least + AFFINITY_SLACK]
        prefill = max(near, key=lambda w: zlib.crc32(key + w.node_id.encode()))
        decode = prefill if prefill.role == "colocated" else min(decodes, key=lambda w: (load[w.node_id], w.node_id))
        max_tokens = msg.sampling.max_tokens
        if msg.num_generated == 0:  # what the context leaves, as the conductor clamps it
            max_tokens = max(1, min(max_tokens, max_model_len - len(msg.tokens)))
        return P.Admitted(msg.wire_id, P.Route(decode, [prefill], secrets.token_bytes(16), planned=False), max_tokens)
