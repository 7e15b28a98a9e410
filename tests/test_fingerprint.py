"""The weights fingerprint in the model identity: every byte counts; computed once, then cached."""

from __future__ import annotations

import os

import pytest

from mooncake.engine.loading import fingerprint
from mooncake.engine.loading.fingerprint import weights_fingerprint


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model-00001.safetensors").write_bytes(os.urandom(3 << 20))
    (d / "model-00002.safetensors").write_bytes(os.urandom(1 << 20))
    return d


def test_any_weight_byte_changes_the_fingerprint(model_dir, tmp_path):
    before = weights_fingerprint(model_dir)
    f = model_dir / "model-00001.safetensors"
    st = f.stat()
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 1  # one bit in the middle, far from the first and last MiB
    f.write_bytes(bytes(raw))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    assert weights_fingerprint(model_dir) != before
    assert weights_fingerprint(model_dir, tmp_path / "cache") == weights_fingerprint(model_dir)


def test_digest_is_cached_until_a_file_changes(model_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    digest = weights_fingerprint(model_dir, cache)
    assert len(digest) == 64 and len(list((cache / "fingerprints").iterdir())) == 1

    def no_hashing(_):
        raise AssertionError("hashed again although nothing changed")

    monkeypatch.setattr(fingerprint, "hash_weights", no_hashing)
    assert weights_fingerprint(model_dir, cache) == digest
    monkeypatch.undo()
    (model_dir / "model-00002.safetensors").write_bytes(os.urandom(1 << 20))  # a rewrite: new ctime
    assert weights_fingerprint(model_dir, cache) not in (digest, "")


def test_unwritable_cache_still_fingerprints(model_dir, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert weights_fingerprint(model_dir, blocked) == weights_fingerprint(model_dir)
