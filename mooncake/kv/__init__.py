"""Everything that moves KV between processes, behind one interface (``connector.KVConnector``:
a planning half and a worker half, after vLLM's KV connector).

- ``connector``: the interface; ``prefill_kv``: the prefill's implementation (loads from stores,
  saves to decode and to the store).
- ``pool_io``: KV into and out of an engine's paged pool (``engine.kv``).
- ``layers``: layer-wise KV (the forward's ``LayerHooks``, a chunk's per-layer KV).
- ``sender``: one request's KV messages, in order, off the compute path; ``egress``: prefill's
  sockets to decode; ``link``: the socket setup of both ends; ``ingress``: decode's landing of KV.
- ``prefix_load``: prefixes read from stores (whole blocks, or a ``prefix_stream`` of layers).
- ``store_clients``: a worker's store clients and background write-backs.
- ``integrity``: checksums and the checks every admitting process makes.

Modules here import the engine's modules, never the reverse, except ``pool_io`` and ``layers``,
which the engine holds and which import nothing of it at run time.
"""
