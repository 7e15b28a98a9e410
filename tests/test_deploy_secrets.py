"""`mooncake deploy kubernetes` keeps every secret of the config in Secrets: no value of one reaches
the ConfigMap or any other object it renders, and the pods that use each still get it (from a Secret)."""

from __future__ import annotations

from pathlib import Path

import k8s_manifests as k8s
import pytest
import yaml

from mooncake.config import SECRET_KEYS, Config, load_config
from mooncake.deploy.kubernetes import Topology, write_manifests
from mooncake.security import generate_keys

# Every secret field of the config, with a value recognisable anywhere it would leak to.
SECRETS = {
    ("frontend", "api_key"): "sk-main-3f9a61",
    ("frontend", "api_keys"): ["sk-tenant-77c1e0", "sk-scraper-9e02b4"],
    ("classes", "api_key_classes"): ["sk-tenant-77c1e0=flex;weight=2", "sk-classes-only-51d4aa=priority;min_priority=1"],
}
# The raw keys inside those values (an api_key_classes entry is KEY=CLASS;options).
RAW_KEYS = ["sk-main-3f9a61", "sk-tenant-77c1e0", "sk-scraper-9e02b4", "sk-classes-only-51d4aa"]
# Config fields whose names sound secret but hold none: paths to key files (the CURVE keys travel in
# their own Secret, checked below), ports, counts, switches.
NOT_SECRET = {("security", "curve_keys_dir"), ("node", "p2p_key_file"), ("frontend", "token_port"),
              ("frontend", "salt_per_api_key"), ("classes", "session_blocks_per_key"), ("classes", "session_share_per_key"), ("classes", "store_write_share_per_key"),
              ("engine", "prefill_chunk_tokens"), ("engine", "step_tokens"), ("conductor", "cpp_min_tokens"),
              ("classes", "flex_chunk_tokens"), ("classes", "fair_token_ms"), ("engine", "block_tokens"),
              ("engine", "num_speculative_tokens")}
SECRET_WORDS = ("key", "secret", "password", "token", "credential")


