"""The shape matrix (issue 50): every test module that starts a cluster runs its promise in each
shape ``mooncake serve`` gives a user (``SHAPES``), or says in a ``Shapes:`` line of its docstring
why one does not apply. A new feature then cannot hold in one shape only without saying so."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mooncake import cli
from mooncake.local import machine_cluster as local_cluster
from mooncake.testing.cluster import SHAPES

TESTS = Path(__file__).parent
STARTS_A_CLUSTER = re.compile(r"\b(running_cluster|start_cluster|LocalCluster)\(")


def test_the_shapes_are_what_serve_starts(monkeypatch):
    started = []
    monkeypatch.setattr(local_cluster, "run_local", lambda cfg, *counts: started.append(counts) or 0)
    assert cli.main(["serve"]) == 0 and cli.main(["serve", "--disaggregated"]) == 0
    for (prefill, decode, _store, *_, colocated), shape in zip(started, ("colocated", "pair")):
        want = {"prefill": 0, "decode": 0, "colocated": 0, **SHAPES[shape]}
        assert (prefill, decode, colocated) == (want["prefill"], want["decode"], want["colocated"]), shape


def test_every_module_that_starts_a_cluster_runs_each_shape_or_says_why_not():
    silent = []
    for path in sorted(TESTS.glob("test_*.py")):
        source = path.read_text()
        if not STARTS_A_CLUSTER.search(source) or "SHAPES[" in source:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        if not any(line.startswith("Shapes: ") for line in doc.splitlines()):
            silent.append(path.name)
    assert not silent, f"start a cluster per shape (SHAPES) or say why not in a 'Shapes:' line: {silent}"
