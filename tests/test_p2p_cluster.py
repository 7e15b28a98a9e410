"""P2P objects across real processes on loopback: a conductor and four stores, driven by the
``mooncake p2p`` command. One store (``bad``) corrupts every chunk it serves."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2p_nodes import P2PNodes
from mooncake.config import load_config
from mooncake.p2p.client import P2PClient, fetch_model
from mooncake.p2p.rpc import P2PError
from mooncake.p2p.service import CORRUPT_ENV

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parent.parent


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(root: Path, seed: int, mib: int = 6) -> Path:
    (root / "tokenizer").mkdir(parents=True)
    (root / "model.safetensors").write_bytes(os.urandom(mib << 20) + bytes([seed]))
    (root / "tokenizer" / "vocab.json").write_text(f'{{"seed": {seed}}}')
    return root


def same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and \
        all(sha(a / f) == sha(b / f) for f in files)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    work = tmp_path_factory.mktemp("p2p")
    n = P2PNodes(work, ["n1", "n2", "n3", "bad"], store_env={"bad": {CORRUPT_ENV: "1"}}, stall_timeout_s=4.0)
    with n:
        yield n


def ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_objects_spread_to_every_fetcher_with_their_tree(nodes, tmp_path):
    src = tree(tmp_path / "src", 1)
    assert "published model version" in ok(nodes.cli("n1", "put", "model", str(src)))
    gets = [nodes.popen_cli(name, "get", "model", str(tmp_path / name)) for name in ("n2", "n3")]
    for p in gets:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "fetched model" in out
    assert same_tree(src, tmp_path / "n2") and same_tree(src, tmp_path / "n3")
    listing = ok(nodes.cli("n1", "ls"))
    assert "model" in listing and "n1 complete, n2 complete, n3 complete" in listing
    # the same content published again from another node: one more holder, no conflict
    ok(nodes.cli("n3", "put", "model", str(tmp_path / "n3")))


def test_unknown_names_and_conflicting_publishes_are_errors(nodes, tmp_path):
    r = nodes.cli("n2", "get", "no-such", str(tmp_path / "x"))
    assert r.returncode == 1 and "no object named 'no-such'" in r.stderr
    assert not (tmp_path / "x").exists()
    ok(nodes.cli("n1", "put", "conf", str(tree(tmp_path / "a", 2, mib=1))))
    r = nodes.cli("n2", "put", "conf", str(tree(tmp_path / "b", 3, mib=1)))
    assert r.returncode == 1 and "already published with different content" in r.stderr
    r = nodes.cli("n2", "put", "bad/name", str(tmp_path / "b"))
    assert r.returncode == 1 and "invalid object name" in r.stderr
    r = nodes.cli("n2", "rm", "no-such")
    assert r.returncode == 1 and "no object named" in r.stderr


def test_corrupt_chunks_are_refused_and_fetched_from_another_holder(nodes, tmp_path):
    src = tree(tmp_path / "src", 4, mib=3)
    ok(nodes.cli("bad", "put", "corrupt", str(src)))
    r = nodes.cli("n2", "get", "corrupt", str(tmp_path / "dst"))  # the only holder serves garbage
    assert r.returncode == 1 and "failed verification from every holder" in r.stderr, r.stderr
    ok(nodes.cli("n1", "put", "corrupt", str(src)))  # a good holder appears
    out = ok(nodes.cli("n2", "get", "corrupt", str(tmp_path / "dst")))
    assert "from: n1" in out and "bad" not in out.split("from:")[1]
    assert same_tree(src, tmp_path / "dst")


def test_a_holder_whose_file_changed_stops_serving_it(nodes, tmp_path):
    src = tree(tmp_path / "src", 10, mib=3)
    ok(nodes.cli("n1", "put", "changed", str(src)))
    ok(nodes.cli("n2", "get", "changed", str(tmp_path / "copy")))
    with open(src / "model.safetensors", "r+b") as f:  # n1's file changes under it, same size
        f.seek(100)
        f.write(b"\xff" * 8)
    r = nodes.cli("n3", "get", "changed", str(tmp_path / "dst"), "--from", "n1")  # n1 alone: refused, no silent copy
    assert r.returncode == 1 and "no progress" in r.stderr, r.stderr
    line = next(x for x in ok(nodes.cli("n3", "ls")).splitlines() if x.startswith("changed "))
    assert "n2 complete" in line and "n1 complete" not in line, line  # n1 told the conductor what it lost
    out = ok(nodes.cli("n3", "get", "changed", str(tmp_path / "dst")))  # resumed from the good holder
    assert "n2" in out.split("from:")[1]
    assert same_tree(tmp_path / "copy", tmp_path / "dst")


def test_an_object_removed_during_a_fetch_fails_it_clearly(nodes, tmp_path):
    async def remove(node: str, name: str) -> None:
        client = P2PClient(load_config(nodes.config(node), env={}))
        try:
            await client.rm(name)
        finally:
            client.close()

    ok(nodes.cli("bad", "put", "doomed", str(tree(tmp_path / "src", 11, mib=2))))
    get = nodes.popen_cli("n2", "get", "--quiet", "doomed", str(tmp_path / "dst"))  # bad's chunks never verify
    deadline = time.monotonic() + 60
    while not (tmp_path / "dst" / "model.safetensors").exists():  # the fetch has started
        assert get.poll() is None and time.monotonic() < deadline, get.communicate()
        time.sleep(0.05)
    asyncio.run(remove("n1", "doomed"))  # in-process: at once, well before the fetch's stall timeout
    _, err = get.communicate(timeout=60)
    assert get.returncode == 1 and "doomed was removed" in err, err
    ok(nodes.cli("n1", "put", "doomed", str(tree(tmp_path / "new", 12, mib=1))))  # the name is free again
    ok(nodes.cli("n2", "get", "doomed", str(tmp_path / "dst2")))
    assert same_tree(tmp_path / "new", tmp_path / "dst2")


def test_a_fetch_resumes_from_what_is_on_disk(nodes, tmp_path):
    src = tree(tmp_path / "src", 5, mib=8)
    ok(nodes.cli("n1", "put", "resume", str(src)))
    dst = tmp_path / "dst"
    (dst / "tokenizer").mkdir(parents=True)
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[: 5 << 20])  # interrupted
    out = ok(nodes.cli("n3", "get", "resume", str(dst)))
    fetched = out.split("from: n1 ")[1].split()[0]
    assert float(fetched) < 4.5, out  # ~3 MB and the vocab, not the 8 MB again
    assert same_tree(src, dst)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_is_a_clear_error(nodes, tmp_path):
    ok(nodes.cli("n1", "put", "big", str(tree(tmp_path / "src", 6, mib=4))))
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        r = nodes.cli("n2", "get", "big", str(small / "dst"))
        assert r.returncode == 1 and "more bytes at" in r.stderr and "free" in r.stderr, r.stderr
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_rm_forgets_an_object_everywhere(nodes, tmp_path):
    src = tree(tmp_path / "src", 7, mib=1)
    ok(nodes.cli("n1", "put", "gone", str(src)))
    ok(nodes.cli("n2", "get", "gone", str(tmp_path / "dst")))
    assert "removed gone (2 holders told)" in ok(nodes.cli("n3", "rm", "gone"))
    assert "gone " not in ok(nodes.cli("n1", "ls"))
    r = nodes.cli("n3", "get", "gone", str(tmp_path / "again"))
    assert r.returncode == 1 and "no object named 'gone'" in r.stderr
    assert same_tree(src, tmp_path / "dst")  # the files stay; only the sharing ends
    ok(nodes.cli("n2", "put", "gone", str(tree(tmp_path / "new", 8, mib=1))))  # the name is free again


def test_a_worker_fetches_its_missing_model_directory(nodes, tmp_path):
    src = tree(tmp_path / "src", 9, mib=2)
    ok(nodes.cli("n1", "put", "smol", str(src)))
    cfg = load_config(nodes.config("n2"), env={})
    cfg.model.path, cfg.model.p2p_name = str(tmp_path / "models" / "smol"), "smol"
    fetch_model(cfg, "store")
    assert same_tree(src, tmp_path / "models" / "smol")
    (tmp_path / "models" / "smol" / "model.safetensors").write_bytes(b"local")  # present: left alone
    fetch_model(cfg, "store")
    assert (tmp_path / "models" / "smol" / "model.safetensors").read_bytes() == b"local"


def test_the_command_never_imports_torch(nodes):
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "mooncake.cli", "p2p", "ls", "--config",
                        str(nodes.config("n1"))], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")})
    assert r.returncode == 0, r.stderr
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "mooncake.p2p.client" in imported and not {"torch", "transformers", "numpy"} & imported


def test_a_store_publishes_and_fetches_only_under_its_p2p_root(nodes, tmp_path):
    """``[node] p2p_root`` (here the tests' temporary tree): /etc, a fetch into a directory
    outside it, and a link in a published tree that leads out of it are refused, naming
    p2p_root, and nothing is published or written."""
    r = nodes.cli("n1", "put", "loot", "/etc")
    assert r.returncode == 1 and "outside this store's p2p_root" in r.stderr, r.stderr
    leaky = tree(tmp_path / "leaky", 10, mib=1)
    (leaky / "passwd").symlink_to("/etc/passwd")
    r = nodes.cli("n1", "put", "leaky", str(leaky))
    assert r.returncode == 1 and "outside this store's p2p_root" in r.stderr and "/etc/passwd" in r.stderr
    assert "loot" not in ok(nodes.cli("n1", "ls")) and "leaky" not in ok(nodes.cli("n1", "ls"))
    ok(nodes.cli("n1", "put", "fine", str(tree(tmp_path / "fine", 11, mib=1))))
    outside = Path("/var/tmp") / f"mooncake-outside-{os.getpid()}-{time.monotonic_ns()}"
    r = nodes.cli("n2", "get", "fine", str(outside))
    assert r.returncode == 1 and "outside this store's p2p_root" in r.stderr and not outside.exists()
    ok(nodes.cli("n2", "get", "fine", str(tmp_path / "inside")))  # under it: fetched
    assert same_tree(tmp_path / "fine", tmp_path / "inside")


def test_only_the_node_itself_may_make_its_store_publish_or_fetch(nodes, tmp_path):
    """The P2P port is open to every peer: an object request without the node key (which only
    processes that can read the store's data_dir have) is refused and does nothing."""
    src = tree(tmp_path / "src", 12, mib=1)

    async def as_stranger(key: str) -> str:
        client = P2PClient(load_config(nodes.config("n1"), env={}))
        try:
            await client.store()
            client.key = key
            with pytest.raises(P2PError) as e:
                await client.put("stranger", src)
            with pytest.raises(P2PError):
                await client.get("anything", tmp_path / "stranger-dst")
            return e.value.code
        finally:
            client.close()

    assert asyncio.run(as_stranger("")) == "forbidden"
    assert asyncio.run(as_stranger("0" * 64)) == "forbidden"
    assert "stranger" not in ok(nodes.cli("n1", "ls")) and not (tmp_path / "stranger-dst").exists()
    other = load_config(nodes.config("n2"), env={})
    other.store.data_dir = str(tmp_path / "elsewhere")  # another machine's view: no key there

    async def without_the_key() -> None:
        client = P2PClient(other)
        try:
            with pytest.raises(P2PError, match="cannot read this node's P2P key"):
                await client.put("stranger", src)
        finally:
            client.close()

    asyncio.run(without_the_key())


def test_the_node_key_goes_only_to_a_store_of_this_node_and_is_never_published(nodes, tmp_path):
    """A process registered under this node's name that is not one of its stores (none wrote its
    endpoint beside the key) never gets the key; a tree holding the key or the store's data is
    not published."""
    from mooncake.protocol.p2p import StoreAt

    async def ask_an_impostor() -> None:
        client = P2PClient(load_config(nodes.config("n1"), env={}))

        async def impostor(msg, timeout_s=None):
            return StoreAt("n1-store-impostor", "tcp://127.0.0.1:1")

        client.conductor.call = impostor
        try:
            with pytest.raises(P2PError, match="is not one this node's stores wrote") as e:
                await client.store()
            assert e.value.code == "no_store" and client._store is None
        finally:
            client.close()

    asyncio.run(ask_an_impostor())
    r = nodes.cli("n1", "put", "everything", str(nodes.workdir))  # under p2p_root, but holds n1's data dir
    assert r.returncode == 1 and "holds this store's node key or data" in r.stderr, r.stderr
