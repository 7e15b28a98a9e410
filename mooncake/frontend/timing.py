"""The time constants of ``mooncake/frontend/`` in one place (those an operator may tune are configuration,
``config.py``); each comment names the module that uses it."""

RETRY_NO_WORKERS_S = 0.25  # conductor_client: a Submit refused for want of workers is sent again this much later
LEADERLESS_AFTER_S = 3.0  # conductor_client: of silence from the conductor (it answers each heartbeat and Submit): none leads
RECENT_KEEP_S = 300.0  # recent_requests: a finished request's timeline stays readable (GET /v1/requests/{id}) this long
CLOSE_LINGER_MS = 200  # attempt_driver: a closed order socket lets its last messages go out for this long
FAIR_TOKEN_S = 0.010  # tenant_clock: a prompt token moves its tenant's clock by 10 ms ([classes] fair_token_ms)
