"""Prefill yields the CPU to decode: ``[node] prefill_nice`` on the real processes of a dev
cluster, the rules of ``raise_nice`` in processes of their own, and bad values refused.
Shapes: the pair only: prefill_nice is a prefill instance's setting, a colocated instance runs both
halves in one process."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake.config import Config, ConfigError, load_config
from mooncake.roles.cpu_priority import autogroup_nice
from mooncake.testing.cluster import start_cluster

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)
HAS_AUTOGROUP = Path("/proc/self/autogroup").exists()  # the kernel's; this process may still have none


def thread_nices(pid: int) -> dict[int, int]:
    """Nice value of every thread of ``pid``, from /proc/PID/task/TID/stat (field 19)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; field 3 is fields[0]
        out[int(task.name)] = int(fields[16])
    return out


def test_dev_cluster_prefill_threads_and_autogroup_yield_decode_keeps_priority(tmp_path):
    from mooncake.testing.cluster import small_config

    base = os.getpriority(os.PRIO_PROCESS, 0)  # the roles inherit this process's nice value
    cfg = small_config(tmp_path)
    cfg.node.prefill_nice = 7
    cluster = start_cluster(cfg=cfg, prefill=1, decode=1, store=1)
    try:
        prefill = thread_nices(cluster.children["prefill0"].pid)
        assert len(prefill) > 3  # engine thread, torch, ZeroMQ: threads started after the setting too
        assert set(prefill.values()) == {max(7, base)}
        for name in ("decode0", "store0", "conductor"):
            assert set(thread_nices(cluster.children[name].pid).values()) == {base}, name
        if HAS_AUTOGROUP:  # each role leads its own session, so its own autogroup
            assert autogroup_nice(cluster.children["prefill0"].pid) == 7
            assert autogroup_nice(cluster.children["decode0"].pid) == 0
    finally:
        cluster.stop()


def run_child(body: str, start_nice: int = 0, new_session: bool = True) -> str:
    """Run ``body`` in a fresh Python process (its own session, like a role of --dev)."""
    code = ("import os, threading\nfrom pathlib import Path\n"
            "from mooncake.roles.cpu_priority import apply_role_priority, autogroup_nice\n"
            + inspect.getsource(thread_nices) + body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          start_new_session=new_session, preexec_fn=lambda: os.nice(start_nice),
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60).stdout


def test_every_thread_yields_and_later_threads_inherit():
    out = run_child(
        "e = threading.Event(); t = threading.Thread(target=e.wait); t.start()\n"
        "apply_role_priority('prefill', 12)\n"
        "late = []; u = threading.Thread(target=lambda: late.append(os.getpriority(os.PRIO_PROCESS, 0))); "
        "u.start(); u.join()\n"
        "print(sorted(set(thread_nices(os.getpid()).values())), late); e.set()")
    assert out.split("\n")[0] == "[12] [12]"


@pytest.mark.parametrize("role, nice, start, want", [
    ("decode", 10, 0, 0),  # only prefill roles yield
    ("store", 10, 0, 0),
    ("prefill", 0, 0, 0),  # 0: off
    ("prefill", 10, 15, 15),  # never lowered (started under nice -n 15)
])
def test_who_yields_and_by_how_much(role, nice, start, want):
    out = run_child(f"apply_role_priority({role!r}, {nice})\n"
                    "print(sorted(set(thread_nices(os.getpid()).values())))", start_nice=start)
    assert out.strip() == f"[{want}]"


@pytest.mark.skipif(not HAS_AUTOGROUP, reason="no autogroup scheduling in this kernel")
def test_autogroup_set_only_by_a_session_leader():
    body = "apply_role_priority('prefill', 9)\nprint(autogroup_nice(os.getpid()))"
    assert run_child(body).strip() == "9"
    # In the caller's session the autogroup is shared (with decode, maybe): left alone. The
    # caller may have none (still in the boot session's group, as under a container's PID 1).
    assert run_child(body, new_session=False).strip() == str(autogroup_nice())


def test_autogroup_file_read_as_the_kernel_writes_it(tmp_path):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "autogroup").write_text("/autogroup-4866 nice -3\n")
    assert autogroup_nice(7, proc=tmp_path) == -3
    (tmp_path / "7" / "autogroup").write_text("")  # in the boot session's default group
    assert autogroup_nice(7, proc=tmp_path) is None
    assert autogroup_nice(8, proc=tmp_path) is None  # no file: no autogroup scheduling


@pytest.mark.parametrize("value", ["20", "-5", "high"])
def test_bad_prefill_nice_is_a_config_error_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"node\.prefill_nice .*MOONCAKE_NODE_PREFILL_NICE"):
        load_config(env={"MOONCAKE_NODE_PREFILL_NICE": value})


def test_bad_prefill_nice_stops_the_role_before_it_starts(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[node]\nprefill_nice = 25\n")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-m", "mooncake.cli", "serve", "--role", "prefill", "--config", str(f)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == 2
    assert "node.prefill_nice" in r.stderr and "less than or equal to 19" in r.stderr


def test_default_yields():
    assert Config().node.prefill_nice == 10
