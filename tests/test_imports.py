"""The import graph of `specmlx`: layers that only point down, and modules of a readable size.

No cycles; the engine never reaches the CLI; the CPU backend never reaches the modules
above it; the engine and the target use the CPU backend through its package's exports;
no module over MAX_LINES lines.

Every .py file under specmlx/ is parsed (nothing is imported, so the check is fast and
cannot be fooled by import order). An import inside a function counts as well: it runs
on first call, and a cycle there is a cycle the moment someone hoists it. Imports under
`if TYPE_CHECKING:` never run and do not count. Dynamic imports (`import_module(...)`)
are not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "specmlx"

# Modules below the CLI: importing them must never pull in the CLI or its UI libraries.
# Each names a module and, for a package, its submodules: "drafters" covers drafters/.
ENGINE_LEVEL = ("engine", "drafters", "policy", "caches", "sampling", "verify", "loading")
ENGINE_LEVEL += ("exactness", "stepwise", "cpu")
UI_LIBRARIES = ("rich", "typer")

# The CPU backend sits below these: they hand it what it needs to know of them
# (cpu.prepare's `passes_exact`) rather than being imported by it.
CPU = "cpu"
ABOVE_CPU = ("caches", "stepwise", "loading", "exactness")

# These use the CPU backend only through the names specmlx/cpu/__init__.py exports, so
# that its modules can be split and renamed without touching them. Either may not exist.
CPU_PACKAGE_USERS = ("engine", "target")

MAX_LINES = 600

Graph = dict[str, dict[str, str]]  # importer → {imported: "file:line  statement"}


def find_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package by dotted name; a package is its __init__.py."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Import statements anywhere in the file, skipping `if TYPE_CHECKING:` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _prefixes(name: str) -> list[str]:
    """a.b.c → [a, a.b, a.b.c]: importing a.b.c runs each of these, outermost first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imports_of(name: str, path: Path) -> list[tuple[str, str, ast.stmt]]:
    """(module, imported name or "", statement) for each thing the file imports."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "", node) for alias in node.names]
            continue
        base = node.module or ""
        if node.level:  # each dot past the first climbs one package up
            anchor = package.rsplit(".", node.level - 1)[0]
            base = f"{anchor}.{base}" if base else anchor
        found += [(base, alias.name, node) for alias in node.names]
    return found


def build_graph(root: Path, package: str) -> tuple[Graph, Graph]:
    """(internal edges, external edges) of the package's import graph.

    Importing a.b.c first runs the packages a and a.b, so those are edges too, except
    for the importer's own parent packages: Python has begun running those before the
    importer, so importing a submodule through them starts nothing new. A name taken
    from a parent package (`from . import X`, X not a submodule) needs that package's
    body to have run, and is an edge.
    """
    modules = find_modules(root, package)
    internal: Graph = {name: {} for name in modules}
    external: Graph = {name: {} for name in modules}
    for name, path in modules.items():
        parents = set(_prefixes(name))
        for module, imported, node in imports_of(name, path):
            where = f"{path.relative_to(root)}:{node.lineno}  {ast.unparse(node)}"
            if module.split(".")[0] != package:
                external[name].setdefault(module.split(".")[0], where)
                continue
            submodule = f"{module}.{imported}"
            targets = [p for p in _prefixes(module) if p not in parents]
            if submodule in modules:
                targets.append(submodule)
            elif imported:
                targets.append(module)  # a name defined in module's own body
            for target in targets:
                if target in modules and target != name:
                    internal[name].setdefault(target, where)
    return internal, external


def find_cycle(graph: Graph) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None; depth-first, in sorted order."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        pending = [iter(sorted(graph[start]))]
        while pending:
            nxt = next(pending[-1], None)
            if nxt is None:  # every import of path[-1] explored: no cycle through it
                pending.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
            elif nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                pending.append(iter(sorted(graph.get(nxt, {}))))
    return None


def find_path(graph: Graph, start: str, goal: Callable[[str], bool]) -> list[str] | None:
    """The shortest import chain from start to a module for which goal(module) holds."""
    previous = {start: ""}
    queue = [start]
    for module in queue:
        if goal(module):
            chain = [module]
            while previous[chain[-1]]:
                chain.append(previous[chain[-1]])
            return chain[::-1]
        for nxt in sorted(graph.get(module, {})):
            if nxt not in previous:
                previous[nxt] = module
                queue.append(nxt)
    return None


def within(module: str, names: tuple[str, ...]) -> bool:
    """Whether `module` is one of the package's `names` or a submodule of one."""
    return any(module == f"{PACKAGE}.{n}" or module.startswith(f"{PACKAGE}.{n}.") for n in names)


def describe(graph: Graph, chain: list[str]) -> str:
    """a -> b -> a, then the statement behind each step."""
    steps = [f"  {graph[a][b]}" for a, b in zip(chain, chain[1:], strict=False)]
    return "\n".join([" -> ".join(chain), *steps])


