"""`mooncake deploy kubernetes` as a user runs it (the CLI, from config.example.toml): every pod
it renders can start (off loopback a role needs CURVE keys, or the config's explicit
``allow_insecure_network``), and Prometheus finds the conductor's /metrics."""

from __future__ import annotations

from pathlib import Path

import k8s_manifests as k8s
import pytest
import yaml

from mooncake.config import load_config
from mooncake.deploy import keys as deploy_keys
from mooncake.deploy.kubernetes import DeployError, Topology, render
from mooncake.security import (KINDS, ROLE_KIND, Curve, InsecureNetworkError, check_network, generate_keys,
                               role_endpoints)

EXAMPLE = k8s.ROOT / "config.example.toml"
SERVICE_MONITOR = "monitoring/servicemonitor.yaml"


def _deploy(tmp_path: Path, config: Path, *args: str) -> list[dict]:
    """Render with the CLI, validate under the Kubernetes schemas; the objects `kubectl apply -f` reads."""
    out = tmp_path / "out"
    r = k8s.cli("deploy", "kubernetes", "--config", str(config), "--out", str(out), *args)
    assert r.returncode == 0, r.stderr
    k8s.validate(out)
    return k8s.objects(out)


def _off_loopback(role: str, cfg) -> bool:
    try:
        check_network(role, role_endpoints(cfg, role), "", False)
    except InsecureNetworkError:
        return True
    return False


def _mounted_keys(objs: list[dict], spec: dict, mount_path: str, into: Path) -> set[str]:
    """Writes the key files the pod's container sees at ``mount_path`` into ``into``; their names."""
    secrets = {o["metadata"]["name"]: o["stringData"] for o in objs if o["kind"] == "Secret"}
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == mount_path)
    assert mount["name"] == "curve"
    into.mkdir()
    for secret, key, path in k8s.curve_items(spec):  # the Secrets are rendered beside the pods
        (into / path).write_text(secrets[secret][key])
    return {path for _, _, path in k8s.curve_items(spec)}


def _assert_every_pod_can_start(objs: list[dict], tmp_path: Path) -> None:
    specs = k8s.pod_specs(objs)
    assert set(specs) == {"conductor", "frontend", "prefill", "decode", "store"}
    for role, spec in specs.items():
        cfg = k8s.effective(objs, spec["containers"][0])
        assert _off_loopback(role, cfg), role  # in a pod every role talks at its pod IP
        if cfg.security.allow_insecure_network:
            continue
        assert cfg.security.curve_keys_dir, role
        files = _mounted_keys(objs, spec, cfg.security.curve_keys_dir, tmp_path / role)
        # the public keys and the secret key of its own kind only (a frontend: its own)
        publics = {f"{kind}.key" for kind in KINDS if kind != "frontend"} | {"frontend-0.key", "frontend-1.key"}
        assert files == publics | {f"{ROLE_KIND[role]}.key_secret"}, role
        Curve(tmp_path / role, role, cfg.node.node_id)  # what the role loads at start: these keys load
    owns = set()
    for name, spec in k8s.frontend_specs(objs).items():
        cfg = k8s.effective(objs, spec["containers"][0])
        if not cfg.security.allow_insecure_network:
            _mounted_keys(objs, spec, cfg.security.curve_keys_dir, tmp_path / name)
            owns.add(Curve(tmp_path / name, "frontend", cfg.node.node_id).public)
    assert len(owns) in (0, 2)  # each frontend its own key


