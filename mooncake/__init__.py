"""mooncake: a KV-cache-centric, prefill/decode-disaggregated LLM server."""

__version__ = "0.1.0"
