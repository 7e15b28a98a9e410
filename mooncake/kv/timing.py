"""The time constants of ``mooncake/kv/`` in one place (those an operator may tune are configuration,
``config.py``); each comment names the module that uses it."""

GATE_TIMEOUT_S = 120.0  # prefix_stream: a forward never waits longer for a layer (the stream's own timeouts come first)
SEND_TIMEOUT_S = 10.0  # egress: KV a decode instance does not accept within this is given up (its socket dropped)
