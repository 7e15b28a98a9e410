"""The conductor's concepts, one file each: the request's state machine (``request``),
who is alive (``membership``), the socket and its
handler table (``router``), hot-block replication (``replicator``), the handlers of
the workers' messages (``worker_messages``) and the conductor that drives a request's
life over them (``conductor``)."""

from mooncake.conductor.conductor import Conductor
from mooncake.conductor.request import Finished, Request, RequestError, Tokens
from mooncake.sched.admission import Rejection

__all__ = ["Conductor", "Finished", "Rejection", "Request", "RequestError", "Tokens"]
