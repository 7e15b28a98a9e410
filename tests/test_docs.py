"""The documentation a newcomer reads: a README under 200 lines that points into ``docs/``, pages
that MkDocs builds strictly (a broken link fails), a configuration page generated from the config
models and in sync with them, and no config key named where it does not exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from mooncake.config import Config
from mooncake.config_docs import configuration_markdown

ROOT = Path(__file__).resolve().parents[1]
KEY = re.compile(r"`\[([a-z0-9_.]+)\] ([a-z0-9_]+)")  # `[section] key` as the docs write a key


def test_the_readme_is_a_short_map_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    for page in ("usage", "architecture", "operations", "configuration", "simulation"):
        assert f"(docs/{page}.md)" in readme and (ROOT / "docs" / f"{page}.md").exists()


def test_the_docs_build_strictly(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").exists()


def test_the_configuration_page_is_generated_from_the_config_models():
    assert (ROOT / "docs" / "configuration.md").read_text() == configuration_markdown(), \
        "regenerate it: python -m mooncake.config_docs > docs/configuration.md"


def test_every_config_key_the_docs_name_exists_in_the_section_they_name():
    cfg, wrong = Config(), []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        if page.name in ("configuration.md", "benchmarks.md"):  # generated; the figures' record
            continue
        for section, key in KEY.findall(page.read_text()):
            node: object = cfg
            for part in section.split("."):
                node = getattr(node, part, None)
            if node is None or not hasattr(node, key):
                wrong.append(f"{page.name}: [{section}] {key}")
    assert not wrong, wrong


def test_benchmarks_is_a_reference_with_a_date_and_a_commit_per_figure():
    """BENCHMARKS.md stays under 1,000 lines; each row of its figures table has one date and one commit."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 1000
    table = text.split("## Today's figures", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| figure")]
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 10, row
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", cells[6]), row
        assert re.fullmatch(r"[0-9a-f]{7,40}", cells[7]), row
