"""`mooncake deploy kubernetes`: manifests valid under the Kubernetes schemas
(kubernetes-validate --strict, offline) and consistent with what each role binds."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import k8s_manifests as k8s
import pytest
import yaml

from mooncake.config import Config, load_config
from mooncake.deploy.kubernetes import DeployError, Topology, render, write_manifests
from mooncake.security import generate_keys

ROOT = k8s.ROOT

@pytest.fixture
def gpu_config(tmp_path) -> Path:
    """Two nodes' worth of GPU cluster: CUDA, CURVE keys, an API key, non-default ports."""
    generate_keys(tmp_path / "keys", ["0", "1"])  # a key per frontend
    path = tmp_path / "gpu.toml"
    path.write_text(f'[model]\ndevice = "cuda"\n[conductor]\nport = 8080\napi_key = "sk-secret"\n'
                    f'endpoint = "tcp://10.0.0.1:6000"\ndrain_timeout_s = 120\n'
                    f'[node]\nkv_port = 7001\nstore_port = 7002\nhealth_port = 7003\np2p_port = 7004\n'
                    f'[security]\ncurve_keys_dir = "{tmp_path / "keys"}"\n')
    return path


@pytest.mark.parametrize("which", ["example", "gpu"])
def test_manifests_validate_against_the_kubernetes_schemas(tmp_path, gpu_config, which):
    config = ROOT / "config.example.toml" if which == "example" else gpu_config
    counts = ["--prefill", "2", "--decode", "2", "--store", "2"] if which == "gpu" else []
    r = k8s.cli("deploy", "kubernetes", "--config", str(config), "--out", str(tmp_path / "out"), *counts)
    assert r.returncode == 0, r.stderr
    written = r.stdout.split()
    assert written and all(p.endswith(".yaml") and Path(p).is_file() for p in written)
    k8s.validate(tmp_path / "out")
    kinds = sorted(o["kind"] for o in k8s.objects(tmp_path / "out"))
    expected = ["ConfigMap", "Deployment", "Deployment", "Deployment", "Deployment", "Deployment", "Namespace",
                "Service", "Service", "Service", "Service", "StatefulSet", "StatefulSet"]  # + 2 frontends, etcd
    secrets = ["Secret"] * (4 if which == "gpu" else 3)  # CURVE keys, each frontend's own (+ the API key)
    assert kinds == sorted(expected + secrets)


def _bound_ports(role: str, cfg: Config) -> set[int]:
    if role == "conductor":
        return {cfg.node.health_port, urlparse(cfg.conductor.endpoint).port}
    if role == "frontend":
        return {cfg.frontend.port, cfg.frontend.token_port}
    return {cfg.node.health_port} | {"decode": {cfg.node.kv_port},
                                     "store": {cfg.node.store_port, cfg.node.p2p_port}}.get(role, set())


