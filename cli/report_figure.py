"""What every chart of `slipstream report` draws on: a figure, its PNG bytes, a steps axis, a metrics series.

The non-obvious choice: a figure is a `matplotlib.figure.Figure` drawn on an Agg canvas, never pyplot, so
no global state or GUI backend is touched; and a series reads each metrics record with `.get`, so an older
run's metrics.jsonl draws what it has. The charts themselves: cli/report_plots.py (which lists them),
cli/report_speculation.py, cli/report_tail.py.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from slipstream.cli.report import RunData

__all__ = ["figure", "no_field", "png", "series", "steps_axis"]


def figure(width: float = 8.0, height: float = 4.0) -> Figure:
    """An empty figure of `width` x `height` inches at 100 dpi, laid out by matplotlib's constrained layout."""
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def png(fig: Figure) -> bytes:
    """`fig` drawn on an Agg canvas, as PNG bytes."""
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def steps_axis(ax: Axes) -> None:
    """An x axis of whole steps, with a light grid."""
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def series(run: RunData, key: str) -> tuple[list[int], list[Any]]:
    """(steps, values) of the records that carry `key` with a non-null value."""
    pairs = [(r["step"], r[key]) for r in run.records if r.get(key) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def no_field(key: str) -> str:
    """Why a chart is not drawn: the run's metrics predate `key`."""
    return f"metrics.jsonl has no `{key}` field (a run recorded before it was)"
