"""Pod specs of the mooncake roles for Kubernetes (used by ``deploy/kubernetes.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from mooncake.config import env_name
from mooncake.security import ROLE_KIND

CONFIG_FILE = "/etc/mooncake/cluster.toml"
CURVE_MOUNT = "/etc/mooncake/curve"
DATA_MOUNT = "/var/lib/mooncake"
# [model] p2p_name: a node's store fetches the model into this directory of the node (hostPath),
# which its workers mount at the same path and load from.
MODELS_DIR = "/var/lib/mooncake-models"
USER_ID = 10001  # the non-root user of deploy/Dockerfile
STARTUP_BUDGET_S = 600  # model load (and conversion) before the first probe must pass


@dataclass(frozen=True)
class PodPorts:
    http: int  # frontend HTTP (OpenAI API, /health/*)
    zmq: int  # conductor's role endpoint
    tokens: int  # frontend's token socket (decodes stream to it at the pod IP)
    kv_port: int  # decode KV ingress
    store_port: int  # store object API
    p2p_port: int  # store P2P chunks (peers connect to it at the pod IP)
    health_port: int  # worker/store /health/{live,ready}


@dataclass(frozen=True)
class CurveMount:
    """What a pod mounts of the CURVE keys at ``CURVE_MOUNT``: every public key and the secret of
    its own kind from ``secret``; a frontend instead its own secret key alone, from ``own`` (the
    Secret holding ``own_key``), mounted as ``frontend.key_secret`` (what it loads)."""

    secret: str  # the Secret with every public key and the conductor's, workers' and stores' secrets
    public: tuple[str, ...]  # its public key files
    own: str = ""
    own_key: str = ""


def _field(path: str) -> dict:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def _env(role: str, common_env: dict[str, str], api_key_secret: str = "",
         secret_env: dict[str, str] | None = None) -> list[dict]:
    """``secret_env``: environment variable -> its entry in the Secret ``api_key_secret``."""
    env = [{"name": env_name("node", "host"), **_field("status.podIP")},
           {"name": env_name("node", "name"), **_field("spec.nodeName")},  # same machine = local
           {"name": env_name("node", "node_id"), **_field("metadata.name")}]
    env += [{"name": k, "value": v} for k, v in common_env.items()]
    if api_key_secret:
        env += [{"name": name, "valueFrom": {"secretKeyRef": {"name": api_key_secret, "key": key}}}
                for name, key in (secret_env or {}).items()]
    return env


def _probes(port: str, path_ready: str = "/health/ready") -> dict:
    def get(path: str, period: int, failures: int) -> dict:
        return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
                "timeoutSeconds": 3, "failureThreshold": failures}

    return {"startupProbe": get("/health/live", 5, STARTUP_BUDGET_S // 5),
            "livenessProbe": get("/health/live", 10, 3),
            "readinessProbe": get(path_ready, 5, 2)}


def _curve_volume(curve: CurveMount, role: str) -> dict:
    """The public keys of every kind, and the secret of this role's kind only (a frontend: its own,
    from a Secret of its own; never the conductor's). Group-readable: the pod's fsGroup is the
    container user's group."""
    public = [{"key": f, "path": f} for f in curve.public]
    if ROLE_KIND[role] != "frontend":
        items = public + [{"key": f"{ROLE_KIND[role]}.key_secret", "path": f"{ROLE_KIND[role]}.key_secret"}]
        return {"name": "curve", "secret": {"secretName": curve.secret, "defaultMode": 0o440, "items": items}}
    own = {"key": f"{curve.own_key}.key_secret", "path": "frontend.key_secret"}
    return {"name": "curve", "projected": {"defaultMode": 0o440, "sources": [
        {"secret": {"name": curve.secret, "items": public}}, {"secret": {"name": curve.own, "items": [own]}}]}}


def _pod(container: dict, grace_s: int, curve: CurveMount | None, volumes: list[dict]) -> dict:
    mounts = [{"name": "config", "mountPath": CONFIG_FILE, "subPath": "cluster.toml", "readOnly": True}]
    volumes = [{"name": "config", "configMap": {"name": "mooncake-config"}}, *volumes]
    if curve is not None:
        mounts.append({"name": "curve", "mountPath": CURVE_MOUNT, "readOnly": True})
        volumes.append(_curve_volume(curve, container["name"]))
    container["volumeMounts"] = mounts + container.get("volumeMounts", [])
    container["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return {"terminationGracePeriodSeconds": grace_s,
            "securityContext": {"runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID,
                                "fsGroup": USER_ID},
            "containers": [container], "volumes": volumes}


def _command(role: str) -> list[str]:
    return ["mooncake", "serve", "--role", role, "--config", CONFIG_FILE]


