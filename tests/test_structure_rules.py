"""Three house rules read from the source, each with a walk that must find a violation planted
on purpose:

- **One writer per table** (store master): a table is a class of `store/master/` with a
  `check_integrity` method (or a subclass of one); its public fields are the `self.<field>`
  it assigns and the fields it annotates. No other module of the master writes such a field:
  no `<obj>.<field> = ...` (plain, augmented, annotated, `del`, also through `[...]`), and no
  `<obj>.<field>.append/pop/clear/...(...)` unless the field holds a table (then the call is
  that table's own method). `self.<field>` counts only in a subclass of a table of another
  module. Names are all the walk knows: a module may write a field named like a field of
  one of its own classes.
- **Typed seams** (engine): no parameter named for a store or a transport (`store`,
  `transport`, `transfer`, ...) is typed `Any`, or left untyped.
- **Small functions** (all of src/kvpool): no function (decorators left out, nested
  functions counted in their parent too) is over MAX_FUNCTION_LINES lines, except the few
  named in LONG_FUNCTIONS, each with its length: one that grows, or shrinks under the limit,
  fails until the list says so.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvpool"
MASTER = SRC / "store" / "master"
ENGINE = SRC / "engine"
MUTATORS = frozenset({
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "add", "discard",
    "update", "setdefault", "move_to_end", "sort", "reverse", "difference_update",
    "intersection_update", "symmetric_difference_update"})
"""Methods of list, dict, set and OrderedDict that change the container."""
SEAM_NAME = re.compile(r"(^|_)(store|transport|transfer)s?($|_)")
MAX_FUNCTION_LINES = 50
"""STYLE.md: most functions fit on a screen; none is over this."""
LONG_FUNCTIONS: dict[str, int] = {}
"""The functions still over MAX_FUNCTION_LINES (path under src/kvpool:name -> lines)."""


def _bases(cls: ast.ClassDef) -> list[str]:
    out = []
    for b in cls.bases:
        b = b.value if isinstance(b, ast.Subscript) else b
        if isinstance(b, ast.Name):
            out.append(b.id)
    return out


def _self_stores(cls: ast.ClassDef) -> list[tuple[str, ast.expr | None]]:
    """(field, assigned value) of each `self.<public> = value` in the class."""
    out = []
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                            and t.value.id == "self" and not t.attr.startswith("_"):
                        out.append((t.attr, node.value))
    return out


def _fields(cls: ast.ClassDef) -> set[str]:
    annotated = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)
                 and isinstance(s.target, ast.Name) and not s.target.id.startswith("_")}
    return annotated | {f for f, _ in _self_stores(cls)}


class Tables:
    """The table classes of a set of modules (name -> source), their fields and owners."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.trees = {mod: ast.parse(src) for mod, src in sources.items()}
        self.classes = {c.name: (mod, c) for mod, tree in self.trees.items()
                        for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}
        names = {n for n, (_, c) in self.classes.items()
                 if any(isinstance(f, ast.FunctionDef) and f.name == "check_integrity"
                        for f in c.body)}
        while more := {n for n, (_, c) in self.classes.items()
                       if n not in names and set(_bases(c)) & names}:
            names |= more
        self.names = names
        self.owners: dict[str, set[str]] = {}
        """Field -> the modules whose tables have it."""
        self.holds_table: set[str] = set()
        """Fields assigned a new table (`self.objects = ObjectTable(...)`)."""
        for name in names:
            mod, cls = self.classes[name]
            for f in _fields(cls):
                self.owners.setdefault(f, set()).add(mod)
            self.holds_table |= {f for f, v in _self_stores(cls) if isinstance(v, ast.Call)
                                 and isinstance(v.func, ast.Name) and v.func.id in names}
        self.own_names = {mod: set().union(*[_fields(c) for m, c in self.classes.values()
                                             if m == mod]) for mod in self.trees}
        """Module -> the fields of all its classes (tables or not)."""

    def violations(self) -> list[str]:
        out: list[str] = []
        for mod, tree in self.trees.items():
            self._visit(mod, tree, None, out)
        return sorted(out)

    def _visit(self, mod: str, node: ast.AST, cls: str | None, out: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            self._visit(mod, child, child.name if isinstance(child, ast.ClassDef) else cls, out)
        for target, by_call in _writes(node):
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and self._foreign(mod, cls, target, by_call):
                out.append(f"{mod}:{node.lineno}: {ast.unparse(target)}")

    def _foreign(self, mod: str, cls: str | None, target: ast.Attribute, by_call: bool) -> bool:
        """Whether writing `target` in class `cls` of `mod` writes another module's table."""
        field, owners = target.attr, self.owners.get(target.attr, set())
        if not owners or field in self.own_names[mod] or (by_call and field in self.holds_table):
            return False
        if isinstance(target.value, ast.Name) and target.value.id == "self":
            bases = _bases(self.classes[cls][1]) if cls in self.classes else []
            return any(b in self.names and self.classes[b][0] in owners for b in bases)
        return True


def _writes(node: ast.AST) -> list[tuple[ast.expr, bool]]:
    """The expressions one statement or call writes: (target, through a mutating call)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in MUTATORS:
        return [(node.func.value, True)]
    if isinstance(node, ast.Assign | ast.Delete):
        targets = node.targets
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    else:
        return []
    return [(t, False) for target in targets
            for t in (target.elts if isinstance(target, ast.Tuple | ast.List) else [target])]


def test_no_master_module_writes_another_modules_table() -> None:
    tables = Tables({p.name: p.read_text() for p in sorted(MASTER.glob("*.py"))})
    assert {"ObjectTable", "PendingPuts", "DiskKeys", "TierTransfers", "SsdMount",
            "TierState", "Tiering"} <= tables.names
    assert tables.violations() == []


TABLE = '''
class Stock:
    def __init__(self):
        self.items = {}
        self.count = 0
        self.sub = Stock()
    def add(self, key):
        self.items[key] = 1
        self.count += 1
    def check_integrity(self):
        assert len(self.items) == self.count
'''
USER = '''class Shop(Stock):
    def sell(self, key):
        self.count -= 1                       # 3: a subclass writing its base's field
class Own:
    def __init__(self):
        self.mine = []
    def fill(self, stock):
        self.stock = stock                    # 8: its own field
        self.mine.append(1)
        stock.add("k")                        # 10: the table's own method
        stock.items["k"] = 2                  # 11
        stock.count, x = 5, 1                 # 12
        del stock.items["k"]                  # 13
        stock.items.pop("k")                  # 14
        stock.sub.add("k")                    # 15: sub holds a table: its method
        n = stock.count + len(stock.items)    # 16: reads
        stock.sub.count += 1                  # 17
'''


def test_the_table_walk_finds_writes_made_on_purpose() -> None:
    tables = Tables({"stock.py": TABLE, "shop.py": USER})
    assert tables.names == {"Stock", "Shop"}
    assert tables.violations() == ["shop.py:11: stock.items", "shop.py:12: stock.count",
                                   "shop.py:13: stock.items", "shop.py:14: stock.items",
                                   "shop.py:17: stock.sub.count", "shop.py:3: self.count"]
    named_alike = "class Tally:\n    def __init__(self):\n        self.count = 0\n" \
        "def bump(t):\n    t.count += 1\n"
    assert Tables({"stock.py": TABLE, "tally.py": named_alike}).violations() == []


def untyped_seams(source: str) -> list[str]:
    """Parameters named for a store or a transport, typed Any (anywhere in the annotation)
    or not at all, as 'line: function(parameter)'."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        a = node.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p]:
            if not SEAM_NAME.search(arg.arg):
                continue
            names = {n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)} \
                | {n.attr for n in ast.walk(arg.annotation) if isinstance(n, ast.Attribute)} \
                if arg.annotation is not None else {"Any"}
            if "Any" in names:
                out.append(f"{arg.lineno}: {node.name}({arg.arg})")
    return out


