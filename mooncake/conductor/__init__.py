"""The conductor's concepts, one file each: the request's state machine (``request``) and
its attempts (``attempt``), who is alive (``membership``), the socket and its handler table
(``router``), hot-block replication (``replicator``), choices of one prompt (``forks``),
pipeline groups' stage requests (``pipeline``), what it reports to Prometheus
(``request_metrics``) and the conductor that drives a request's life from what the workers
report (``conductor``). Its decisions (placement, admission, cost models) are in ``sched``."""

from mooncake.conductor.conductor import Conductor
from mooncake.conductor.request import Finished, Request, RequestError, Tokens
from mooncake.sched.admission import Rejection

__all__ = ["Conductor", "Finished", "Rejection", "Request", "RequestError", "Tokens"]
