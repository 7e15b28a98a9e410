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


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_modules(path: Path, node: ast.stmt, known: set[str]) -> set[str]:
    """The package modules an import statement of ``path`` names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    assert isinstance(node, ast.ImportFrom)
    package = ["mooncake", *path.relative_to(PACKAGE).parent.parts]
    base = package[:len(package) - node.level + 1] if node.level else []
    module = ".".join([*base, node.module] if node.module else base)
    subs = {f"{module}.{a.name}" for a in node.names} & known
    return subs or ({module} & known)


def run_time_imports(path: Path) -> set[str]:
    """The package modules ``path`` imports when it is imported: module-level statements only (not
    inside functions, not under ``if TYPE_CHECKING``)."""
    known = {module_name(p) for p in modules()}
    out = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body + getattr(node, "orelse", []) + [s for h in getattr(node, "handlers", []) for s in h.body])
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update(_package_modules(path, node, known))

    visit(ast.parse(path.read_text(), str(path)).body)
    return out


def test_no_import_cycle_between_modules():
    """A cycle through package ``__init__`` re-exports is not counted: a module importing its own
    package's ``__init__`` (or the reverse) is how packages work."""
    graph = {module_name(p): run_time_imports(p) for p in modules()}
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".") and not d.startswith(name + ".")}
    state: dict[str, int] = {}
    cycles = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                walk(dep, [*stack, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert not cycles, "\n".join(cycles)


def all_imports(path: Path) -> set[str]:
    """The package modules ``path`` imports anywhere: at module level, in functions, under ``TYPE_CHECKING``."""
    known = {module_name(p) for p in modules()}
    return {m for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.Import, ast.ImportFrom)) for m in _package_modules(path, node, known)}


def test_no_two_modules_import_each_other_however_written():
    """A two-way import hidden under ``TYPE_CHECKING`` or inside a function is still two modules that
    need each other: one of them should take a narrow collaborator (a callable, a ``Protocol``)."""
    graph = {module_name(p): all_imports(p) for p in modules()}
    pairs = sorted(f"{a} <-> {b}" for a, deps in graph.items() for b in deps
                   if a < b and a in graph.get(b, ()) and not a.startswith(b + ".") and not b.startswith(a + "."))
    assert not pairs, "\n".join(pairs)


# The objects that orchestrate (a role's worker, the conductor, its scheduler, a frontend, the
# simulation, the local cluster): helpers elsewhere take the narrow parts they use, or a Protocol
# that declares them. Only the module that runs one (and the frontend's HTTP routes) may pass it whole.
ORCHESTRATORS = {"Conductor", "Scheduler", "Frontend", "Simulation", "LocalCluster"}
HOSTS = {"Frontend": ("api/", "roles/frontend.py"), "Conductor": ("roles/conductor.py",)}


def _orchestrator(annotation: str) -> str | None:
    name = annotation.strip("'\"").split("[")[0].split(".")[-1].split(" | ")[0]
    return name if name.endswith("Worker") or name in ORCHESTRATORS else None


def test_no_function_takes_an_orchestrating_object():
    """Module-level functions, and the constructors of classes outside the orchestrator's own module,
    take the narrow collaborators they use, never a role's worker, the conductor, the scheduler, a
    frontend or the simulation (``HOSTS`` aside)."""
    found = []
    for path in modules():
        tree = ast.parse(path.read_text(), str(path))
        defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        functions = [(n.name, n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        functions += [(f"{c.name}.__init__", f) for c in tree.body if isinstance(c, ast.ClassDef)
                      for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
        for name, fn in functions:
            for arg in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
                annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                kind = _orchestrator(annotation) if annotation else ("Worker" if arg.arg in ("w", "worker") else None)
                if kind is None or kind in defined:
                    continue
                if str(path.relative_to(PACKAGE)).startswith(HOSTS.get(kind, ())):
                    continue
                found.append(f"{path.relative_to(PACKAGE.parent)}: {name}({arg.arg}: {annotation})")
    assert not found, "\n".join(found)


def test_no_class_inherits_a_mixin_from_another_module():
    """A base class from another module of the package is an interface (ABC, Protocol), a message,
    a config section or an exception: never half of a class split across files. An interface
    from another module holds no state (no ``__init__``) and its concrete methods are not
    overridden: a role built on another role, or a tier on another tier's storage, composes them."""
    import abc
    import enum
    import importlib
    import inspect

    import msgspec
    import pydantic

    def interface_misuse(cls: type, base: type) -> list[str]:
        found = ["__init__"] if "__init__" in vars(base) else []
        abstract = getattr(base, "__abstractmethods__", frozenset())
        return found + [f"overrides {n}" for n, v in vars(base).items()
                        if not n.startswith("__") and callable(v) and n not in abstract and n in vars(cls)]

    mixins = []
    for path in modules():
        name = module_name(path)
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != name:
                continue
            for base in cls.__mro__[1:]:
                if not base.__module__.startswith("mooncake.") or base.__module__ == name:
                    continue
                if issubclass(base, (BaseException, msgspec.Struct, pydantic.BaseModel, enum.Enum)):
                    continue
                where = f"{name}.{cls.__name__}({base.__module__}.{base.__name__})"
                if isinstance(base, abc.ABCMeta) or getattr(base, "_is_protocol", False):
                    mixins += [f"{where}: {why}" for why in interface_misuse(cls, base)]
                elif base in cls.__bases__:
                    mixins.append(where)
    assert not mixins, "\n".join(mixins)


def test_a_module_name_names_one_module():
    """The names that once meant two or three things (a request's placement and a block's, the
    colocated role, its step budget and its simulation...) each name one module now."""
    names = ["placement", "colocated", "cluster", "pipeline", "link", "codec", "lru", "request_metrics"]
    for name in names:
        found = sorted(str(p.relative_to(PACKAGE)) for p in modules() if p.stem == name)
        assert len(found) == 1, f"{name}.py: {found}"
    classes = [f"{module_name(p)}.{n.name}" for p in modules() for n in ast.parse(p.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "Attempt"]
    assert len(classes) == 1, classes


def test_the_persistent_tier_is_used_through_its_interface():
    """``Placement`` and ``Durability`` call on the disk tier only what ``PersistentTier`` declares;
    a store refuses a second persistent tier, or one above a memory tier."""
    import pytest

    from mooncake.tiers.base import Tier
    from mooncake.tiers.memory import DramTier
    from mooncake.tiers.lmdb_tier import LmdbTier
    from mooncake.tiers.persistent import PersistentTier, persistent_index

    declared = {n for n in dir(PersistentTier) if not n.startswith("_")} | set(PersistentTier.__annotations__)
    only_lmdb = {n for n in vars(LmdbTier) if not n.startswith("_")} - declared - set(dir(Tier)) - set(Tier.__annotations__)
    for name in ("block_placement.py", "durability.py", "tiered.py"):
        source = (PACKAGE / "tiers" / name).read_text()
        used = sorted(n for n in only_lmdb if f".{n}(" in source or f".{n} " in source)
        assert not used, f"tiers/{name} calls LMDB-only {used}"
    dram = DramTier(1 << 20)
    assert persistent_index([dram]) is None
    lmdb_like = type("Durable", (PersistentTier,), {n: lambda *a: None for n in PersistentTier.__abstractmethods__})
    lmdb_like.name = "durable"
    with pytest.raises(ValueError, match="last"):
        persistent_index([lmdb_like(), dram])
    with pytest.raises(ValueError, match="at most one"):
        persistent_index([dram, lmdb_like(), lmdb_like()])
