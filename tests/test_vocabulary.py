"""One vocabulary (issue 53): a request's *class* (priority, default, flex: OpenAI's ``service_tier``)
and a store's *tier* (device, dram, lmdb) are never called by each other's name. Old names live on
only as warned aliases: ``[classes] api_key_tiers`` (TOML and MOONCAKE_ variable). The simulator
calls the disk tier ``lmdb``, as the live store does."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import msgspec
import pytest

from mooncake.config import SECRET_KEYS, ConfigError, load_config
from mooncake.config_classes import RENAMED_CLASS_KEYS, ClassesConfig
from mooncake.protocol import requests as P

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mooncake"


def _sources(under: Path = PKG) -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(under.rglob("*.py"))}


def test_the_wire_calls_a_request_class_a_class():
    assert "tier" not in P.Sampling.__struct_fields__ and "request_class" in P.Sampling.__struct_fields__
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(P.Sampling(request_class="flex")), type=P.Sampling)
    assert wire.request_class == "flex"
    assert "api_key_tiers" not in ClassesConfig.model_fields and "api_key_classes" in ClassesConfig.model_fields


# (pattern, the files it may appear in: the alias code itself)
FORBIDDEN = [
    (r"sampling\.tier\b", ()), (r"\bSampling\([^)]*\btier=", ()), (r"\bTIERS\b", ()), (r"\bserved_tier\b", ()),
    (r"\bkey_tier\b", ()), (r"\[classes\.<tier>\]", ()), (r"\bflood_tier\b", ()),
    (r"\bapi_key_tiers\b", ("config_classes.py",)), (r"API_KEY_TIERS", ("config_classes.py",)),
]


@pytest.mark.parametrize("pattern, allowed", FORBIDDEN)
def test_no_source_calls_a_request_class_a_tier(pattern, allowed):
    found = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
             for p, text in {**_sources(), **_sources(ROOT / "benchmarks")}.items() if p.name not in allowed
             for m in re.finditer(pattern, text)]
    assert not found, f"{pattern} (a request class is a class; a tier is a store's): {found}"


def test_the_simulator_calls_the_disk_tier_lmdb():
    """Its tier names and keys are the live store's (``dram``, ``lmdb``); SSD is only the hardware."""
    found = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
             for p, text in _sources(PKG / "sim").items() for m in re.finditer(r"ssd", text)]
    assert not found, f"the simulator's disk tier is lmdb, as in the live code: {found}"


def test_api_key_tiers_in_toml_is_a_warned_alias(tmp_path, caplog):
    f = tmp_path / "c.toml"
    f.write_text('[classes]\napi_key_tiers = ["sk-batch=flex;weight=2"]\n')
    with caplog.at_level(logging.WARNING, logger="mooncake.config_classes"):
        cfg = load_config(f, env={})
    assert cfg.classes.api_key_classes == ["sk-batch=flex;weight=2"]
    assert cfg.classes.terms_of_key("sk-batch").request_class == "flex"
    assert "api_key_tiers" in caplog.text and "deprecated" in caplog.text and "api_key_classes" in caplog.text
    assert "sk-batch" not in caplog.text  # the warning names the key, never its value
    f.write_text('[classes]\napi_key_tiers = ["sk-old=flex"]\napi_key_classes = ["sk-new=priority"]\n')
    assert load_config(f, env={}).classes.api_key_classes == ["sk-new=priority"]  # the new name wins


def test_api_key_tiers_in_the_environment_is_a_warned_alias(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load_config(env={"MOONCAKE_CLASSES_API_KEY_TIERS": "sk-batch=flex, sk-vip=priority;min_priority=-5"})
    assert cfg.classes.api_key_classes == ["sk-batch=flex", "sk-vip=priority;min_priority=-5"]
    assert "MOONCAKE_CLASSES_API_KEY_TIERS" in caplog.text and "MOONCAKE_CLASSES_API_KEY_CLASSES" in caplog.text
    assert "unknown environment variable" not in caplog.text  # an alias, not a typo
    with pytest.raises(ConfigError) as e:  # a bad value names the variable it came from, never the key
        load_config(env={"MOONCAKE_CLASSES_API_KEY_TIERS": "sk-secret=gold"})
    assert "MOONCAKE_CLASSES_API_KEY_TIERS" in str(e.value) and "KEY=CLASS" in str(e.value)
    assert "sk-secret" not in str(e.value)


def test_every_renamed_key_stays_secret_under_its_new_name():
    assert {("classes", new) for new in RENAMED_CLASS_KEYS.values()} <= SECRET_KEYS


def test_the_by_class_series_label_the_class_and_keep_the_old_names_one_release():
    from mooncake.metrics import DEPRECATED_CLASS_SERIES, Metrics

    m = Metrics("m")
    for attr, old_name in DEPRECATED_CLASS_SERIES.items():
        new, old = getattr(m, attr), m.old_class_series[attr]
        assert "request_class" in new._labelnames and "service_tier" not in new._labelnames
        assert old._name == old_name and "service_tier" in old._labelnames
        assert old._documentation.startswith(f"Deprecated: use {new._name}")
    for name in (n for mt in m.registry.collect() for n in [mt.name]):
        assert "tier" not in name or name.startswith("mooncake:tier_") or name in DEPRECATED_CLASS_SERIES.values(), name


def test_api_key_tiers_under_its_old_name_stays_a_secret_in_a_deployment(tmp_path):
    import yaml

    from mooncake.deploy.kubernetes import Topology, write_manifests

    f = tmp_path / "c.toml"
    f.write_text('[classes]\napi_key_tiers = ["sk-old-name-5e1f=flex"]\n[security]\nallow_insecure_network = true\n')
    write_manifests(load_config(f, env={}), Topology(), tmp_path / "out")
    texts = [p.read_text() for p in (tmp_path / "out").rglob("*.yaml")]
    in_secrets = [t for t in texts if any(o and o["kind"] == "Secret" for o in yaml.safe_load_all(t))]
    assert any("sk-old-name-5e1f" in t for t in in_secrets)
    assert not any("sk-old-name-5e1f" in t for t in texts if t not in in_secrets)
