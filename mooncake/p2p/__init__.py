"""P2P object store: whole objects (model checkpoints) shared between peers in checksummed
chunks. Every node with a store role is a peer; the conductor keeps which peer holds which
chunks (``index.py``); a fetch pulls chunks from all holders at once and makes the fetcher a
holder as it goes (``fetch.py``). Nothing in this package imports torch: the ``mooncake p2p``
command starts fast."""
