"""Helpers of the Kubernetes manifest tests: ``mooncake deploy kubernetes`` run as a user runs
it, the objects it wrote, their validation under the Kubernetes schemas (kubernetes-validate
--strict, offline) and the config a container of them loads."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from mooncake.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
POD = {"status.podIP": "10.9.8.7", "spec.nodeName": "k8s-node-a", "metadata.name": "mooncake-x-0"}


def cli(*args: str) -> subprocess.CompletedProcess:
    """``mooncake ARGS`` in a subprocess, with no MOONCAKE_* variable of this environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    return subprocess.run([sys.executable, "-m", "mooncake.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def objects(out: Path) -> list[dict]:
    """The objects of the manifests ``kubectl apply -f OUT`` applies (the top directory)."""
    return [o for f in sorted(out.glob("*.yaml")) for o in yaml.safe_load_all(f.read_text())]


def validate(out: Path) -> None:
    files = sorted(str(f) for f in out.glob("*.yaml"))
    r = subprocess.run([str(VALIDATE), "--strict", "--quiet", *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def effective(objs: list[dict], container: dict) -> Config:
    """The config a container would load: the ConfigMap's TOML, then its environment."""
    configmap = next(o for o in objs if o["kind"] == "ConfigMap")
    secrets = {o["metadata"]["name"]: o["stringData"] for o in objs if o["kind"] == "Secret"}
    env = {}
    for e in container["env"]:
        src = e.get("valueFrom", {})
        if "fieldRef" in src:
            env[e["name"]] = POD[src["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in src:
            env[e["name"]] = secrets[src["secretKeyRef"]["name"]][src["secretKeyRef"]["key"]]
        else:
            env[e["name"]] = e["value"]
    assert container["command"][-2:] == ["--config", "/etc/mooncake/cluster.toml"]
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(configmap["data"]["cluster.toml"])
        f.flush()
        return load_config(f.name, env=env)


def pod_specs(objs: list[dict]) -> dict[str, dict]:
    """Role (the component label) -> the pod spec of its Deployment or StatefulSet (mooncake's
    roles: not the etcd rendered for the conductors' election)."""
    return {o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["spec"]
            for o in objs if o["kind"] in ("Deployment", "StatefulSet") and o["metadata"]["name"] != "mooncake-etcd"}


def curve_items(spec: dict) -> list[tuple[str, str, str]]:
    """(Secret, its key, the file's path) of each key file a pod mounts in its ``curve`` volume
    (a Secret's items, or a projected volume's: a frontend's own key comes from a Secret of its own)."""
    volume = next((v for v in spec["volumes"] if v["name"] == "curve"), None)
    if volume is None:
        return []
    if "secret" in volume:
        return [(volume["secret"]["secretName"], i["key"], i["path"]) for i in volume["secret"]["items"]]
    return [(s["secret"]["name"], i["key"], i["path"]) for s in volume["projected"]["sources"] for i in s["secret"]["items"]]


def frontend_specs(objs: list[dict]) -> dict[str, dict]:
    """Deployment name -> pod spec of each frontend (a Deployment each: each has a key of its own)."""
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objs if o["kind"] == "Deployment"
            and o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "frontend"}
