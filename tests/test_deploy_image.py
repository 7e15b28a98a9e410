"""deploy/Dockerfile: its default command serves a whole cluster on one machine, the API on
0.0.0.0:8000 (a conductor alone answers 503); as the CLI parses it, not only as written."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from mooncake import cli

DOCKERFILE = Path(__file__).resolve().parent.parent / "deploy" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    out, line = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if raw.lstrip().startswith("#") or not (line or raw.strip()):
            continue
        line += raw.rstrip().removesuffix("\\") + (" " if raw.rstrip().endswith("\\") else "")
        if not raw.rstrip().endswith("\\"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            line = ""
    return out


def _argv(rest: str) -> list[str]:
    return json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]


def _last(instruction: str) -> str | None:
    """The arguments of the instruction's last occurrence (the one that counts), or None."""
    found = [rest for word, rest in _instructions() if word == instruction]
    return found[-1] if found else None


def _entrypoint() -> list[str]:
    entrypoint = _last("ENTRYPOINT")
    return _argv(entrypoint) if entrypoint else []


def _default_command() -> list[str]:
    return _entrypoint() + _argv(_last("CMD") or "")


def test_the_default_command_serves_a_whole_cluster_on_port_8000(monkeypatch):
    argv = _default_command()
    assert argv[0] == "mooncake", shlex.join(argv)
    seen = []
    monkeypatch.setattr(cli, "serve", lambda args: seen.append(args) or 0)
    assert cli.main(argv[1:]) == 0
    args, = seen
    assert args.role is None  # every role, not one (`--dev`, or `serve` alone)
    assert args.host == "0.0.0.0" and args.port in (None, 8000)
    assert "8000" in (_last("EXPOSE") or "").split()


@pytest.mark.parametrize("role", ["conductor", "prefill", "decode", "store"])
def test_the_image_still_runs_one_role(monkeypatch, role):
    """`docker run IMAGE mooncake serve --role ROLE --config FILE`, as before."""
    argv = _entrypoint() + ["mooncake", "serve", "--role", role, "--config", "/etc/mooncake/cluster.toml"]
    assert argv[0] == "mooncake", shlex.join(argv)
    seen = []
    monkeypatch.setattr(cli, "serve", lambda args: seen.append(args) or 0)
    assert cli.main(argv[1:]) == 0
    assert seen[0].role == role


def test_relative_paths_land_in_the_users_home():
    """The default [store] data_dir is ./mooncake-data: the working directory must be writable."""
    instructions = _instructions()
    user_at = max(i for i, (word, _) in enumerate(instructions) if word == "USER")
    workdir = [rest for word, rest in instructions[user_at:] if word == "WORKDIR"]
    home = [rest.partition("=")[2] for word, rest in instructions if word == "ENV" and rest.startswith("HOME=")]
    assert workdir and home and workdir[-1] == home[-1]
