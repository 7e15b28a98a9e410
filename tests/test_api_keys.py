"""API keys in isolation: constant-time matching of any configured key, the per-key cache salt,
and the ways to configure several keys (TOML list, environment, repeated or comma-separated
--api-key). Over real HTTP on a live cluster: test_restart_and_keys.py."""

from __future__ import annotations

import argparse

from mooncake.api.guard import Guard, key_salt, matching_key, request_salt
from mooncake.cli import _overrides
from mooncake.config import FrontendConfig, load_config

KEYS = [b"sk-one", b"sk-two"]


def test_any_configured_key_matches_and_nothing_else():
    assert matching_key("Bearer sk-one", KEYS) == b"sk-one"
    assert matching_key("bearer sk-two", KEYS) == b"sk-two"
    for header in ("", "Bearer", "Bearer ", "Bearer sk-on", "Bearer sk-one2", "sk-one", "Basic sk-one",
                   "Bearer sk-\udcff"):
        assert matching_key(header, KEYS) is None, header


def test_guard_leaves_only_health_open():
    guard = Guard(None, ["k"], 1024)
    assert guard._open("/health") and guard._open("/health/ready")
    assert not any(guard._open(p) for p in ("/cluster", "/metrics", "/v1/models", "/healthz", "/docs"))
    assert Guard(None, [], 1024)._open("/cluster")  # no keys: open


def test_salt_per_key_separates_tenants_and_keeps_request_salts():
    assert key_salt("sk-one", "") != key_salt("sk-two", "")
    assert key_salt("sk-one", "a") != key_salt("sk-one", "b") != key_salt("sk-one", "")
    assert key_salt("sk-one", "a") == key_salt("sk-one", "a") and "sk-one" not in key_salt("sk-one", "a")
    scope = {"state": {"api_key": "sk-one"}}
    assert request_salt(True, scope, "x") == key_salt("sk-one", "x")
    assert request_salt(False, scope, "x") == "x" and request_salt(True, {}, "x") == "x"


def test_several_keys_from_toml_environment_and_cli(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[conductor]\napi_key = "a"\napi_keys = ["b", "c"]\nsalt_per_api_key = true\n')
    cfg = load_config(f, env={})
    assert cfg.frontend.accepted_keys() == ["a", "b", "c"] and cfg.frontend.salt_per_api_key
    cfg = load_config(None, env={"MOONCAKE_CONDUCTOR_API_KEYS": "x, y,,"})
    assert cfg.frontend.accepted_keys() == ["x", "y"]
    args = argparse.Namespace(model=None, host=None, port=None, data_dir=None, api_key=["p", "q,r"])
    cfg = load_config(None, _overrides(args), env={})
    assert cfg.frontend.api_key == "p" and cfg.frontend.accepted_keys() == ["p", "q", "r"]


def test_several_keys_salt_per_key_unless_the_operator_shares_the_cache():
    assert not FrontendConfig().salts_per_key() and not FrontendConfig(api_key="a").salts_per_key()
    assert FrontendConfig(api_key="a", api_keys=["b"]).salts_per_key()
    assert not FrontendConfig(api_key="a", api_keys=["a"]).salts_per_key()  # one key, named twice
    assert not FrontendConfig(api_key="a", api_keys=["b"], salt_per_api_key=False).salts_per_key()
    assert FrontendConfig(api_key="a", salt_per_api_key=True).salts_per_key()
    assert FrontendConfig(salt_per_api_key="false").salt_per_api_key is False  # as MOONCAKE_FRONTEND_SALT_PER_API_KEY
