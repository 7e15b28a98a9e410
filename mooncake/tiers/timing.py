"""The time constants of ``mooncake/tiers/`` in one place (those an operator may tune are configuration,
``config.py``); each comment names the module that uses it."""

MAX_KEEP_S = 7 * 86400.0  # tiered: a session's blocks are kept at most this long, whatever a request asks
WINDOW_S = 60.0  # write_budget: a tenant's store writes are budgeted per this many seconds