def conductor_pod(*, image: str, ports: PodPorts, grace_s: int, curve: CurveMount | None,
                  common_env: dict[str, str]) -> dict:
    """The conductor binds its role endpoint on every interface (under etcd it announces the pod
    IP; without, roles reach it by its Service); its probes and /metrics are on the health port."""
    env = {**common_env, env_name("conductor", "endpoint"): f"tcp://0.0.0.0:{ports.zmq}"}
    container = {"name": "conductor", "image": image, "command": _command("conductor"),
                 "env": _env("conductor", env),
                 "ports": [{"name": "health", "containerPort": ports.health_port, "protocol": "TCP"},
                           {"name": "zmq", "containerPort": ports.zmq, "protocol": "TCP"}],
                 "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                 **_probes("health", "/health/live")}  # a standby is as healthy as the leader
    return _pod(container, grace_s, curve, [])


def frontend_pod(*, image: str, ports: PodPorts, grace_s: int, curve: CurveMount | None,
                 common_env: dict[str, str], api_key_secret: str, secret_env: dict[str, str]) -> dict:
    """A frontend: the OpenAI API on the http port, its token socket on the pod IP; the config's
    secrets from ``api_key_secret`` (``secret_env``: as ``_env``'s)."""
    container = {"name": "frontend", "image": image, "command": _command("frontend"),
                 "env": _env("frontend", common_env, api_key_secret, secret_env),
                 "ports": [{"name": "http", "containerPort": ports.http, "protocol": "TCP"},
                           {"name": "tokens", "containerPort": ports.tokens, "protocol": "TCP"}],
                 "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                 **_probes("http")}
    return _pod(container, grace_s, curve, [])


def etcd_pod(image: str) -> dict:
    """One etcd member for the conductors' election (its data on the pod's volume claim)."""
    url = "http://0.0.0.0:2379"
    return {"containers": [{
        "name": "etcd", "image": image,
        "command": ["etcd", "--name", "etcd-0", "--data-dir", "/var/lib/etcd", "--listen-client-urls", url,
                    "--advertise-client-urls", "http://$(POD_IP):2379"],
        "env": [{"name": "POD_IP", **_field("status.podIP")}],
        "ports": [{"name": "client", "containerPort": 2379, "protocol": "TCP"}],
        "volumeMounts": [{"name": "etcd-data", "mountPath": "/var/lib/etcd"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "client"}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}]}


def _models_volume() -> dict:
    return {"name": "models", "hostPath": {"path": MODELS_DIR, "type": "DirectoryOrCreate"}}


def _models_owner(image: str) -> dict:
    """Init container of a store pod: the node's model directory, created by the kubelet as root,
    made the store user's (the only root step, with CAP_CHOWN alone)."""
    return {"name": "models-owner", "image": image, "command": ["chown", f"{USER_ID}:{USER_ID}", MODELS_DIR],
            "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR}],
            "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}}}


def _beside_a_store() -> dict:
    """A worker runs only on a node with a store pod: its model comes through that store."""
    store = {"app.kubernetes.io/name": "mooncake", "app.kubernetes.io/component": "store"}
    return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": store}, "topologyKey": "kubernetes.io/hostname"}]}}


def worker_pod(role: str, *, image: str, ports: PodPorts, grace_s: int, curve: CurveMount | None,
               common_env: dict[str, str], gpu: bool, cpu: int, memory: str, p2p_model: bool = False) -> dict:
    """A prefill, decode or store pod; each serves /health/{live,ready} on the health port.
    ``p2p_model`` ([model] p2p_name): the store pod fetches the model into the node's
    ``MODELS_DIR``, which prefill and decode pods mount (read-only) beside a store."""
    container_ports = [{"name": "health", "containerPort": ports.health_port, "protocol": "TCP"}]
    if role == "decode":
        container_ports.append({"name": "kv", "containerPort": ports.kv_port, "protocol": "TCP"})
    if role == "store":
        container_ports.append({"name": "store", "containerPort": ports.store_port, "protocol": "TCP"})
        container_ports.append({"name": "p2p", "containerPort": ports.p2p_port, "protocol": "TCP"})
    resources: dict = {"requests": {"cpu": str(cpu), "memory": memory}}
    if gpu:
        resources["limits"] = {"nvidia.com/gpu": 1}
    container = {"name": role, "image": image, "command": _command(role), "env": _env(role, common_env),
                 "ports": container_ports, "resources": resources, **_probes("health")}
    if role == "store":  # the LMDB tier, on the pod's PersistentVolumeClaim
        container["volumeMounts"] = [{"name": "data", "mountPath": DATA_MOUNT}]
    if not p2p_model:
        return _pod(container, grace_s, curve, [])
    container["volumeMounts"] = container.get("volumeMounts", []) + [
        {"name": "models", "mountPath": MODELS_DIR, "readOnly": role != "store"}]
    pod = _pod(container, grace_s, curve, [_models_volume()])
    if role == "store":
        pod["initContainers"] = [_models_owner(image)]
    else:
        pod["affinity"] = _beside_a_store()
    return pod


def store_volume_claim(size: str) -> dict:
    """The PersistentVolumeClaim template of a store pod's LMDB tier."""
    return {"metadata": {"name": "data"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}}
