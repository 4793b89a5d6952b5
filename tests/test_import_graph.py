"""No import circles among trtbuild's modules: every package reads top-down (a module's imports
never lead back to it); the CLI (cli/) sits above the builder and the runtime and imports both;
builder and runtime never import each other nor the CLI; and the packages both of them share
(contract/, the engine-dir format; checkpoint/, reading a user's checkpoint; plugins/, ops and how
each executor runs them) import none of the three; contract/ sits at the bottom and imports no other
trtbuild package; inside runtime/, its sub-packages read top-down as wholes too. Every import
counts: those inside functions, and those under ``if TYPE_CHECKING:`` (a type that names its user
back is a circle too, one the interpreter just does not run into)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The packages below the builder and the runtime that both may import.
SHARED = ("contract", "checkpoint", "plugins")
PACKAGES = ("cli", "builder", "runtime", *SHARED)


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The trtbuild modules ``path`` imports (``from .x import y`` counts y if it is a module)."""
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[:len(package) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                elif child.module and child.module.startswith("trtbuild."):
                    target = child.module[len("trtbuild."):]
                else:
                    target = None
                if target is not None:
                    found.add(target)
                    found.update(f"{target}.{alias.name}" for alias in child.names
                                 if f"{target}.{alias.name}" in modules)
            elif isinstance(child, ast.Import):
                found.update(a.name[len("trtbuild."):] for a in child.names if a.name.startswith("trtbuild."))
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules and m != _module(path)}


def import_graph() -> dict[str, set[str]]:
    paths = [p for package in PACKAGES if (REPO / package).is_dir() for p in sorted((REPO / package).rglob("*.py"))]
    modules = {_module(p) for p in paths}
    graph = {_module(p): _imports(p, modules) for p in paths}
    # Importing a.b.c runs a/__init__ and a/b/__init__ first.
    for module in list(graph):
        for target in list(graph[module]):
            parts = target.split(".")
            graph[module].update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules)
        graph[module].discard(module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return out


def test_the_import_graph_has_no_circles():
    graph = import_graph()
    # A package's __init__ re-exporting its submodules is not a circle of modules.
    for module, targets in graph.items():
        for target in list(targets):
            if module.startswith(target + "."):
                targets.discard(target)
    assert circles(graph) == []


def test_builder_and_runtime_do_not_import_each_other():
    graph = import_graph()
    crossings = sorted((m, t) for m, targets in graph.items() for t in targets
                       if {m.split(".")[0], t.split(".")[0]} == {"builder", "runtime"})
    assert crossings == []


def test_the_checker_finds_a_planted_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_shared_packages_import_neither_builder_nor_runtime_nor_the_cli():
    graph = import_graph()
    reaching = sorted((m, t) for m, targets in graph.items() for t in targets
                      if m.split(".")[0] in SHARED and t.split(".")[0] in ("builder", "runtime", "cli"))
    assert reaching == []


def test_only_the_cli_imports_the_cli():
    graph = import_graph()
    reaching = sorted((m, t) for m, targets in graph.items() for t in targets
                      if m.split(".")[0] != "cli" and t.split(".")[0] == "cli")
    assert reaching == []


def test_the_cli_imports_the_builder_and_the_runtime_normally():
    """Not by string (importlib), which this graph could not see."""
    graph = import_graph()
    reached = {t.split(".")[0] for m, targets in graph.items() if m.split(".")[0] == "cli" for t in targets}
    assert {"builder", "runtime"} <= reached


def test_the_contract_imports_no_other_trtbuild_package():
    graph = import_graph()
    reaching = sorted((m, t) for m, targets in graph.items() for t in targets
                      if m.split(".")[0] == "contract" and t.split(".")[0] != "contract")
    assert graph.keys() >= {"contract.errors", "contract.processes", "contract.paths"} and reaching == []


def test_every_root_package_is_installed():
    """setup.py discovers the packages; a root folder of Python modules without __init__.py would
    silently stay out of the wheel."""
    for package in PACKAGES:
        folders = {p.parent for p in (REPO / package).rglob("*.py")}
        assert all((f / "__init__.py").is_file() for f in folders), sorted(f for f in folders if not (f / "__init__.py").is_file())


def package_graph(graph: dict[str, set[str]], root: str) -> dict[str, set[str]]:
    """``graph`` collapsed to ``root``'s parts: each sub-package of ``root`` is one node (its modules
    together), each module directly in ``root`` is its own node; imports inside a node and of
    ``root`` itself are no edges."""
    def part(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:2]) if parts[0] == root and len(parts) > 1 else None

    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = part(module)
        if source is None:
            continue
        parts.setdefault(source, set())
        for target in targets:
            into = part(target)
            if into is not None and into != source:
                parts[source].add(into)
    return parts


def test_the_runtime_packages_import_each_other_top_down():
    """runtime's sub-packages as a whole have no circles either (backends/ below parallel/, core/
    below speculation/ and backends/): a package-level circle is a module circle waiting to happen,
    and it hides which package is the lower one."""
    assert circles(package_graph(import_graph(), "runtime")) == []


def test_the_package_graph_finds_a_planted_package_circle():
    """No two modules form a circle here, their packages do; a module importing its own package's
    ``__init__`` (runtime.a.x → runtime.a) and the root package itself are no edges."""
    graph = {"runtime.a.x": {"runtime.b.y", "runtime.a"}, "runtime.b.z": {"runtime.a.w", "runtime"},
             "runtime.a.w": set(), "runtime.b.y": set(), "runtime.c": {"runtime.a.x"}, "runtime": set()}
    assert circles(graph) == []
    parts = package_graph(graph, "runtime")
    assert parts == {"runtime.a": {"runtime.b"}, "runtime.b": {"runtime.a"}, "runtime.c": {"runtime.a"}}
    assert circles(parts) == [["runtime.a", "runtime.b"]]
