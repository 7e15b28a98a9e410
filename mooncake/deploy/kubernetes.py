"""``mooncake deploy kubernetes``: Kubernetes manifests rendered from a cluster config.

One ConfigMap carries the cluster's TOML; everything that differs per pod comes
from the environment (``MOONCAKE_<SECTION>_<KEY>``): the pod IP as
``MOONCAKE_NODE_HOST`` (downward API), the Kubernetes node name as the mooncake
node name (so that a prefill pod's local store is the one on its machine), the
pod name as the node id. Secrets (every key of ``SECRET_KEYS``: the API keys and ``[classes]
api_key_classes``; the CURVE keys) live in Secrets, never in the ConfigMap (the frontends read the
former as ``MOONCAKE_`` variables from the API-key Secret): every pod is off loopback, so it gets
CURVE keys (``deploy/keys.py``: the configured ones, or new ones) unless the config allows an
insecure network. Each frontend has a key of its own, in a Secret of its own
(``mooncake-curve-frontend-I``), and mounts that secret key, never the conductor's.
Objects: Namespace, ConfigMap, Secrets, conductor Deployment + Service (with ``--conductors``
> 1 the conductors fail over through etcd: ``[coordination] etcd_endpoints``, or a one-member
etcd StatefulSet + Service rendered here), a Deployment per frontend (``--frontends`` of them,
``mooncake-frontend-I``, one replica each: one key each; the OpenAI API) + one Service, prefill and decode Deployments, store StatefulSet (a
PersistentVolumeClaim per pod for the LMDB tier) + headless Service, and apart, in
``monitoring/``, ServiceMonitors of the frontends' and conductors' /metrics
(``deploy/monitoring.py``). With ``[model] p2p_name`` the store fetches
the model into a directory of its node (hostPath ``MODELS_DIR``) that the node's workers
mount, and workers run only on nodes with a store. Every port a role binds is fixed (0 in
the config becomes a default): a store's P2P port too, since peers fetch chunks from
it at the pod's IP, which the store registers with the conductor.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlparse

import yaml

from mooncake import protocol as P
from mooncake.config import SECRET_KEYS, GiB, Config, env_name
from mooncake.config_toml import dump_toml
from mooncake.deploy.keys import KeysError, frontend_stems, pod_key_files
from mooncake.deploy.monitoring import METRICS_KEY, SERVICE_MONITOR_FILE, scrape_annotations, service_monitor
from mooncake.deploy.pods import (CURVE_MOUNT, DATA_MOUNT, MODELS_DIR, CurveMount, PodPorts, conductor_pod, etcd_pod,
                                  frontend_pod, store_volume_claim, worker_pod)

APP = "mooncake"
DEFAULT_PORTS = {"kv_port": 5560, "store_port": 5570, "p2p_port": 5580, "health_port": 8081}
DEFAULT_TOKEN_PORT = 5590
ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class _NoAliases(yaml.SafeDumper):
    """Shared dicts (a selector reused as pod labels) are written out, not as YAML anchors."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def quantity(n_bytes: int) -> str:
    """A byte count as a Kubernetes quantity in MiB, rounded up (``1536Mi``)."""
    return f"{math.ceil(n_bytes / (1 << 20))}Mi"


class DeployError(ValueError):
    """The config cannot be deployed as asked; the message says what to change."""


@dataclass(frozen=True)
class Topology:
    image: str = "mooncake:latest"
    namespace: str = "mooncake"
    prefill: int = 1
    decode: int = 1
    store: int = 1
    colocated: int = 0
    frontend: int = 2
    conductor: int = 2

    def check(self) -> None:
        if not _DNS_LABEL.match(self.namespace):
            raise DeployError(f"namespace {self.namespace!r} is not a DNS label (lowercase letters, digits, '-')")
        if not self.image.strip():
            raise DeployError("--image is empty")
        for role in ("prefill", "decode", "colocated", "store"):
            if getattr(self, role) < 0:
                raise DeployError(f"--{role} must be >= 0")
        if self.colocated < 1 and (self.prefill < 1 or self.decode < 1):
            raise DeployError("a working cluster needs at least one prefill and one decode replica, or a colocated one")
        if self.frontend < 1 or self.conductor < 1:
            raise DeployError("a working cluster needs at least one frontend and one conductor replica")