def test_every_bound_port_is_the_port_its_service_and_probes_use(tmp_path, gpu_config):
    cfg = load_config(gpu_config, env={})
    objects = [o for objs in render(cfg, Topology(prefill=2, decode=2, store=2)).values() for o in objs]
    workloads = {o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: o
                 for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    assert set(workloads) == {"conductor", "frontend", "prefill", "decode", "store", "etcd"}
    fronts = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("mooncake-frontend")]
    assert [(o["metadata"]["name"], o["spec"]["replicas"]) for o in fronts] == [("mooncake-frontend-0", 1),
                                                                                ("mooncake-frontend-1", 1)]
    assert workloads["conductor"]["spec"]["replicas"] == 2
    etcd = workloads.pop("etcd")  # not a mooncake role: the conductors' election
    assert etcd["kind"] == "StatefulSet" and etcd["spec"]["replicas"] == 1
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    conductor_svc = services["mooncake-conductor"]
    for role, workload in workloads.items():
        pod = workload["spec"]["template"]["spec"]
        container = pod["containers"][0]
        effective = k8s.effective(objects, container)
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert set(named.values()) == _bound_ports(role, effective), role
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            port = container[probe]["httpGet"]["port"]
            want = effective.frontend.port if role == "frontend" else effective.node.health_port
            assert named[port] == want, (role, probe)
        ready = "/health/live" if role == "conductor" else "/health/ready"  # a standby conductor is healthy
        assert container["readinessProbe"]["httpGet"]["path"] == ready
        assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
        assert pod["terminationGracePeriodSeconds"] > effective.liveness.drain_timeout_s
        assert effective.node.host == k8s.POD["status.podIP"] and effective.node.node_id == k8s.POD["metadata.name"]
        assert effective.node.name == k8s.POD["spec.nodeName"]
        assert effective.security.curve_keys_dir == "/etc/mooncake/curve"
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/etc/mooncake/curve" in mounts
        curve_files = {path for _, _, path in k8s.curve_items(pod)}
        kind = {"prefill": "worker", "decode": "worker"}.get(role, role)  # a frontend: its own key, never the conductor's
        assert curve_files == {"conductor.key", "worker.key", "store.key", "frontend-0.key", "frontend-1.key",
                               f"{kind}.key_secret"}, role
        assert effective.coordination.etcd_endpoints == ["http://mooncake-etcd.mooncake.svc.cluster.local:2379"]
        assert not effective.conductor.serves_frontend(True)
        if role == "frontend":
            assert effective.frontend.api_key == "sk-secret" and effective.frontend.host == "0.0.0.0"
        if role == "conductor":
            assert urlparse(effective.conductor.endpoint).hostname == "0.0.0.0"
        else:  # roles reach the conductor through its Service, on the port the conductor binds
            url = urlparse(effective.conductor.endpoint)
            assert url.hostname == "mooncake-conductor.mooncake.svc.cluster.local"
            assert url.port in {p["port"] for p in conductor_svc["spec"]["ports"]}
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (1 if role in ("prefill", "decode") else None), role
    conductor_ports = {p["name"]: p["containerPort"] for p in workloads["conductor"]["spec"]["template"]["spec"]
                       ["containers"][0]["ports"]}
    for p in conductor_svc["spec"]["ports"]:
        assert conductor_ports[p["targetPort"]] == p["port"]
    store = workloads["store"]
    assert store["kind"] == "StatefulSet" and store["spec"]["serviceName"] in services
    store_effective = k8s.effective(objects, store["spec"]["template"]["spec"]["containers"][0])
    assert store_effective.node.p2p_port != 0  # peers connect to it: a fixed port, not any free one
    store_svc = {p["name"]: p for p in services[store["spec"]["serviceName"]]["spec"]["ports"]}
    assert store_svc["p2p"]["port"] == store_effective.node.p2p_port
    assert store_svc["store"]["port"] == store_effective.node.store_port
    store_container = store["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "data", "mountPath": k8s.effective(objects, store_container).store.data_dir} in \
        store_container["volumeMounts"]
    assert store["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    anti = store["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == store["spec"]["selector"]["matchLabels"]
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    assert "sk-secret" not in configmap["data"]["cluster.toml"]
    curve = next(o for o in objects if o["metadata"]["name"] == "mooncake-curve")
    assert set(curve["stringData"]) == {f"{k}.{e}" for k in ("conductor", "worker", "store") for e in ("key", "key_secret")} | \
        {"frontend-0.key", "frontend-1.key"}  # the frontends' secret keys: each in a Secret of its own
    service = services["mooncake-frontend"]  # one Service in front of every frontend
    assert all(service["spec"]["selector"].items() <= o["spec"]["template"]["metadata"]["labels"].items() for o in fronts)


def test_cpu_config_requests_no_gpu():
    files = render(load_config(ROOT / "config.example.toml", env={}), Topology())
    text = yaml.safe_dump_all([o for objs in files.values() for o in objs])
    assert "nvidia.com/gpu" not in text


def test_a_store_p2p_port_left_at_0_gets_a_fixed_default():
    cfg = load_config(ROOT / "config.example.toml", env={})
    assert cfg.node.p2p_port == 0
    objects = [o for objs in render(cfg, Topology()).values() for o in objs]
    container = _pod_spec(objects, "store")["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert k8s.effective(objects, container).node.p2p_port == ports["p2p"] == 5580


def _pod_spec(objects: list[dict], component: str) -> dict:
    return next(o for o in objects if o["kind"] in ("Deployment", "StatefulSet")
                and o["metadata"]["labels"].get("app.kubernetes.io/component") == component)["spec"]["template"]["spec"]


def test_a_p2p_model_is_fetched_by_the_node_store_into_a_directory_its_workers_mount(tmp_path):
    """``[model] p2p_name``: the store pod writes the model into the node's model directory
    (hostPath), each worker mounts the same directory at the same path, read-only, runs only
    beside a store, and its config points its model path there."""
    path = tmp_path / "c.toml"
    path.write_text('[model]\np2p_name = "smollm2@v1"\npath = "/home/me/models/smol"\n')
    out = tmp_path / "out"
    write_manifests(load_config(path, env={}), Topology(store=2), out)
    k8s.validate(out)
    objects = k8s.objects(out)
    store = _pod_spec(objects, "store")
    host_dirs = {v["hostPath"]["path"] for v in store["volumes"] if "hostPath" in v}
    assert len(host_dirs) == 1
    mount = next(m for m in store["containers"][0]["volumeMounts"] if m["name"] == "models")
    assert not mount.get("readOnly")
    owner = store["initContainers"][0]  # the kubelet creates the directory as root
    assert owner["command"][:2] == ["chown", f"{store['securityContext']['runAsUser']}:"
                                    f"{store['securityContext']['runAsGroup']}"]
    assert owner["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    for role in ("prefill", "decode"):
        spec = _pod_spec(objects, role)
        assert {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v} == host_dirs
        wmount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "models")
        assert wmount["mountPath"] == mount["mountPath"] and wmount["readOnly"] is True
        cfg = k8s.effective(objects, spec["containers"][0])
        assert cfg.model.p2p_name == "smollm2@v1"
        assert Path(cfg.model.path).parent == Path(cfg.node.p2p_root)  # fetched where the store may write
        assert Path(cfg.node.p2p_root).parent == Path(mount["mountPath"])  # under the shared directory
        assert Path(cfg.node.p2p_key_file).parent == Path(mount["mountPath"])  # beside it: workers read the key
        term = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        stores = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "mooncake-store")
        assert term["labelSelector"]["matchLabels"] == stores["spec"]["selector"]["matchLabels"]


def test_without_a_p2p_model_no_pod_mounts_a_node_directory():
    objects = [o for objs in render(load_config(ROOT / "config.example.toml", env={}), Topology()).values()
               for o in objs]
    for component in ("prefill", "decode", "store"):
        spec = _pod_spec(objects, component)
        assert not any("hostPath" in v for v in spec["volumes"]) and "initContainers" not in spec
        assert "podAffinity" not in spec.get("affinity", {})


@pytest.mark.parametrize("toml, topology, message", [
    ('[model]\np2p_name = "m"\n', Topology(store=0), "through their node's store"),
    ('[conductor]\nendpoint = "ipc:///tmp/x"\n', Topology(), "tcp://HOST:PORT"),
    ('[conductor]\nendpoint = "tcp://10.0.0.1:*"\n', Topology(), "fixed port"),
    ("[conductor]\nport = 0\n", Topology(), "port is 0"),
    ('[security]\ncurve_keys_dir = "/nonexistent/keys"\n', Topology(), "conductor.key_secret"),
    ("", Topology(namespace="Bad_NS"), "DNS label"),
    ("", Topology(decode=0), "at least one prefill and one decode replica, or a colocated one"),
    ("", Topology(image=" "), "--image"),
])
def test_undeployable_configs_say_why(tmp_path, toml, topology, message):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(DeployError, match=message):
        write_manifests(load_config(path, env={}), topology, tmp_path / "out")


def test_cli_reports_deploy_errors(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[conductor]\nendpoint = "ipc:///tmp/x"\n')
    r = k8s.cli("deploy", "kubernetes", "--config", str(path), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "tcp://HOST:PORT" in r.stderr


def test_colocated_replicas_render_a_deployment_of_their_own():
    files = render(load_config(ROOT / "config.example.toml", env={}), Topology(prefill=0, decode=0, colocated=3))
    objects = [o for objs in files.values() for o in objs]
    colocated = next(o for o in objects if o["kind"] == "Deployment"
                     and o["metadata"]["labels"]["app.kubernetes.io/component"] == "colocated")
    assert colocated["spec"]["replicas"] == 3
    assert "colocated" in _pod_spec(objects, "colocated")["containers"][0]["command"]
    assert not any(o["metadata"]["labels"].get("app.kubernetes.io/component") in ("prefill", "decode")
                   for o in objects if o["kind"] == "Deployment")


def test_each_frontend_needs_a_key_of_its_own(tmp_path):
    """A key directory with one frontend key cannot serve two frontends (the message says how to add
    keys); one frontend deploys with the one ``frontend`` pair, mounted as its own."""
    generate_keys(tmp_path / "keys")  # `mooncake keys DIR`: one frontend key
    cfg = load_config(None, env={}, overrides={"security": {"curve_keys_dir": str(tmp_path / "keys")}})
    with pytest.raises(DeployError, match="--frontends-only --frontend 0 --frontend 1"):
        render(cfg, Topology(frontend=2))
    objects = [o for objs in render(cfg, Topology(frontend=1)).values() for o in objs]
    (spec,) = k8s.frontend_specs(objects).values()
    assert ("mooncake-curve-frontend-0", "frontend.key_secret", "frontend.key_secret") in k8s.curve_items(spec)
    assert not any(path == "conductor.key_secret" for _, _, path in k8s.curve_items(spec))
