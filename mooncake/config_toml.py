"""The config as TOML: every key of a ``Config`` (``mooncake config check`` prints it, secrets
masked; dev clusters and deployments write it for their roles), and ``config.example.toml``."""

from __future__ import annotations

import json

from mooncake.config import MASK, SECRET_KEYS, Config
from mooncake.config_section import Section


def _masked(value: object, key: str = "") -> object:
    """A secret's value as printed: MASK where set, so that whether it is set still shows (and
    for ``api_key_classes``, each key's terms)."""
    if key == "api_key_classes":
        return [MASK + entry[len(entry.split(";")[0].rpartition("=")[0]):] for entry in map(str, value)]  # type: ignore[arg-type]
    if isinstance(value, list):
        return [MASK] * len(value)
    return MASK if value else value


def dump_toml(cfg: Config, comments: bool = False, mask_secrets: bool = False) -> str:
    """The config as TOML, every key; with ``comments`` each key gets its description; with
    ``mask_secrets`` (for printing) the values of ``SECRET_KEYS`` are ``MASK``. A key left unset
    (one that takes another key's value) is written as a comment."""
    lines: list[str] = []
    for section, model in cfg:
        _table(lines, (section,), model, comments, mask_secrets)
    return "\n".join(lines)


def _table(lines: list[str], path: tuple[str, ...], model: Section, comments: bool, mask_secrets: bool) -> None:
    lines.append(f"[{'.'.join(path)}]")
    tables = []
    for key, value in model:
        if isinstance(value, Section):
            tables.append((key, value))
            continue
        if comments:
            lines.append(f"# {type(model).model_fields[key].description}")
        if mask_secrets and (*path, key) in SECRET_KEYS:
            value = _masked(value, key)
        lines.append(f"# {key} = (unset)" if value is None else f"{key} = {json.dumps(value)}")
    lines.append("")
    for key, value in tables:
        _table(lines, (*path, key), value, comments, mask_secrets)


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
