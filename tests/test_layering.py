"""The package's layering: which layers may import which (every import counts, those under
``TYPE_CHECKING`` and inside functions too), and no module over the length limit."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mooncake"
MAX_LINES = 350
# layer (a sub-package of mooncake) -> the sub-packages it must not import
FORBIDDEN = {
    "sched": ["conductor", "roles", "api", "engine", "tiers"],
    "sim": ["conductor", "roles", "api"],
    "protocol": ["sched", "p2p", "conductor", "roles", "api"],
}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved)."""
    package = ["mooncake", *path.relative_to(PACKAGE).parent.parts]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)  # ``from mooncake import conductor``
    return out


def test_layers_import_only_what_they_may():
    broken = []
    for path in modules():
        layer = path.relative_to(PACKAGE).parts[0]
        for name in imported(path):
            for other in FORBIDDEN.get(layer, []):
                if name == f"mooncake.{other}" or name.startswith(f"mooncake.{other}."):
                    broken.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert not broken, "\n".join(sorted(broken))


def test_no_module_is_over_the_length_limit():
    long = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, "\n".join(long)
