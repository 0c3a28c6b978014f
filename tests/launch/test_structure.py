"""kvpool.launch is the one place in the library that starts child processes: no module of
src/kvpool outside kvpool.launch and kvpool.bench (whose benchmarks start the programs they
measure) calls `subprocess.Popen` or asyncio's `create_subprocess_exec`/`_shell`, nor imports
them by name. Read from the source (calls anywhere, also inside functions); a type annotation
(`subprocess.Popen[bytes]`) is no call."""

from __future__ import annotations

import ast
from pathlib import Path

KVPOOL = Path(__file__).resolve().parents[2] / "src" / "kvpool"
ALLOWED = ("launch", "bench")
SPAWNERS = frozenset({"Popen", "create_subprocess_exec", "create_subprocess_shell"})


def spawns(source: str) -> list[int]:
    """The lines of `source` that start a process directly (a call of one of SPAWNERS, or
    an import of one by name)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in SPAWNERS:
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(a.name in SPAWNERS for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_launcher_and_the_benchmarks_start_processes() -> None:
    found = {}
    for path in sorted(KVPOOL.rglob("*.py")):
        if path.relative_to(KVPOOL).parts[0] in ALLOWED:
            continue
        if lines := spawns(path.read_text()):
            found[str(path.relative_to(KVPOOL))] = lines
    assert found == {}, f"start these through kvpool.launch: {found}"


def test_the_launcher_does_start_processes() -> None:
    """The check reads what it should: kvpool.launch's own modules are found."""
    assert spawns((KVPOOL / "launch" / "children.py").read_text())
    assert spawns((KVPOOL / "launch" / "netns.py").read_text())


def test_every_way_of_spawning_is_seen_and_an_annotation_is_not() -> None:
    assert spawns("import subprocess\np: subprocess.Popen[bytes]\n") == []
    assert spawns("import subprocess\nsubprocess.Popen(['x'])\n") == [2]
    assert spawns("from subprocess import Popen\n") == [1]
    assert spawns("import asyncio\nasync def f():\n    await asyncio.create_subprocess_exec('x')\n"
                  ) == [3]
    assert spawns("import asyncio\nasyncio.create_subprocess_shell('x')\n") == [2]
