"""Building the project's own C code: built once into the cache and found there again (also
where no compiler is left), None where it cannot be built, nothing half-written left behind."""

from __future__ import annotations

import shutil

import pytest

from mooncake import native_build

SOURCE = "int mooncake_answer(void) { return 42; }\n"


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "answer.c"
    path.write_text(SOURCE)
    return path


needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")


@needs_cc
def test_built_once_then_found_without_a_compiler(source, tmp_path, monkeypatch):
    out = tmp_path / "cache"
    lib = native_build.load("answer", [source], ["-O2"], out)
    assert lib is not None and lib.mooncake_answer() == 42
    built = list(out.iterdir())
    assert len(built) == 1 and built[0].name.startswith("answer-")
    monkeypatch.setenv("PATH", "")  # no compiler now: the cached library still serves
    monkeypatch.setenv("CC", "no-such-compiler")
    assert native_build.build("answer", [source], ["-O2"], out) == built[0]
    source.write_text(SOURCE.replace("42", "43"))  # a changed source needs a build, which cannot happen
    assert native_build.build("answer", [source], ["-O2"], out) is None


@needs_cc
def test_a_source_that_does_not_compile_gives_none_and_leaves_nothing(source, tmp_path, caplog):
    source.write_text("this is not C\n")
    out = tmp_path / "cache"
    assert native_build.load("broken", [source], ["-O2"], out) is None
    assert list(out.iterdir()) == []
    assert "broken not built" in caplog.text
