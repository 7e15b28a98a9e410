"""The time constants of ``mooncake/roles/`` in one place (those an operator may tune are configuration,
``config.py``); each comment names the module that uses it."""

ACTIVATION_TIMEOUT_S = 60.0  # prefill_stage: a stage that hears nothing from the one before for this long gives up
READ_TIMEOUT_S = 5.0  # node_health: a health probe's request line and headers must each arrive within this
# decode: flex work yields the cores to an interactive prefill on this machine for at most this long per
# reservation (a prefill that takes longer is queued or stuck, and flex work goes on meanwhile).
YIELD_AT_MOST_S = 10.0
TAKEN_RETRY_S = 1.0  # conductor_link: a registration refused as ``node_id_taken`` (the process it replaces not gone yet) is retried
