"""`mooncake config check` prints the effective config without its secrets (API keys shown as
``***``, so that whether one is set still shows); the TOML written for processes to read keeps them."""

from __future__ import annotations

import os
import subprocess
import sys

from mooncake.config import Config, load_config
from mooncake.config_toml import dump_toml
from mooncake.security import generate_keys

KEYS = ("sk-ops-0123456789", "sk-tenant-a-0123", "sk-prometheus-01")


def _check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    return subprocess.run([sys.executable, "-m", "mooncake.cli", "config", "check", *args], capture_output=True,
                          text=True, env={**base, **(env or {})}, timeout=120)


def test_config_check_prints_no_api_key_nor_key_file(tmp_path):
    generate_keys(tmp_path / "keys")
    config = tmp_path / "c.toml"
    config.write_text(f'[conductor]\napi_key = "{KEYS[0]}"\napi_keys = ["{KEYS[1]}"]\n'
                      f'[security]\ncurve_keys_dir = "{tmp_path / "keys"}"\n')
    r = _check(str(config), env={"MOONCAKE_CONDUCTOR_API_KEYS": f"{KEYS[1]},{KEYS[2]}"})
    assert r.returncode == 0, r.stderr
    printed = r.stdout + r.stderr
    assert not any(key in printed for key in KEYS)
    assert 'api_key = "***"' in r.stdout and 'api_keys = ["***", "***"]' in r.stdout  # set, and how many
    for secret in (tmp_path / "keys").glob("*.key_secret"):
        assert not any(line.strip() in printed for line in secret.read_text().splitlines() if "key" in line)
    assert f'curve_keys_dir = "{tmp_path / "keys"}"' in r.stdout  # a path, not a secret


def test_config_check_shows_unset_keys_as_unset():
    r = _check()
    assert r.returncode == 0, r.stderr
    assert 'api_key = ""' in r.stdout and "api_keys = []" in r.stdout


def test_a_bad_key_variable_is_named_without_its_value():
    r = _check(env={"MOONCAKE_CONDUCTOR_API_KEYS": f'["{KEYS[0]}", 7'})
    assert r.returncode == 2 and "MOONCAKE_CONDUCTOR_API_KEYS" in r.stderr
    assert KEYS[0] not in r.stdout + r.stderr


def test_the_toml_written_for_role_processes_keeps_the_keys(tmp_path):
    """What `mooncake serve --dev` writes for its children: they must get the real keys."""
    cfg = Config()
    cfg.frontend.api_key, cfg.frontend.api_keys = KEYS[0], list(KEYS[1:])
    path = tmp_path / "child.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(path, env={}) == cfg
