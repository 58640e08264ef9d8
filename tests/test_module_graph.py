"""The house rules of src/eaglet/, checked on the source: stages on a library (no stage imports
another stage, the library imports no stage), no import cycle between eaglet's modules nor between
its packages, imports at the top of files (a function-local import only for an optional or heavy
third-party dependency, with the reason in a comment on its line), no module over ~800 lines, and
no function over 45 statements in a stage's entry module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "eaglet"
MAX_LINES = 850  # "about 800": a module past this is split along its seams
# a stage's entry module reads top to bottom as a sequence of named steps: counted in statements,
# which the formatter's line breaks do not move
MAX_ENTRY_FUNCTION_STATEMENTS = 45
# The pipeline's stages, one module or package each: files on disk are their contract, so none
# imports another. `recipe` runs them in order and `cli` calls them; both may import any.
STAGES = {"regen", "prepare", "extract", "training", "convert", "export", "evaluate"}
ORCHESTRATORS = {"recipe", "cli", "__main__"}
# Everything else is the library under the stages (chat, target, formats, dataset, drafter, decode,
# check: the format check is a library of contracts that `eaglet check`, train and convert all run).


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(node: ast.AST, current: str, known: set[str]) -> list[str]:
    """The eaglet modules an import statement loads (`from eaglet import formats` loads eaglet.formats)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "eaglet"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: level 1 is the current package (a package's own __init__ is its package)
        package = current.split(".") if current in PACKAGES else current.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "eaglet":
        return []
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
    return subs or [target]


PACKAGES = {module_name(p) for p in PACKAGE.rglob("__init__.py")}


def top_level_imports(tree: ast.Module) -> list[ast.AST]:
    """Imports run when the module loads: at module level, also inside `if`/`try` (not TYPE_CHECKING)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
    return out


def graph() -> dict[str, set[str]]:
    known = set(modules())
    edges: dict[str, set[str]] = {}
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        deps = {d for node in top_level_imports(tree) for d in imported(node, name, known)}
        # importing eaglet.a.b runs eaglet/a/__init__.py first, except from inside eaglet.a, whose
        # __init__ is always loaded (and under way) before any of its submodules
        deps |= {".".join(d.split(".")[:i]) for d in deps for i in range(2, len(d.split(".")))}
        edges[name] = {d for d in deps if d in known and d != name and d != "eaglet" and not name.startswith(d + ".")}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    edges = graph()
    assert len(edges) > 15 and edges["eaglet.cli"] == {"eaglet.options"}  # cli loads a stage only to run it
    assert cycles(edges) == []


def test_imports_are_at_the_top_unless_said_why():
    """A function-local import is for an optional or heavy third-party package, with the reason
    written on its line; eaglet's own modules are imported at the top, but by the command line,
    which imports a stage's module (and with it torch) only to run that stage."""
    bad = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if not isinstance(inner, (ast.Import, ast.ImportFrom)):
                    continue
                own = (
                    isinstance(inner, ast.ImportFrom) and (inner.level or (inner.module or "").startswith("eaglet"))
                ) or (isinstance(inner, ast.Import) and any(a.name.startswith("eaglet") for a in inner.names))
                said = "#" in lines[inner.lineno - 1] or "#" in lines[inner.end_lineno - 1]
                if not said or (own and name != "eaglet.cli"):  # cli loads a stage (and torch) only to run it
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{inner.lineno}: {lines[inner.lineno - 1].strip()}")
    assert bad == [], "function-local imports:\n" + "\n".join(bad)


def test_no_module_over_the_limit():
    long = {name: n for name, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def unit(module: str) -> str:
    """The stage, library module or package a module belongs to: eaglet.training.loop -> training."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_stage_imports_another_stage_and_the_library_imports_none():
    edges = graph()
    assert STAGES <= {unit(m) for m in edges}, "a stage named here no longer exists: update STAGES"
    bad = sorted(
        f"{m} -> {d}"
        for m, deps in edges.items()
        for d in deps
        if unit(d) in STAGES and unit(d) != unit(m) and unit(m) not in ORCHESTRATORS
    )
    assert bad == [], "imports of a stage from outside it:\n" + "\n".join(bad)


def test_no_package_level_cycle():
    """Modules collapsed into their top-level unit (a package or a module): no cycle among those."""
    units: dict[str, set[str]] = {}
    for m, deps in graph().items():
        units.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) != unit(m))
    assert cycles(units) == []


def test_the_graph_rules_catch_what_they_name():
    """The checks above fail on a stage importing a stage and on a cycle between two packages."""
    edges = {
        "eaglet.extract": {"eaglet.training.teacher"},
        "eaglet.training.teacher": {"eaglet.formats"},
        "eaglet.formats": {"eaglet.dataset"},
        "eaglet.dataset": {"eaglet.formats"},
    }
    assert [f"{m} -> {d}" for m, deps in edges.items() for d in deps if unit(d) in STAGES and unit(d) != unit(m)] == [
        "eaglet.extract -> eaglet.training.teacher"
    ]
    assert cycles(edges) == [["eaglet.dataset", "eaglet.formats"]]


def entry_modules() -> dict[str, Path]:
    """The module that holds each stage's entry function (options.STAGES `entry`)."""
    from eaglet.options import STAGES as STAGE_DECLARATIONS

    names = {s.entry.split(":")[0] for s in STAGE_DECLARATIONS.values()}
    return {n: p for n, p in modules().items() if n in names and unit(n) not in ORCHESTRATORS}


def test_entry_modules_read_top_to_bottom():
    long = []
    for name, path in entry_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = sum(isinstance(inner, ast.stmt) for inner in ast.walk(node)) - 1  # the def itself not counted
                if n > MAX_ENTRY_FUNCTION_STATEMENTS:
                    long.append(f"{name}.{node.name}: {n} statements")
    assert len(entry_modules()) >= 7 and long == [], "functions over the limit:\n" + "\n".join(long)


def test_no_test_module_imports_another():
    """Shared builders live in tests/helpers.py, fixtures in conftest.py, the engines' replayed loaders
    in tests/replays.py: a test module that imports another would run that one's fixtures too."""
    tests = PACKAGE.parents[1] / "tests"
    bad = [
        f"{p.relative_to(tests)}: {line.strip()}"
        for p in sorted(tests.rglob("test_*.py"))
        for line in p.read_text().splitlines()
        if re.match(r"(from|import) (tests\.)?test_", line.strip())
    ]
    assert bad == [], "\n".join(bad)
