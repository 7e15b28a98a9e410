"""What ``GET /cluster`` shows (on any frontend, which asks the conductor): the nodes with their
endpoints, last reported load and the scheduler's bookings, the cost models' estimates and
the predictions' record."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from mooncake.conductor.conductor import Conductor


def cluster_snapshot(c: Conductor) -> dict:
    s, costs, facts = c.scheduler, c.costs, c.facts
    pw, dw = costs.prefill.weights, costs.decode.weights
    return {"model": c.model_name, "leader": c.name, "index_blocks": len(c.index), "attempts": len(c.attempts),
            "requests": sum(c.requests_in_flight.values()),
            "block_tokens": facts.block_tokens if facts else 0,
            "estimates": {"prefill_1k_tokens_s": costs.prefill.predict(1000, 0),
                          "decode_step_batch_8_s": costs.decode.predict(8, 8 * 1024),  # 1k tokens each
                          "prefill_fixed_s": pw[0], "prefill_per_token_s": pw[1] / 1000,
                          "prefill_per_pair_s": pw[2] / 1e6, "decode_step_s": dw[0], "decode_per_seq_s": dw[1],
                          "decode_per_kv_token_s": dw[2] / 1000,
                          "fetch_block_s": costs.prefill.fetch_block_s,
                          "dispatch_s": costs.prefill.dispatch.value, "transit_s": costs.prefill.transit.value,
                          "profiled": sorted(costs.profiled)},
            "predictions": c.predictions.summary(),
            "frontends": [n.node_id for n in c.cluster.nodes.values() if n.role == "frontend"],
            "nodes": [{"node_id": n.node_id, "role": n.role, "name": n.name, "pid": n.info.pid,
                       "instance": n.info.instance, "endpoints": n.endpoints,
                       "num_blocks": n.info.num_blocks, "block_bytes": n.info.block_bytes,
                       "kv_block_bytes": n.info.moved_block_bytes, "step_tokens": n.info.step_tokens,
                       "cpus": n.info.cpus, "threads": n.info.threads, "machine": n.info.machine,
                       "load": msgspec.to_builtins(n.load), "queued": s.queued(n.node_id),
                       "assigned": s.assigned(n.node_id), "draining": n.draining, "stalled": n.stalled,
                       "blocks_indexed": c.index.blocks_of(n.node_id)}
                      for n in c.cluster.nodes.values()]}
