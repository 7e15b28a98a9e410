"""The time constants of ``mooncake/p2p/`` in one place (those an operator may tune are configuration,
``config.py``); each comment names the module that uses it."""

GRANT_TTL_S = 30.0  # bulk_server: a bulk token a holder granted is good for this long
CONNECT_TIMEOUT_S = 5.0  # bulk: a bulk port silent this long is taken as firewalled (a LAN connects in ms)
IDLE_TIMEOUT_S = 10.0  # bulk: a holder closes a connection that brings no whole token this long after connecting or a chunk
