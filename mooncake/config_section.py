"""The base of every config section, and how a list key is read from the environment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


def split_list(v: object, key: str) -> object:
    """A list key's value from the environment (a string): comma-separated, or a JSON list."""
    if not isinstance(v, str):
        return v
    if v.strip().startswith("["):
        import json

        try:
            return json.loads(v)
        except ValueError:
            raise ValueError(f"{key}: not a JSON list of strings") from None
    return [k.strip() for k in v.split(",") if k.strip()]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
