"""Configuration from the environment (MOONCAKE_<SECTION>_<KEY>) and `mooncake config check`."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake.config import Config, ConfigError, env_name, load_config
from mooncake.config_classes import KeyTerms
from mooncake.config_section import Section
from mooncake.config_toml import dump_toml

ROOT = Path(__file__).resolve().parent.parent


def test_environment_sets_every_key_over_the_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[node]\nhost = "10.0.0.5"\nname = "a"\n[conductor]\nport = 9000\n')
    cfg = load_config(f, env={"MOONCAKE_NODE_HOST": "10.0.0.7", "MOONCAKE_LIVENESS_DEAD_AFTER_S": "4.5",
                              "MOONCAKE_ENGINE_PREFIX_CACHING": "false", "PATH": "/bin"})
    assert cfg.node.host == "10.0.0.7" and cfg.node.name == "a"  # env over file; file over default
    assert cfg.frontend.port == 9000 and cfg.liveness.dead_after_s == 4.5
    assert cfg.engine.prefix_caching is False


def _keys(model: Section, prefix: str) -> dict[str, object]:
    """Every key's variable -> its value (a table's keys: MOONCAKE_<SECTION>_<TABLE>_<KEY>)."""
    keys: dict[str, object] = {}
    for key, value in model:
        if isinstance(value, Section):
            keys.update(_keys(value, f"{prefix}_{key}"))
        else:
            keys[env_name(prefix, key)] = value
    return keys


def test_every_key_has_a_variable_parsed_as_its_type():
    defaults = Config()
    values = {var: value for section, model in defaults for var, value in _keys(model, section).items()}
    env = {var: (str(value).lower() if isinstance(value, bool) else str(value))
           for var, value in values.items() if value is not None}
    assert "MOONCAKE_CLASSES_FLEX_MAX_SHARE" in env and "MOONCAKE_CLASSES_DEFAULT_MAX_SHARE" in env
    assert load_config(env=env) == defaults  # strings in, typed values out


def test_a_class_table_takes_the_admission_values_where_it_sets_none(tmp_path, caplog):
    f = tmp_path / "c.toml"
    f.write_text("[admission]\nttft_slo_ms = 900\n[classes]\nflex_max_waiting = 9\n"
                 "[classes.priority]\nttft_slo_ms = 300\n[classes.flex]\ntbt_slo_ms = 80\n")
    cfg = load_config(f, env={"MOONCAKE_CLASSES_DEFAULT_MAX_WAITING": "7"})
    c = cfg.classes
    assert [c.limit(t, "ttft_slo_ms", cfg.admission) for t in ("priority", "default", "flex")] == [300, 900, 0]
    assert [c.limit(t, "max_waiting", cfg.admission) for t in ("priority", "default", "flex")] == [256, 7, 9]
    assert c.flex.tbt_slo_ms == 80 and c.flex.request_timeout_s == 3600  # flex keeps its own defaults
    assert "moved to [classes.flex]" in caplog.text  # an earlier layout's key still works
    text = dump_toml(cfg, comments=True)
    assert "[classes.flex]\n" in text and "# ttft_slo_ms = (unset)" in text
    f.write_text(text)
    assert load_config(f, env={}) == cfg  # what config check prints loads back the same
    with pytest.raises(ConfigError, match=r"classes.flex.max_share .*MOONCAKE_CLASSES_FLEX_MAX_SHARE"):
        load_config(env={"MOONCAKE_CLASSES_FLEX_MAX_SHARE": "1.5"})


def test_cli_overrides_beat_the_environment():
    cfg = load_config(overrides={"frontend": {"port": 1234}}, env={"MOONCAKE_FRONTEND_PORT": "99"})
    assert cfg.frontend.port == 1234


def test_keys_moved_to_frontend_still_work_from_conductor_with_a_warning(tmp_path, caplog):
    f = tmp_path / "old.toml"
    f.write_text('[conductor]\nport = 9000\napi_key = "k"\ndead_after_s = 4.0\n')
    cfg = load_config(f, env={"MOONCAKE_CONDUCTOR_SSE_KEEPALIVE_S": "3"})
    assert (cfg.frontend.port, cfg.frontend.api_key, cfg.frontend.sse_keepalive_s) == (9000, "k", 3.0)
    assert cfg.liveness.dead_after_s == 4.0
    assert "moved to [frontend]" in caplog.text and "port" in caplog.text
    both = load_config(f, env={"MOONCAKE_FRONTEND_PORT": "9100"})  # the new name wins
    assert both.frontend.port == 9100


def test_conductor_keys_split_by_concern_still_work_from_conductor_with_a_warning(tmp_path, caplog):
    """[conductor] held SLOs, liveness and replication keys: each now lives in its own section
    ([admission], [liveness], [replication]); the old place works in TOML and as MOONCAKE_CONDUCTOR_<KEY>."""
    f = tmp_path / "old.toml"
    f.write_text('[conductor]\npolicy = "least_loaded"\nttft_slo_ms = 900.0\nmax_requests = 64\nreplicas = 2\n')
    cfg = load_config(f, env={"MOONCAKE_CONDUCTOR_HEARTBEAT_S": "0.5"})
    assert cfg.conductor.policy == "least_loaded"  # still the conductor's
    assert (cfg.admission.ttft_slo_ms, cfg.admission.max_requests) == (900.0, 64)
    assert (cfg.replication.replicas, cfg.liveness.heartbeat_s) == (2, 0.5)
    for key, section in (("ttft_slo_ms", "admission"), ("replicas", "replication"), ("heartbeat_s", "liveness")):
        assert f"[conductor] {key} moved to [{section}]" in caplog.text
    assert "MOONCAKE_ADMISSION_TTFT_SLO_MS" in caplog.text  # the new variable is named
    newer = load_config(f, env={"MOONCAKE_ADMISSION_TTFT_SLO_MS": "500"})  # the new place wins
    assert newer.admission.ttft_slo_ms == 500.0
    with pytest.raises(ConfigError, match=r"liveness.dead_after_s .*MOONCAKE_CONDUCTOR_DEAD_AFTER_S"):
        load_config(env={"MOONCAKE_CONDUCTOR_DEAD_AFTER_S": "-1"})
    assert not hasattr(cfg.conductor, "ttft_slo_ms")


@pytest.mark.parametrize("env, words", [
    ({"MOONCAKE_CONDUCTOR_PORT": "eighty"}, ["frontend.port", "MOONCAKE_CONDUCTOR_PORT", "'eighty'"]),
    ({"MOONCAKE_FRONTEND_PORT": "eighty"}, ["frontend.port", "MOONCAKE_FRONTEND_PORT", "'eighty'"]),
    ({"MOONCAKE_CONDUCTOR_PORT": "70000"}, ["MOONCAKE_CONDUCTOR_PORT", "65535"]),
    ({"MOONCAKE_MODEL_DEVICE": "tpu"}, ["MOONCAKE_MODEL_DEVICE", "cpu"]),
])
def test_bad_environment_values_name_the_variable(env, words):
    with pytest.raises(ConfigError) as e:
        load_config(env=env)
    for w in words:
        assert w in str(e.value)


def test_api_keys_bound_to_a_class_are_checked_and_never_printed():
    cfg = load_config(env={"MOONCAKE_CLASSES_API_KEY_CLASSES": "sk-batch=flex, sk=vip=priority;min_priority=-5;weight=2"})
    assert cfg.classes.terms_of_key("sk-batch") == KeyTerms("flex")
    assert cfg.classes.terms_of_key("sk=vip") == KeyTerms("priority", min_priority=-5, weight=2.0)
    assert cfg.classes.terms_of_key("sk-other") == KeyTerms("default", min_priority=0, weight=1.0)
    assert 'api_key_classes = ["***=flex", "***=priority;min_priority=-5;weight=2"]' in dump_toml(cfg, mask_secrets=True)
    for bad in ("sk-secret=default;weight=0", "sk-secret=flex;min_priority=high", "sk-secret=flex;share=2"):
        with pytest.raises(ConfigError) as e:
            load_config(env={"MOONCAKE_CLASSES_API_KEY_CLASSES": bad})
        assert "min_priority=N" in str(e.value) and "sk-secret" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(env={"MOONCAKE_CLASSES_API_KEY_CLASSES": "sk-secret=gold"})
    assert "MOONCAKE_CLASSES_API_KEY_CLASSES" in str(e.value) and "KEY=CLASS" in str(e.value)
    assert "sk-secret" not in str(e.value)


def test_a_bad_file_value_names_the_key_not_a_variable(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[engine]\nblock_tokens = 0\n")
    with pytest.raises(ConfigError, match=r"engine.block_tokens: .*greater than or equal") as e:
        load_config(f, env={})
    assert "MOONCAKE_" not in str(e.value)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MOONCAKE_")}
    return subprocess.run([sys.executable, "-m", "mooncake.cli", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=120)


def test_config_check_prints_the_effective_config():
    r = _cli("config", "check", str(ROOT / "config.example.toml"), env={"MOONCAKE_NODE_HOST": "10.1.2.3"})
    assert r.returncode == 0, r.stderr
    effective = load_config(env={"MOONCAKE_NODE_HOST": "10.1.2.3"})
    assert 'host = "10.1.2.3"' in r.stdout
    assert r.stdout.count("[") >= 6 and "[security]" in r.stdout
    assert effective.node.host == "10.1.2.3"


def test_config_check_reports_errors_and_fails(tmp_path):
    r = _cli("config", "check", str(ROOT / "config.example.toml"), env={"MOONCAKE_ENGINE_MAX_BATCH": "0"})
    assert r.returncode == 2
    assert "MOONCAKE_ENGINE_MAX_BATCH" in r.stderr and "engine.max_batch" in r.stderr
    r = _cli("config", "check", str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and "config file not found" in r.stderr


@pytest.mark.parametrize("var, hint", [
    ("MOONCAKE_NODE_HOSTNAME", "did you mean MOONCAKE_NODE_HOST?"),
    ("MOONCAKE_LOG_FORMT", "did you mean MOONCAKE_LOG_FORMAT?"),
    ("MOONCAKE_PROTOCOL", "MOONCAKE_<SECTION>_<KEY>"),  # Mooncake's transfer engine reads it: not ours
])
def test_an_unknown_variable_is_a_warning_naming_the_closest_key(var, hint, caplog):
    with caplog.at_level(logging.WARNING, logger="mooncake.config"):
        assert load_config(env={var: "x"}) == load_config(env={})
    assert f"unknown environment variable {var}" in caplog.text and hint in caplog.text


def test_documented_variables_that_are_not_config_keys_pass_silently(caplog):
    with caplog.at_level(logging.WARNING, logger="mooncake.config"):
        load_config(env={"MOONCAKE_LOG_FORMAT": "json", "MOONCAKE_FAULT_LAYER_STREAM": "1"})
    assert caplog.text == ""
