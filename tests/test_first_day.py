"""A user's first day, run as the user runs it: the CLI in a subprocess, `mooncake serve` with no
role (the whole cluster, supervised), the Python floor, the environment check.
Shapes: the default the user gets, and the counts and threads each shape's cluster is given."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx

from mooncake.testing.ports import free_port
from mooncake import cli
from mooncake.local import machine_cluster as local_cluster
from mooncake.local.supervisor import RestartBudget, describe_exit, split_name

ROOT = Path(__file__).resolve().parent.parent


def mooncake(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncake.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_version_prints_the_installed_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    r = mooncake("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"mooncake {version}"


def test_the_python_floor_is_true_to_the_code():
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    floor = tuple(int(x) for x in re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip()).groups())
    for path in sorted((ROOT / "mooncake").rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source, str(path), feature_version=floor)  # no syntax newer than the floor
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if "tomllib" in imported:  # new in 3.11
            assert floor >= (3, 11), f"{path.name} imports tomllib but requires-python is {spec}"


def test_documented_and_foreign_variables_do_not_stop_a_command(tmp_path):
    r = mooncake("config", "check", env={"MOONCAKE_LOG_FORMAT": "json", "MOONCAKE_PROTOCOL": "tcp",
                                         "MOONCAKE_NODE_HOSTNAME": "x"})
    assert r.returncode == 0, r.stderr
    assert "MOONCAKE_LOG_FORMAT" not in r.stderr
    assert "MOONCAKE_PROTOCOL" in r.stderr and "did you mean MOONCAKE_NODE_HOST?" in r.stderr


def test_serve_takes_the_model_as_a_positional_and_runs_the_whole_cluster_by_default(monkeypatch):
    started = []
    monkeypatch.setattr(local_cluster, "run_local",
                        lambda cfg, *counts: started.append((cfg.model.path, counts[:3] + counts[-1:])) or 0)
    assert cli.main(["serve", "/models/qwen", "--prefill", "2"]) == 0  # (prefill, decode, store, colocated)
    assert cli.main(["serve", "--dev", "--model", "/models/qwen"]) == 0  # --dev: a synonym; colocated by default
    assert cli.main(["serve", "--disaggregated"]) == 0
    assert cli.main(["serve", "--colocated", "2", "--prefill", "1", "--decode", "1"]) == 0  # a mixed cluster
    assert started == [("/models/qwen", (2, 1, 1, 0)), ("/models/qwen", (0, 0, 1, 1)), ("", (1, 1, 1, 0)),
                       ("", (1, 1, 1, 2))]
    assert cli.main(["serve", "--prefill", "1", "--decode", "0"]) == 2
    assert cli.main(["serve", "/models/a", "--model", "/models/b"]) == 2
    assert cli.main(["serve", "--dev", "--role", "decode"]) == 2


def test_engines_whose_threads_outnumber_the_cores_sleep_between_parallel_regions(monkeypatch):
    """Engine processes whose threads together outnumber the machine's cores must not spin on the
    cores another computes on (GOMP_SPINCOUNT in their environment); engines with a core per
    thread keep spinning, and an operator's own setting wins."""
    from mooncake.config import Config

    for var in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(local_cluster.os, "sched_getaffinity", lambda pid: {0, 1})  # 2 cores
    one_thread = Config()
    one_thread.engine.threads = 1
    pair = local_cluster.LocalCluster(Config(), prefill=1, decode=1)  # 2 engines x 2 threads
    alone = local_cluster.LocalCluster(Config(), prefill=0, decode=0, colocated=1)
    two = local_cluster.LocalCluster(Config(), prefill=0, decode=0, colocated=2)
    apart = local_cluster.LocalCluster(one_thread, prefill=1, decode=1)  # a core each
    try:
        for role in ("prefill", "decode"):
            assert pair.engine_env(role) == {"GOMP_SPINCOUNT": local_cluster.SHARED_CORES_SPIN}
        assert pair.engine_env("conductor") == pair.engine_env("store") == {}
        assert two.engine_env("colocated") == {"GOMP_SPINCOUNT": local_cluster.SHARED_CORES_SPIN}
        assert alone.engine_env("colocated") == apart.engine_env("decode") == {}
        monkeypatch.setenv("OMP_WAIT_POLICY", "active")
        assert pair.engine_env("decode") == {}
    finally:
        for cluster in (pair, alone, two, apart):
            cluster.tmp.rmdir()


def test_stopping_the_cluster_stops_the_stores_after_everything_that_writes_to_them(tmp_path):
    """A decode's last write-back must find its store still serving: the stores get SIGTERM only
    once the other roles have exited (processes that log when each got it, and take 0.3 s to go)."""
    from mooncake.config import Config

    script = ("import signal, sys, time\n"
              "def bye(*_):\n"
              "    open(sys.argv[1], 'a').write(f'{sys.argv[2]} {time.monotonic()}\\n'); time.sleep(0.3); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, bye)\n"
              "while True: time.sleep(0.05)\n")
    log = tmp_path / "terminated"
    cluster = local_cluster.LocalCluster(Config(), prefill=1, decode=1)
    for name in ("conductor", "store0", "decode0", "frontend0"):
        cluster.children[name] = subprocess.Popen([sys.executable, "-c", script, str(log), name],
                                                  start_new_session=True)
    time.sleep(1.0)  # each has its handler
    cluster.stop(grace_s=20)
    got = {name: float(at) for name, at in (line.split() for line in log.read_text().splitlines())}
    assert set(got) == {"conductor", "store0", "decode0", "frontend0"}
    assert got["store0"] >= max(got["decode0"], got["frontend0"], got["conductor"]) + 0.25


