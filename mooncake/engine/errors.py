"""Typed errors of the engine: bad requests and models that cannot be loaded."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message names the path and the problem."""


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as given; the message is user-facing.

    ``param`` names the offending request field (OpenAI error body ``param``), if any.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