def conductor_zmq_port(cfg: Config) -> int:
    """The TCP port of ``[conductor] endpoint`` (it must be a fixed tcp:// port)."""
    url = urlparse(cfg.conductor.endpoint)
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "tcp" or not port:
        raise DeployError(f"[conductor] endpoint must be tcp://HOST:PORT with a fixed port to deploy "
                          f"(got {cfg.conductor.endpoint!r})")
    return port


def pod_ports(cfg: Config) -> PodPorts:
    """Every port the roles bind: fixed ones (0 in the config becomes a default)."""
    if not cfg.frontend.port:
        raise DeployError("[frontend] port is 0; a Service needs a fixed HTTP port")
    node = {k: getattr(cfg.node, k) or v for k, v in DEFAULT_PORTS.items()}
    return PodPorts(http=cfg.frontend.port, zmq=conductor_zmq_port(cfg), tokens=cfg.frontend.token_port or
                    DEFAULT_TOKEN_PORT, **node)


def pod_config(cfg: Config, ports: PodPorts, curve: bool, etcd_urls: list[str] | None = None) -> Config:
    """The TOML every pod reads: fixed ports, in-container paths (the key Secret's mount where
    ``curve``), the etcd the conductors fail over through, no secrets."""
    c = cfg.model_copy(deep=True)
    c.coordination.etcd_endpoints = list(etcd_urls or cfg.coordination.etcd_endpoints)
    for section, key in SECRET_KEYS:  # from the Secret (``secret_entries``)
        model = getattr(c, section)
        setattr(model, key, type(model).model_fields[key].get_default(call_default_factory=True))
    c.frontend.host = "0.0.0.0"
    c.frontend.token_port = ports.tokens
    c.conductor.frontend = "off"  # frontends of their own serve the API
    c.node.kv_port, c.node.store_port, c.node.health_port = ports.kv_port, ports.store_port, ports.health_port
    c.node.p2p_port = ports.p2p_port  # peers fetch chunks from it (through the headless Service's pod IPs)
    c.node.host, c.node.name, c.node.node_id = "127.0.0.1", "node0", ""  # per pod, from the environment
    c.store.data_dir = DATA_MOUNT
    if cfg.model.p2p_name:  # fetched by the node's store into the node's model directory
        c.node.p2p_root = f"{MODELS_DIR}/objects"
        c.model.path = f"{c.node.p2p_root}/{cfg.model.p2p_name}"
        c.node.p2p_key_file = f"{MODELS_DIR}/p2p-node.key"  # the workers beside the store read it there
    c.security.curve_keys_dir = CURVE_MOUNT if curve else ""
    return c


def secret_entries(cfg: Config) -> dict[str, tuple[str, str]]:
    """Each key of ``SECRET_KEYS`` the config sets: its environment variable -> (its entry in the
    API-key Secret, its value there; a list as JSON, which the variable also reads)."""
    entries = {}
    for section, key in sorted(SECRET_KEYS):
        value = getattr(getattr(cfg, section), key)
        if value:
            text = value if isinstance(value, str) else json.dumps(value)
            entries[env_name(section, key)] = (key.replace("_", "-"), text)
    return entries


def template_meta(labels: dict[str, str], curve: dict[str, str], annotations: dict[str, str] | None = None) -> dict:
    """A pod template's metadata. A digest of the public keys in its annotations: pods restart
    when new manifests bring new keys, so that no pod keeps keys the others no longer accept."""
    annotations = dict(annotations or {})
    if curve:
        public = "".join(f"{name}\0{text}\0" for name, text in sorted(curve.items()) if name.endswith(".key"))
        annotations["checksum/curve-keys"] = hashlib.sha256(public.encode()).hexdigest()[:16]
    return {"labels": labels, **({"annotations": annotations} if annotations else {})}


