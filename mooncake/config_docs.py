"""``docs/configuration.md``: every config key with its default and description, generated from the
config models (as ``config.example.toml`` is; ``tests/test_docs.py`` checks both are in sync).

Regenerate with: ``python -m mooncake.config_docs > docs/configuration.md``."""

from __future__ import annotations

import json

from mooncake.config import Config
from mooncake.config_section import Section

HEADER = """\
# Configuration

Every key, by section, with its default. A role reads a TOML file (`mooncake serve --role ROLE
--config FILE`); every key can also be set in the environment as `MOONCAKE_<SECTION>_<KEY>`
(e.g. `MOONCAKE_NODE_HOST`), over the file; `mooncake config check FILE` prints the effective
config, secrets masked, or the errors. The same keys with their defaults, as a file to start
from: `config.example.toml`. This page is generated from the config models
(`python -m mooncake.config_docs > docs/configuration.md`).
"""


def configuration_markdown() -> str:
    lines = [HEADER]
    for section, model in Config():
        _section(lines, (section,), model)
    return "\n".join(lines).rstrip("\n") + "\n"


def _section(lines: list[str], path: tuple[str, ...], model: Section) -> None:
    lines += [f"## [{'.'.join(path)}]", "", "| key | default | what it does |", "|---|---|---|"]
    tables = []
    for key, value in model:
        if isinstance(value, Section):
            tables.append((key, value))
            continue
        default = "(unset)" if value is None else json.dumps(value)
        about = (type(model).model_fields[key].description or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{key}` | `{default}` | {about} |")
    lines.append("")
    for key, value in tables:
        _section(lines, (*path, key), value)


if __name__ == "__main__":
    print(configuration_markdown(), end="")
