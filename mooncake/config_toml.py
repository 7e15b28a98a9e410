"""The config as TOML: every key of a ``Config`` (``mooncake config check`` prints it, secrets
masked; dev clusters and deployments write it for their roles), and ``config.example.toml``."""

from __future__ import annotations

import json

from mooncake.config import MASK, SECRET_KEYS, Config


def _masked(value: object, key: str = "") -> object:
    """A secret's value as printed: MASK where set, so that whether it is set still shows (and
    for ``api_key_tiers``, each key's tier)."""
    if key == "api_key_tiers":
        return [f"{MASK}={str(pair).rpartition('=')[2]}" for pair in value]  # type: ignore[union-attr]
    if isinstance(value, list):
        return [MASK] * len(value)
    return MASK if value else value


def dump_toml(cfg: Config, comments: bool = False, mask_secrets: bool = False) -> str:
    """The config as TOML, every key; with ``comments`` each key gets its description; with
    ``mask_secrets`` (for printing) the values of ``SECRET_KEYS`` are ``MASK``."""
    lines: list[str] = []
    for section, model in cfg:
        lines.append(f"[{section}]")
        for key, value in model:
            if comments:
                lines.append(f"# {type(model).model_fields[key].description}")
            if mask_secrets and (section, key) in SECRET_KEYS:
                value = _masked(value, key)
            lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)


EXAMPLE_HEADER = """\
# mooncake configuration: every key, with its default.
# One process per role and node:  mooncake serve --role conductor|frontend|prefill|decode|store --config FILE
# Roles find the conductor at [conductor] endpoint; give each node its own [node] name and host.
# Every key can also be set in the environment as MOONCAKE_<SECTION>_<KEY> (e.g. MOONCAKE_NODE_HOST),
# over this file; `mooncake config check FILE` prints the effective config or the errors.
# Regenerate with: python -c "from mooncake.config_toml import example_toml; print(example_toml(), end='')"

"""


def example_toml() -> str:
    return EXAMPLE_HEADER + dump_toml(Config(), comments=True)
