"""The base of every message, the spec of a tensor it carries in a frame of its own, and the
error decoding raises (torch-free: ``mooncake.protocol`` imports torch only to frame tensors)."""

from __future__ import annotations

import msgspec


class Msg(msgspec.Struct, tag_field="t", omit_defaults=True):
    """Base of every message; the subclass name is its tag."""


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: tuple[int, ...]


class ProtocolError(ValueError):
    """A frame or message that does not decode into the protocol."""
