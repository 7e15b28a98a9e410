"""Building the project's own C code: compiled by the install step (``setup.py build_native``)
and loaded from there with no compiler around, else built once into the cache and found there
again, None where it cannot be had -- with one warning naming why -- and nothing half-written
left behind."""

from __future__ import annotations

import logging
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake import native_build
from mooncake.native_build import Library

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "int mooncake_answer(void) { return 42; }\n"


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "answer.c"
    path.write_text(SOURCE)
    return path


@pytest.fixture
def answer(source) -> Library:
    return Library("answer", (source,), ("-O2",), "the answer is computed in Python")


@pytest.fixture(autouse=True)
def nothing_installed(tmp_path, monkeypatch):
    """No library installed with the package, unless a test installs one."""
    monkeypatch.setattr(native_build, "INSTALLED_DIR", tmp_path / "installed")


def no_compiler(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("CC", "/nonexistent")


needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")


@needs_cc
def test_built_once_then_found_without_a_compiler(answer, source, tmp_path, monkeypatch):
    out = tmp_path / "cache"
    lib = native_build.load(answer, out)
    assert lib is not None and lib.mooncake_answer() == 42
    built = list(out.iterdir())
    assert len(built) == 1 and built[0].name.startswith("answer-")
    no_compiler(monkeypatch)  # the cached library still serves
    assert native_build.build(answer, out) == built[0]
    source.write_text(SOURCE.replace("42", "43"))  # a changed source needs a build, which cannot happen
    with pytest.raises(native_build.Unavailable, match="no C compiler"):
        native_build.build(answer, out)


@needs_cc
def test_a_source_that_does_not_compile_gives_none_and_leaves_nothing(answer, source, tmp_path, caplog):
    source.write_text("this is not C\n")
    out = tmp_path / "cache"
    assert native_build.load(answer, out) is None
    assert list(out.iterdir()) == []
    assert "native library answer off: the build failed" in caplog.text
    assert "error" in caplog.text and "the answer is computed in Python" in caplog.text


@needs_cc
def test_the_install_step_builds_every_library_and_they_load_without_a_compiler(tmp_path, monkeypatch):
    """What ``pip install`` runs: ``setup.py``'s ``build_native`` into a build directory."""
    subprocess.run([sys.executable, "setup.py", "-q", "build_native", "--build-lib", str(tmp_path / "lib")],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    installed = tmp_path / "lib" / "mooncake" / "_native"
    names = {p.name for p in installed.iterdir()}
    expected = [native_build.FINGERPRINT_TABLE] + ([native_build.KERNELS] if platform.machine() == "x86_64" else [])
    assert {library.file_name() for library in expected} <= names
    monkeypatch.setattr(native_build, "INSTALLED_DIR", installed)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    no_compiler(monkeypatch)
    lib = native_build.load(native_build.FINGERPRINT_TABLE)
    assert lib is not None and hasattr(lib, "mooncake_fp_walk")
    assert not (tmp_path / "empty-cache").exists()


@needs_cc
def test_the_loader_prefers_the_installed_library(answer, source, tmp_path, monkeypatch, caplog):
    installed = tmp_path / "installed"
    stale = installed / "answer-0000000000000000.so"  # from an older source: replaced
    installed.mkdir()
    stale.write_bytes(b"")
    assert native_build.build_all(installed, (answer,)) == [installed / answer.file_name()]
    assert list(installed.iterdir()) == [installed / answer.file_name()]
    no_compiler(monkeypatch)
    caplog.set_level(logging.INFO, logger=native_build.__name__)
    lib = native_build.load(answer, tmp_path / "cache")
    assert lib is not None and lib.mooncake_answer() == 42
    assert not (tmp_path / "cache").exists()
    assert "native library answer on" in caplog.text and "off" not in caplog.text


def test_the_install_step_goes_on_without_a_compiler(answer, tmp_path, monkeypatch, caplog):
    no_compiler(monkeypatch)
    assert native_build.build_all(tmp_path / "installed", (answer,)) == []
    assert "answer not built at install time: no C compiler" in caplog.text


@pytest.mark.parametrize("setting, reason", [
    ("no_compiler", "no C compiler (neither CC=/nonexistent nor gcc is on PATH)"),
    ("cpu", "this CPU lacks no_such_feature"),
    ("os", "not Linux (darwin)"),
])
def test_an_unavailable_library_is_named_with_its_reason_once(answer, tmp_path, monkeypatch, caplog, setting, reason):
    if setting == "no_compiler":
        no_compiler(monkeypatch)
    elif setting == "cpu":
        answer = Library(answer.name, answer.sources, answer.flags, answer.fallback, ("no_such_feature",))
    else:
        monkeypatch.setattr(sys, "platform", "darwin")
    assert native_build.load(answer, tmp_path / "cache") is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].getMessage() == f"native library answer off: {reason}; the answer is computed in Python"


def test_the_decode_kernels_say_why_they_are_off(tmp_path, monkeypatch, caplog):
    from mooncake.engine.kernels import native

    no_compiler(monkeypatch)
    assert native.library.__wrapped__(tmp_path / "cache") is None  # not the process's cached answer
    assert "native library mooncake-kernels off: " in caplog.text
    assert ("no C compiler" in caplog.text or "this CPU lacks" in caplog.text or "not Linux" in caplog.text)
    assert "decode runs torch's ops instead" in caplog.text