def test_restart_budget_allows_two_restarts_a_minute():
    now = [0.0]
    budget = RestartBudget(max_restarts=3, window_s=60, clock=lambda: now[0])
    assert budget.died() and budget.died()
    now[0] = 61  # the first two fall out of the window
    assert budget.died() and budget.died()
    now[0] = 62
    assert not budget.died()
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(2) == "exit status 2"
    assert split_name("prefill12") == ("prefill", 12) and split_name("conductor") == ("conductor", 0)


def test_role_output_names_its_role_in_text_and_json(monkeypatch, capsys):
    script = "print('plain line'); print('t INFO [decode:n0-decode] x: tagged'); print('{\"a\": 1}')"
    for fmt in ("text", "json"):
        monkeypatch.setenv("MOONCAKE_LOG_FORMAT", fmt)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        local_cluster._forward(proc, "decode:n0-decode")
        proc.wait()
        lines = capsys.readouterr().err.splitlines()
        if fmt == "text":
            assert lines == ["[decode:n0-decode] plain line", "t INFO [decode:n0-decode] x: tagged",
                             "[decode:n0-decode] {\"a\": 1}"]
        else:
            first = json.loads(lines[0])
            assert (first["role"], first["instance"], first["message"]) == ("decode", "n0-decode", "plain line")
            assert lines[2] == '{"a": 1}'


def _children(pid: int) -> dict[str, int]:
    """The supervisor's role processes by name (``decode0``), from their command lines."""
    out = {}
    for child in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split():
        cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        config = next((Path(c.decode()).stem for c in cmd if c.endswith(b".toml")), None)
        if config:
            out[config] = int(child)
    return out


def _wait(what, timeout: float, step: float = 0.5, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(step)
    tail = "\n".join(log.read_text().splitlines()[-30:]) if log else ""
    raise AssertionError(f"not within {timeout:.0f}s\n{tail}")


def test_serve_restarts_a_role_killed_9_and_gives_up_on_one_that_keeps_dying(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        serve = subprocess.Popen([sys.executable, "-m", "mooncake.cli", "serve", "--port", str(port),
                                  "--data-dir", str(tmp_path / "data")],
                                 stdout=subprocess.PIPE, stderr=err, text=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1",
                                      "MOONCAKE_ENGINE_PROFILE_AT_START": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        ready = serve.stdout.readline()
        assert "ready" in ready and f"{url}/v1" in ready and "Ctrl-C" in ready, ready
        nodes = httpx.get(f"{url}/health", timeout=5).json()["nodes"]
        assert all(nodes.get(role, 0) >= 1 for role in ("colocated", "store"))  # ready means registered
        model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": "The moon is", "max_tokens": 4, "temperature": 0}

        engine = _children(serve.pid)["colocated0"]  # the default: one colocated instance
        os.kill(engine, signal.SIGKILL)
        _wait(lambda: f"colocated0 (pid {engine}) died (killed by SIGKILL); restarting it" in log.read_text(), 30)
        reborn = _wait(lambda: _children(serve.pid).get("colocated0") not in (None, engine) and
                       _children(serve.pid)["colocated0"], 30)

        def served() -> bool:
            try:
                return httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
            except httpx.HTTPError:
                return False
        _wait(served, 90, step=2, log=log)  # back within 90 s

        for _ in range(2):  # the second and third deaths within a minute: the supervisor gives up
            os.kill(reborn, signal.SIGKILL)
            if serve.poll() is None:
                reborn = _wait(lambda: serve.poll() is not None or
                               _children(serve.pid).get("colocated0") not in (None, reborn) and
                               _children(serve.pid).get("colocated0"), 30)
        assert serve.wait(timeout=120) == 1
        text = log.read_text()
        assert "colocated0 keeps dying (3 times in 60 s, last: killed by SIGKILL)" in text
        lines = [ln for ln in text.splitlines() if ln.strip()]
        untagged = [ln for ln in lines if not re.search(r"\[(supervisor|conductor|colocated|store):", ln)
                    and not ln.startswith("mooncake: ")]
        assert not untagged, untagged[:5]
        assert "[(" not in text  # no raw tuples
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                serve.kill()


def test_the_start_up_profile_is_logged_in_words():
    from mooncake.protocol.engine_profile import EngineProfile
    from mooncake.roles.engine_host import describe_profile

    p = EngineProfile(prefill=[(128, 0, 0.5094), (128, 1024, 3.2)], decode=[(8, 1024, 0.285)], seconds=5.5)
    assert describe_profile(p) == ("prefill 128 tokens 509 ms, 128 tokens after 1024 cached 3200 ms; "
                                   "decode batch 8 holding 1024 tokens 285 ms/step")


def test_make_serve_shows_its_progress_and_serves_the_whole_cluster():
    plan = subprocess.run(["make", "--no-print-directory", "-n", "-B", "serve", "VENV=/nonexistent-venv"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.splitlines()
    installs = [ln for ln in plan if " install " in ln and "-U pip" not in ln]
    assert installs and not [ln for ln in installs if " -q " in ln]  # pip's progress stays on screen
    assert any(ln.startswith("echo") and "installing" in ln for ln in plan)  # and says what it is doing
    assert plan[-1].endswith("/bin/mooncake serve")  # the whole cluster, not one role
