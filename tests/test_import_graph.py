"""The import graph of `src/kvpool`, read from the source (every import statement, also inside
functions and under TYPE_CHECKING): no import circles, and no library package importing the
tools (`kvpool.bench`, `kvpool.cli`). Also: no module of the store master reaches into
another object's private members (each table is the only writer of its state)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
TOOLS = ("kvpool.bench", "kvpool.cli")
MASTER = SRC / "kvpool" / "store" / "master"
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_field_defaults", "_make"})
"""Public methods of every NamedTuple (underscored only to keep clear of field names)."""


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "kvpool").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _known(name: str, mods: dict[str, Path]) -> str:
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def targets(name: str, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> list[str]:
    """The kvpool modules one import statement of module `name` loads."""
    if isinstance(node, ast.Import):
        return [_known(a.name, mods) for a in node.names if a.name.startswith("kvpool")]
    base = name if mods[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    if node.level:
        parts = base.split(".")[: len(base.split(".")) - node.level + 1]
        source = ".".join(parts + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if not source.startswith("kvpool"):
        return []
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else _known(source, mods)
            for a in node.names]


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges[name].update(t for t in targets(name, node, mods) if t != name)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def test_no_import_circles() -> None:
    assert circles(graph()) == []


def test_the_walk_finds_a_circle_made_on_purpose() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]]


def test_no_library_package_imports_a_tool() -> None:
    bad = sorted((src, dst) for src, dsts in graph().items() for dst in dsts
                 if not src.startswith(TOOLS) and src != "kvpool.__main__"
                 and dst.startswith(TOOLS))
    assert bad == []


def private_reaches(source: str) -> list[str]:
    """`name._private` accesses of one module on anything but `self` / `cls` (dunders and
    the NamedTuple API allowed), as 'line: expression'."""
    out: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") \
                or node.attr.startswith("__") or node.attr in NAMEDTUPLE_API:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        out.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [f"{line}: {text}" for line, _, text in sorted(out)]


def test_no_master_module_reaches_into_private_members() -> None:
    bad = {path.name: found for path in sorted(MASTER.glob("*.py"))
           if (found := private_reaches(path.read_text()))}
    assert bad == {}


def test_the_private_reach_walk_finds_reaches_made_on_purpose() -> None:
    source = ("self._a\ncls._b\nx.__len__\nput._replace(key='k')\n"
              "core._free(seg, 0)\nself.core._deferred\n")
    assert private_reaches(source) == ["5: core._free", "6: self.core._deferred"]


def writes_of(field: str, source: str) -> list[int]:
    """Lines of one module that assign `<anything>.<field>` (plain, augmented or annotated)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        out += [node.lineno for t in targets
                if isinstance(t, ast.Attribute) and t.attr == field]
    return sorted(out)


def test_only_the_object_table_extends_leases() -> None:
    """`StoredObject.lease_until` is written by `ObjectTable.extend_lease` alone."""
    found = {path.name: lines for path in sorted(MASTER.glob("*.py"))
             if (lines := writes_of("lease_until", path.read_text()))}
    assert list(found) == ["tables.py"] and len(found["tables.py"]) == 1


def test_the_write_walk_finds_writes_made_on_purpose() -> None:
    source = "obj.lease_until = 1\nx = obj.lease_until\no.lease_until += 2\nlease_until = 3\n"
    assert writes_of("lease_until", source) == [1, 3]
