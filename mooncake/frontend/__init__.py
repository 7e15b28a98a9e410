"""The frontend role: the OpenAI API's requests from admission to their last token (``frontend``),
each request's state machine (``request``), choices of one prompt (``forks``), the socket decode
streams tokens into (``token_inlet``) and what it reports to Prometheus (``request_metrics``).
The conductor places the attempts (``mooncake.conductor``)."""

from mooncake.frontend.frontend import Frontend
from mooncake.frontend.request import Finished, Request, RequestError, Tokens
from mooncake.sched.admission import Rejection

__all__ = ["Finished", "Frontend", "Rejection", "Request", "RequestError", "Tokens"]
