"""Fencing of stale leaders: the newest leadership term a process has seen, and the refusal of
conductor messages from an older one.

A conductor that leads through etcd has a term (etcd's revision of its campaign key: a later
leader's is higher); every message it sends that changes state elsewhere carries it (``term``:
``Admitted``, ``Refused``, ``AttemptEnded``, ``Abort``, ``FrontendGone``, ``Registered``, the
store orders ``Keep``, ``Replicate``, ``Remove`` and the P2P ``Forget``). Whoever receives them
(a worker's or a frontend's link to the conductor, a store's server and link: one fence per
process) keeps the highest term seen and refuses an older one: not acted on, counted per message
type, logged once per stale term. Term 0 is "no election" (a single conductor without etcd): it
passes only while no nonzero term has been seen. A message without a ``term`` field is not fenced.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)
MAX_LOGGED = 64  # stale terms remembered as logged (then forgotten: logged again at most once each)


class TermFence:
    def __init__(self, node_id: str = "", counter: Any = None) -> None:
        """``counter``: a Prometheus counter labelled (node, message) that refusals count in; None:
        the process has no registry of its own, ``refused`` rides its heartbeats (``roles/conductor_link.py``)."""
        self.node_id = node_id
        self.counter = counter
        self.term = 0  # the highest term seen
        self.refused: dict[str, int] = {}  # message type -> messages refused since start
        self._logged: set[int] = set()  # stale terms already logged

    def admit(self, msg: Any) -> bool:
        """Whether ``msg`` may be acted on (and, if it carries a newer term, that term is the newest
        from now on): a message without a term always; one with a term unless it is older."""
        term = getattr(msg, "term", None)
        if type(term) is not int:
            return True
        return self.check(term, type(msg).__name__)

    def check(self, term: int, message: str) -> bool:
        """Whether a ``message`` (its type's name) of leadership ``term`` may be acted on."""
        if term >= self.term:
            if term > self.term:
                if self.term:
                    log.warning("%s follows leadership term %d (was %d): older terms are refused", self.node_id,
                                term, self.term)
                self.term = term
            return True
        self.refused[message] = self.refused.get(message, 0) + 1
        if self.counter is not None:
            self.counter.labels(self.node_id, message).inc()
        if term not in self._logged:
            if len(self._logged) >= MAX_LOGGED:
                self._logged.clear()
            self._logged.add(term)
            log.warning("%s refuses %s of leadership term %d from a stale conductor: term %d leads (logged once "
                        "per stale term; counted in mooncake:stale_term_refused)", self.node_id, message, term,
                        self.term)
        return False