def test_no_engine_seam_takes_an_untyped_store_or_transport() -> None:
    bad = {str(p.relative_to(ENGINE)): found for p in sorted(ENGINE.rglob("*.py"))
           if (found := untyped_seams(p.read_text()))}
    assert bad == {}


def test_the_seam_walk_finds_untyped_seams_made_on_purpose() -> None:
    source = ("def a(store: Any, transfer: KVTransport, restore: Any): ...\n"
              "def b(self, kv_store: typing.Any | None = None, *, transport=None): ...\n"
              "async def c(stores: list[KVStore], storey: Any): ...\n")
    assert untyped_seams(source) == ["1: a(store)", "2: b(kv_store)", "2: b(transport)"]


def long_functions(source: str, limit: int) -> dict[str, int]:
    """name -> lines (from `def` to its last line) of each function over `limit` lines."""
    return {node.name: n for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and (n := node.end_lineno - node.lineno + 1 if node.end_lineno else 0) > limit}


def test_no_function_is_over_the_limit_but_the_named_few() -> None:
    found = {f"{p.relative_to(SRC)}:{name}": n for p in sorted(SRC.rglob("*.py"))
             for name, n in long_functions(p.read_text(), MAX_FUNCTION_LINES).items()}
    assert found == LONG_FUNCTIONS


LONG = '''
@decorated
def four(a,
         b):
    x = a
    return x + b
class K:
    async def three(self):
        def two():
            return 2
        return two()
def one():
    return 1
'''


def test_the_length_walk_finds_long_functions_made_on_purpose() -> None:
    assert long_functions(LONG, 2) == {"four": 4, "three": 4}
    assert long_functions(LONG, 3) == {"four": 4, "three": 4}
    assert long_functions(LONG, 4) == {}
    assert long_functions(LONG, 1) == {"four": 4, "three": 4, "two": 2, "one": 2}