def _fields(model: type, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        out += _fields(sub, (*path, name)) if hasattr(sub, "model_fields") else [(*path, name)]
    return out


def test_every_field_that_may_hold_a_secret_is_listed():
    """A new field named like a secret must join SECRET_KEYS (stripped from the ConfigMap, carried by
    the Secret) or NOT_SECRET; SECRETS here covers every SECRET_KEYS field."""
    named = {f for f in _fields(Config) if any(w in f[-1] for w in SECRET_WORDS)}
    assert named - NOT_SECRET == set(SECRET_KEYS)
    assert set(SECRETS) == set(SECRET_KEYS)


@pytest.fixture
def rendered(tmp_path) -> tuple[Config, list[dict], dict[str, str]]:
    """Manifests of a config with every secret set, CURVE keys included; and those keys' texts."""
    generate_keys(tmp_path / "keys", ["0", "1"])  # a key per frontend
    cfg = load_config(None, env={}, overrides={
        "security": {"curve_keys_dir": str(tmp_path / "keys")},
        **{section: {k: v for (s, k), v in SECRETS.items() if s == section} for section, _ in SECRETS}})
    write_manifests(cfg, Topology(prefill=1, decode=1, store=1, conductor=2), tmp_path / "out")
    objects = k8s.objects(tmp_path / "out") + k8s.objects(tmp_path / "out" / "monitoring")
    curve_secrets = {p.name: p.read_text() for p in (tmp_path / "keys").glob("*.key_secret")}
    return cfg, objects, curve_secrets


def test_no_secret_of_the_config_reaches_an_object_other_than_a_secret(rendered):
    cfg, objects, curve_secrets = rendered
    assert len(curve_secrets) == 5  # conductor, worker, store, two frontends
    curve_texts = [line.split('"')[1] for text in curve_secrets.values() for line in text.splitlines()
                   if "secret-key" in line]
    assert len(curve_texts) == 5
    for obj in objects:
        if obj["kind"] == "Secret":
            continue
        text = yaml.safe_dump(obj)
        for value in RAW_KEYS + curve_texts:
            assert value not in text, (obj["kind"], obj["metadata"]["name"], value)
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    assert "api_key_classes = []" in configmap["data"]["cluster.toml"]


def test_the_frontends_still_get_every_secret_and_each_pod_its_curve_key_from_secrets(rendered):
    cfg, objects, curve_secrets = rendered
    specs = k8s.pod_specs(objects)
    front = k8s.effective(objects, specs["frontend"]["containers"][0])
    for (section, key), value in SECRETS.items():
        assert getattr(getattr(front, section), key) == value, key
    assert front.classes.terms_of_key("sk-classes-only-51d4aa").request_class == "priority"
    secrets = {o["metadata"]["name"]: o["stringData"] for o in objects if o["kind"] == "Secret"}
    for env in specs["frontend"]["containers"][0]["env"]:  # every secret env variable comes from a Secret
        if env["name"].endswith(("API_KEY", "API_KEYS", "API_KEY_CLASSES")):
            assert "secretKeyRef" in env["valueFrom"], env["name"]
    for role, spec in specs.items():
        mounted = {path for _, _, path in k8s.curve_items(spec)}
        assert any(p.endswith(".key_secret") for p in mounted), role
    frontends = {n.removeprefix("frontend-").removesuffix(".key_secret") for n in curve_secrets if n.startswith("frontend")}
    assert frontends == {"0", "1"}
    assert set(secrets["mooncake-curve"]) == {n for n in curve_secrets if not n.startswith("frontend")} | {
        n.removesuffix("_secret") for n in curve_secrets}  # every public key; no frontend's secret key
    for i, (name, spec) in enumerate(sorted(k8s.frontend_specs(objects).items())):
        own = [(secret, key) for secret, key, path in k8s.curve_items(spec) if path.endswith(".key_secret")]
        assert own == [(f"mooncake-curve-frontend-{i}", f"frontend-{i}.key_secret")], name  # its own, alone
        assert secrets[f"mooncake-curve-frontend-{i}"] == {f"frontend-{i}.key_secret": curve_secrets[f"frontend-{i}.key_secret"]}
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor" and "frontend" in o["metadata"]["name"])
    bearer = monitor["spec"]["endpoints"][0]["bearerTokenSecret"]
    assert secrets[bearer["name"]][bearer["key"]] in RAW_KEYS


def test_api_key_classes_alone_still_stay_out_of_the_configmap(tmp_path):
    """Key classes without any accepted key serve no one, yet their raw keys are still secrets."""
    cfg = load_config(None, env={}, overrides={"classes": {"api_key_classes": SECRETS[("classes", "api_key_classes")]},
                                               "security": {"allow_insecure_network": True}})
    write_manifests(cfg, Topology(), tmp_path / "out")
    k8s.validate(tmp_path / "out")
    objects = k8s.objects(tmp_path / "out") + k8s.objects(tmp_path / "out" / "monitoring")
    for obj in (o for o in objects if o["kind"] != "Secret"):
        assert not any(key in yaml.safe_dump(obj) for key in RAW_KEYS), obj["metadata"]["name"]
    front = k8s.effective(objects, k8s.pod_specs(objects)["frontend"]["containers"][0])
    assert front.classes.api_key_classes == SECRETS[("classes", "api_key_classes")]
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor" and "frontend" in o["metadata"]["name"])
    assert "bearerTokenSecret" not in monitor["spec"]["endpoints"][0]  # no key to scrape with


def test_the_written_files_outside_the_secrets_file_hold_no_secret(rendered, tmp_path):
    """What lands on disk (what is committed to a repository next to the ConfigMap) holds none."""
    for path in Path(tmp_path / "out").rglob("*.yaml"):
        text = path.read_text()
        if any(o["kind"] == "Secret" for o in yaml.safe_load_all(text)):
            continue
        assert not any(key in text for key in RAW_KEYS), path.name