def test_the_example_config_deploys_pods_that_can_start(tmp_path):
    objs = _deploy(tmp_path, EXAMPLE)
    _assert_every_pod_can_start(objs, tmp_path)
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == "mooncake-curve")
    assert set(secret["stringData"]) == {f"{k}.{e}" for k in KINDS if k != "frontend" for e in ("key", "key_secret")} | \
        {"frontend-0.key", "frontend-1.key"}  # generated: a key per frontend, each secret in its own Secret
    elsewhere = yaml.safe_dump_all([o for o in objs if o["kind"] != "Secret"])
    assert not any(text.strip() in elsewhere for text in secret["stringData"].values())
    # new manifests with new keys restart every pod (no pod keeps keys the others no longer accept)
    digests = {spec_meta["annotations"]["checksum/curve-keys"] for spec_meta in
               (o["spec"]["template"]["metadata"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")
                and o["metadata"]["name"] != "mooncake-etcd")}
    assert len(digests) == 1
    again = _deploy(tmp_path / "again", EXAMPLE)
    assert {o["spec"]["template"]["metadata"]["annotations"]["checksum/curve-keys"]
            for o in again if o["kind"] == "Deployment"}.isdisjoint(digests)


def test_configured_keys_are_the_ones_deployed(tmp_path):
    generate_keys(tmp_path / "keys", ["0", "1"])
    config = tmp_path / "c.toml"
    config.write_text(f'[security]\ncurve_keys_dir = "{tmp_path / "keys"}"\n')
    objs = _deploy(tmp_path, config)
    _assert_every_pod_can_start(objs, tmp_path)
    secret = next(o for o in objs if o["metadata"]["name"] == "mooncake-curve")
    assert secret["stringData"] == {p.name: p.read_text() for p in (tmp_path / "keys").iterdir()
                                    if not (p.name.startswith("frontend") and p.name.endswith("_secret"))}


def test_allow_insecure_network_deploys_without_keys(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[security]\nallow_insecure_network = true\n")
    objs = _deploy(tmp_path, config)
    _assert_every_pod_can_start(objs, tmp_path)
    assert not any(o["kind"] == "Secret" for o in objs)
    for spec in k8s.pod_specs(objs).values():
        assert not any(v["name"] == "curve" for v in spec["volumes"])
        assert k8s.effective(objs, spec["containers"][0]).security.curve_keys_dir == ""


@pytest.mark.parametrize("breakage", ["no_curve", "generation_fails"])
def test_without_keys_that_cannot_be_generated_deploy_refuses(monkeypatch, breakage):
    if breakage == "no_curve":
        monkeypatch.setattr(deploy_keys.zmq, "has", lambda capability: False)
    else:
        def fail(directory, *names):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(deploy_keys, "generate_keys", fail)
    with pytest.raises(DeployError) as e:
        render(load_config(EXAMPLE, env={}), Topology())
    assert "mooncake keys" in str(e.value) and "allow_insecure_network" in str(e.value)


@pytest.mark.parametrize("api_keys", ["", 'api_key = "sk-ops"\napi_keys = ["sk-tenant"]\n', 'api_keys = ["sk-a"]\n'])
def test_service_monitors_and_scrape_annotations_find_the_frontend_and_conductor_metrics(tmp_path, api_keys):
    config = tmp_path / "c.toml"
    config.write_text(f"[frontend]\nport = 8080\n{api_keys}")
    objs = _deploy(tmp_path, config)
    monitors = {m["metadata"]["name"]: m for m in yaml.safe_load_all((tmp_path / "out" / SERVICE_MONITOR).read_text())}
    assert set(monitors) == {"mooncake-frontend", "mooncake-conductor"}
    for name, monitor in monitors.items():
        role = name.removeprefix("mooncake-")
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "ServiceMonitor"
        service = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == name)
        assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        endpoint, = monitor["spec"]["endpoints"]
        port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
        spec = k8s.pod_specs(objs)[role]
        cfg = k8s.effective(objs, spec["containers"][0])
        want = cfg.frontend.port if role == "frontend" else cfg.node.health_port
        assert port["port"] == want and endpoint["path"] == "/metrics"
        accepted = cfg.frontend.accepted_keys()
        if accepted and role == "frontend":  # /metrics needs a key: Prometheus sends one from the API-key Secret
            ref = endpoint["bearerTokenSecret"]
            secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == ref["name"])
            assert secret["metadata"]["namespace"] == monitor["metadata"]["namespace"]
            assert secret["stringData"][ref["key"]] in accepted
        else:  # no key: a conductor's health port serves no API
            assert "bearerTokenSecret" not in endpoint
        template = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] in (name, f"{name}-0"))
        annotations = template["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        named = next(p for p in spec["containers"][0]["ports"] if p["name"] == endpoint["port"])
        assert annotations["prometheus.io/port"] == str(named["containerPort"]) == str(want)
