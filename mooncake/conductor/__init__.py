"""The conductor's concepts, one file each: the attempts it places (``attempt``), who is alive
(``membership``), the socket and its handler table (``router``), hot-block replication
(``replicator``), pipeline groups' stage requests (``pipeline``), what ``GET /cluster`` shows
(``snapshot``), what it reports to Prometheus (``request_metrics``) and the conductor that
places attempts and drives them to their first token (``conductor``). Its decisions
(placement, admission, cost models) are in ``sched``; requests belong to the frontends
(``mooncake.frontend``)."""

from mooncake.conductor.conductor import Conductor

__all__ = ["Conductor"]
