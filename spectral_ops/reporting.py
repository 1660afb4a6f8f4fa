"""Writing a report's outputs (an experiment's or a training run's): markdown, its data as JSON, and figures as PNG."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from .provenance import machine, machine_line

FIGURE_DPI = 100


@functools.cache
def pyplot():
    """matplotlib's pyplot, drawing to files only, imported at the first figure: a second of every start of
    the training CLI went to importing it, where only the figures need it (a sweep's tables do not)."""
    try:
        import matplotlib
    except ImportError as error:  # an optional dependency of the package
        raise ImportError("the experiments draw their figures with matplotlib: "
                          "pip install 'spectral-ops[plots]'") from error
    matplotlib.use("Agg")  # files only: reports are written on headless machines
    import matplotlib.pyplot

    return matplotlib.pyplot


def __getattr__(name: str):
    """``plt``: :func:`pyplot`, for the modules that draw (``from ..reporting import plt``)."""
    if name == "plt":
        return pyplot()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def format_number(value) -> str:
    """Compact cells: integers as is, other numbers with 4 significant digits."""
    if isinstance(value, (bool, str, int)):
        return str(value)
    value = float(value) + 0.0  # + 0.0 turns -0.0 into 0.0
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.4g}"
    return f"{value:.2e}"


def markdown_table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(format_number(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _json_safe(value):
    """NaN and infinities become null: strict JSON has no literal for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def with_machine(markdown: str) -> str:
    """A report ending with the machine that computed it (CPU numbers differ between machines)."""
    return f"{markdown.rstrip()}\n\nComputed on {machine_line()}.\n"


def write_outputs(out_dir, name: str, markdown: str, data: dict, figure) -> dict:
    """Write ``name.md``, ``name.json`` and ``name.png`` into ``out_dir``, each report and data file
    naming the machine; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {suffix: out_dir / f"{name}.{suffix}" for suffix in ("md", "json", "png")}
    paths["md"].write_text(with_machine(markdown))
    paths["json"].write_text(json.dumps(_json_safe({**data, "machine": machine()}), indent=2, allow_nan=False) + "\n")
    figure.savefig(paths["png"], dpi=FIGURE_DPI, bbox_inches="tight")
    pyplot().close(figure)
    return paths