def render(cfg: Config, topology: Topology) -> dict[str, list[dict]]:
    """File name -> the objects it holds."""
    topology.check()
    if cfg.model.p2p_name and not topology.store:
        raise DeployError("[model] p2p_name: workers fetch their model through their node's store; "
                          "deploy at least one store (--store)")
    ports = pod_ports(cfg)
    ns = topology.namespace
    conductor_host = f"{APP}-conductor.{ns}.svc.cluster.local"
    gpu = cfg.model.device == "cuda"
    grace = math.ceil(cfg.liveness.drain_timeout_s) + 15
    common_env = {env_name("conductor", "endpoint"): f"tcp://{conductor_host}:{ports.zmq}"}
    etcd_urls = cfg.coordination.etcd_endpoints or (
        [f"http://{APP}-etcd.{ns}.svc.cluster.local:2379"] if topology.conductor > 1 else [])
    try:
        curve = pod_key_files(cfg, topology.frontend)
    except KeysError as e:
        raise DeployError(str(e)) from None
    curve_secret = f"{APP}-curve" if curve else ""
    fronts = frontend_stems(curve)[:topology.frontend]  # one key per frontend
    mount = CurveMount(curve_secret, tuple(n for n in curve if n.endswith(".key"))) if curve else None
    secrets_env = secret_entries(cfg)
    api_key_secret = f"{APP}-api-key" if secrets_env else ""
    metrics_key_secret = api_key_secret if cfg.frontend.accepted_keys() else ""  # what Prometheus sends

    def meta(name: str, **labels: str) -> dict:
        return {"name": name, "namespace": ns, "labels": {"app.kubernetes.io/name": APP, **labels}}

    files: dict[str, list[dict]] = {
        "00-namespace.yaml": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}],
        "01-config.yaml": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(f"{APP}-config"),
                            "data": {"cluster.toml": dump_toml(pod_config(cfg, ports, bool(curve), etcd_urls))}}],
    }
    secrets = []
    if curve:  # no frontend's secret key: each is in a Secret of its own
        secrets.append({"apiVersion": "v1", "kind": "Secret", "metadata": meta(curve_secret), "type": "Opaque",
                        "stringData": {n: t for n, t in curve.items() if n.removesuffix(".key_secret") not in frontend_stems(curve)}})
        secrets += [{"apiVersion": "v1", "kind": "Secret", "metadata": meta(f"{curve_secret}-frontend-{i}"),
                     "type": "Opaque", "stringData": {f"{stem}.key_secret": curve[f"{stem}.key_secret"]}}
                    for i, stem in enumerate(fronts)]
    if api_key_secret:
        data = dict(secrets_env.values())
        if metrics_key_secret:
            data[METRICS_KEY] = cfg.frontend.accepted_keys()[0]
        secrets.append({"apiVersion": "v1", "kind": "Secret", "metadata": meta(api_key_secret),
                        "type": "Opaque", "stringData": data})
    if secrets:
        files["02-secrets.yaml"] = secrets
    pod_args = dict(image=topology.image, ports=ports, grace_s=grace, curve=mount, common_env=common_env)
    p2p_model = bool(cfg.model.p2p_name)

    selector = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "conductor"}
    files["10-conductor.yaml"] = [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(f"{APP}-conductor", **selector),
         "spec": {"replicas": topology.conductor, "strategy": {"type": "Recreate"} if topology.conductor == 1 else
                  {"type": "RollingUpdate"}, "selector": {"matchLabels": selector},
                  "template": {"metadata": template_meta(selector, curve, scrape_annotations(ports.health_port)),
                               "spec": conductor_pod(**pod_args)}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(f"{APP}-conductor", **selector),
         "spec": {"selector": selector, "ports": [
             {"name": "health", "port": ports.health_port, "targetPort": "health", "protocol": "TCP"},
             {"name": "zmq", "port": ports.zmq, "targetPort": "zmq", "protocol": "TCP"}]}},
    ]
    front = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "frontend"}
    files["15-frontend.yaml"] = []
    for i in range(topology.frontend):  # a Deployment each: each frontend mounts its own key
        one = {**front, "mooncake.io/frontend": str(i)}
        own = {"curve": replace(mount, own=f"{curve_secret}-frontend-{i}", own_key=fronts[i])} if mount else {}
        files["15-frontend.yaml"].append(
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(f"{APP}-frontend-{i}", **one),
             "spec": {"replicas": 1, "selector": {"matchLabels": one},
                      "template": {"metadata": template_meta(one, curve, scrape_annotations(ports.http)),
                                   "spec": frontend_pod(api_key_secret=api_key_secret, secret_env={
                                       var: entry for var, (entry, _) in secrets_env.items()}, **{**pod_args, **own})}}})
    files["15-frontend.yaml"] += [
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(f"{APP}-frontend", **front),
         "spec": {"selector": front, "ports": [{"name": "http", "port": ports.http, "targetPort": "http",
                                                "protocol": "TCP"}]}},
    ]
    if topology.conductor > 1 and not cfg.coordination.etcd_endpoints:
        etcd = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "etcd"}
        files["05-etcd.yaml"] = [
            {"apiVersion": "v1", "kind": "Service", "metadata": meta(f"{APP}-etcd", **etcd),
             "spec": {"selector": etcd, "ports": [{"name": "client", "port": 2379, "targetPort": "client"}]}},
            {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(f"{APP}-etcd", **etcd),
             "spec": {"serviceName": f"{APP}-etcd", "replicas": 1, "selector": {"matchLabels": etcd},
                      "template": {"metadata": {"labels": etcd}, "spec": etcd_pod(ETCD_IMAGE)},
                      "volumeClaimTemplates": [{"metadata": {"name": "etcd-data"}, "spec": {
                          "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}]}}]
    for role in (r for r in P.ENGINE_ROLES if getattr(topology, r)):
        labels = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": role}
        threads = cfg.engine.threads or 1
        memory = cfg.engine.kv_cache_bytes + 2 * GiB  # KV pool + weights and runtime
        files[f"20-{role}.yaml"] = [
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(f"{APP}-{role}", **labels),
             "spec": {"replicas": getattr(topology, role), "selector": {"matchLabels": labels},
                      "template": {"metadata": template_meta(labels, curve),
                                   "spec": worker_pod(role, gpu=gpu, cpu=threads, memory=quantity(memory),
                                                      p2p_model=p2p_model, **pod_args)}}}]
    if topology.store:
        labels = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "store"}
        pvc_bytes = max(GiB, int(cfg.store.lmdb_bytes * 1.25))
        spec = worker_pod("store", gpu=False, cpu=1, memory=quantity(cfg.store.dram_bytes + GiB),
                          p2p_model=p2p_model, **pod_args)
        spec["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": labels},
                                                "topologyKey": "kubernetes.io/hostname"}}]}}
        files["30-store.yaml"] = [
            {"apiVersion": "v1", "kind": "Service", "metadata": meta(f"{APP}-store", **labels),
             "spec": {"clusterIP": "None", "selector": labels,
                      "ports": [{"name": "store", "port": ports.store_port, "targetPort": "store"},
                                {"name": "p2p", "port": ports.p2p_port, "targetPort": "p2p"}]}},
            {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(f"{APP}-store", **labels),
             "spec": {"serviceName": f"{APP}-store", "replicas": topology.store,
                      "selector": {"matchLabels": labels}, "podManagementPolicy": "Parallel",
                      "template": {"metadata": template_meta(labels, curve), "spec": spec},
                      "volumeClaimTemplates": [store_volume_claim(quantity(pvc_bytes))]}}]
    files[SERVICE_MONITOR_FILE] = [service_monitor(meta(f"{APP}-frontend", **front), front, ns, metrics_key_secret),
                                   service_monitor(meta(f"{APP}-conductor", **selector), selector, ns, "", "health")]
    return files


def write_manifests(cfg: Config, topology: Topology, out: str | Path) -> list[Path]:
    """Render and write the YAML files into ``out``; returns their paths."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DeployError(f"cannot create {out}: {e}") from None
    written = []
    for name, objects in render(cfg, topology).items():
        path = out / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.dump_all(objects, Dumper=_NoAliases, sort_keys=False))
        written.append(path)
    return written
