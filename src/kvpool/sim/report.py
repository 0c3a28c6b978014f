"""Tables, JSON rows and PNG plots of experiment results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from kvpool.sim.experiments.common import ExperimentResult


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(columns: list[str], rows: list[dict[str, Any]]) -> str:
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(out)


def print_result(result: ExperimentResult, stream: TextIO, as_json: bool) -> None:
    if as_json:
        for row in result.rows:
            stream.write(json.dumps({"experiment": result.name, **row}) + "\n")
        return
    table = result.rows if result.table_rows is None else result.table_rows
    stream.write(f"{result.title}\n\n{format_table(result.columns, table)}\n")
    for note in result.notes:
        stream.write(f"  note: {note}\n")


def new_figure() -> tuple[Figure, Axes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.grid(True, alpha=0.3)
    return fig, ax


def save(fig: Figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bar_pairs(ax: Axes, labels: list[str], ours: list[float], paper: list[float | None],
              ylabel: str) -> None:
    """Side-by-side bars: kvpool and the paper's figure for each label."""
    xs = list(range(len(labels)))
    ax.bar([x - 0.2 for x in xs], ours, width=0.4, label="kvpool")
    ax.bar([x + 0.2 for x in xs], [p if p is not None else 0 for p in paper], width=0.4,
           label="paper")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=15)
    ax.set_ylabel(ylabel)
    ax.legend()