def test_find_cycle_finds_a_cycle():
    # the checker itself must be able to fail, or the real test proves nothing
    graph = {"a": {"b": "a:1"}, "b": {"c": "b:1"}, "c": {"a": "c:1"}, "d": {"a": "d:1"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ""}, "b": {}, "c": {"a": "", "b": ""}}) is None
    assert describe(graph, ["a", "b", "c", "a"]).splitlines()[0] == "a -> b -> c -> a"


def test_graph_sees_package_cycles(tmp_path):
    """The two shapes of cycle that reached this repository, on a synthetic package."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        # the CLI case: a submodule takes a name from its package, which imports it back
        "__init__.py": "STAMP = 1\ndef main():\n    from . import report\n",
        "report.py": "from . import STAMP\n",
        # the convert case: a function-level import closing a module-level one
        "sub/__init__.py": "",
        "sub/a.py": "from .b import x\n",
        "sub/b.py": "x = 1\ndef f():\n    from .a import y\n",
        # importing through a package runs its __init__; TYPE_CHECKING imports never run
        "c.py": "import pkg.sub.a\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from . import d\n",
        "d.py": "from .c import z\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph, external = build_graph(tmp_path, "pkg")
    assert set(graph["pkg.report"]) == {"pkg"}
    assert set(graph["pkg"]) == {"pkg.report"}
    assert set(graph["pkg.sub.a"]) == {"pkg.sub.b"}  # its own package has run already
    assert set(graph["pkg.sub.b"]) == {"pkg.sub.a"}
    assert set(graph["pkg.c"]) == {"pkg.sub", "pkg.sub.a"}
    assert set(graph["pkg.d"]) == {"pkg.c"}
    assert set(external["pkg.c"]) == {"typing"}
    assert find_cycle(graph) == ["pkg", "pkg.report", "pkg"]


def test_find_path_finds_the_shortest_chain():
    graph = {"a": {"b": "", "c": ""}, "b": {"d": ""}, "c": {}, "d": {"c": ""}}
    assert find_path(graph, "a", lambda m: m == "c") == ["a", "c"]
    assert find_path(graph, "b", lambda m: m == "c") == ["b", "d", "c"]
    assert find_path(graph, "c", lambda m: m == "a") is None


def test_no_import_cycles():
    graph, _ = build_graph(ROOT, PACKAGE)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle:\n{describe(graph, cycle)}"


def test_every_engine_level_name_is_a_module():
    modules = find_modules(ROOT, PACKAGE)
    missing = [n for n in ENGINE_LEVEL if f"{PACKAGE}.{n}" not in modules]
    assert not missing, f"ENGINE_LEVEL names modules that do not exist: {missing}"


def test_engine_never_imports_the_cli():
    graph, _ = build_graph(ROOT, PACKAGE)
    for start in [m for m in graph if within(m, ENGINE_LEVEL)]:
        chain = find_path(graph, start, lambda m: within(m, ("cli",)))
        assert chain is None, f"{start} reaches the CLI:\n{describe(graph, chain)}"


def test_engine_never_imports_the_ui_libraries():
    graph, external = build_graph(ROOT, PACKAGE)
    for start in [m for m in graph if within(m, ENGINE_LEVEL)]:
        chain = find_path(graph, start, lambda m: any(lib in external[m] for lib in UI_LIBRARIES))
        if chain is not None:
            lib = next(lib for lib in UI_LIBRARIES if lib in external[chain[-1]])
            raise AssertionError(
                f"{start} imports {lib}:\n{describe(graph, chain)}\n  {external[chain[-1]][lib]}"
            )


def test_cpu_never_imports_the_modules_above_it():
    graph, _ = build_graph(ROOT, PACKAGE)
    cpu = [m for m in graph if within(m, (CPU,))]
    assert len(cpu) > 1, "no specmlx.cpu modules found: has the package moved?"
    for start in cpu:
        chain = find_path(graph, start, lambda m: within(m, ABOVE_CPU))
        assert chain is None, f"{start} reaches {chain[-1]}:\n{describe(graph, chain)}"


def test_engine_and_target_use_cpu_only_through_its_package_exports():
    graph, _ = build_graph(ROOT, PACKAGE)
    for user in [f"{PACKAGE}.{name}" for name in CPU_PACKAGE_USERS if f"{PACKAGE}.{name}" in graph]:
        inside = sorted(m for m in graph[user] if m.startswith(f"{PACKAGE}.{CPU}."))
        steps = "\n".join(f"  {graph[user][m]}" for m in inside)
        assert not inside, f"{user} imports specmlx.cpu's modules, not its exports:\n{steps}"


def test_no_module_is_over_600_lines():
    lengths = {
        name: len(path.read_text().splitlines())
        for name, path in find_modules(ROOT, PACKAGE).items()
    }
    long = {name: n for name, n in sorted(lengths.items()) if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"
