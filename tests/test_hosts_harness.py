"""The network-namespace harness itself: addresses, rate caps, link control, and that it
leaves no namespace, link or process behind, even when the test fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mooncake.testing.hosts import Hosts, leftovers, unavailable_reason
from mooncake.testing.wait import wait_for

UNAVAILABLE = unavailable_reason()
pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)]


def _connect(hosts: Hosts, src: int, dst: int, port: int) -> int:
    """Exit status of a TCP connect from host ``src`` to host ``dst`` (0: connected)."""
    code = ("import socket, sys\ns = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5)\n")
    return subprocess.run(["ip", "netns", "exec", hosts[src].ns, sys.executable, "-c", code,
                           hosts[dst].address, str(port)], capture_output=True, timeout=30).returncode


def test_hosts_reach_each_other_until_a_link_goes_down(tmp_path):
    with Hosts(2, tmp_path, rate="100mbit") as hosts:
        assert hosts[1].address != hosts[2].address and hosts[1].address.startswith("10.213.")
        qdisc = subprocess.run(["ip", "netns", "exec", hosts[2].ns, "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        listener = subprocess.Popen(["ip", "netns", "exec", hosts[2].ns, sys.executable, "-c",
                                     "import socket, time\ns = socket.create_server((\"0.0.0.0\", 7777))\n"
                                     "while True: s.accept()[0].close()"], start_new_session=True)
        hosts[2].procs["listener"] = listener
        wait_for(lambda: _connect(hosts, 1, 2, 7777) == 0, 20, "the listener")
        hosts.link(2, up=False)
        assert _connect(hosts, 1, 2, 7777) != 0
        hosts.link(2, up=True)
        wait_for(lambda: _connect(hosts, 1, 2, 7777) == 0, 20, "the link back up")
    assert leftovers() == []
    assert listener.poll() is not None


def test_a_failing_test_leaves_no_namespace_or_process(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with Hosts(2, tmp_path) as hosts:
            # a store waiting for a conductor that never answers: alive until torn down
            proc = hosts.spawn(1, "store", env={"MOONCAKE_CONDUCTOR_ENDPOINT": f"tcp://{hosts[2].address}:5550",
                                                "MOONCAKE_NODE_HOST": hosts[1].address,
                                                "MOONCAKE_STORE_DATA_DIR": str(tmp_path / "data")})
            raise RuntimeError("boom")
    assert proc.poll() is not None
    assert leftovers() == []
