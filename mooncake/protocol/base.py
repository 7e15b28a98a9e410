"""The base of every message."""

from __future__ import annotations

import msgspec


class Msg(msgspec.Struct, tag_field="t", omit_defaults=True):
    """Base of every message; the subclass name is its tag."""
