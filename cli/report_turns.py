"""The report's turns chart (issue 42): how many turns a multi-turn run's samples took, and how long they
waited for their environment, step by step.

Top: turns per sample, the mean and the most, over the samples of each step by their turns (a point a
turn count, its area the samples that took it: the long tail in turns). Bottom, where the run recorded it:
the environment wait, a sample's mean (the step's summed `env_wait_s` over its samples) and the most one
sample waited (`env_wait_max_s`), under the rollout's wall time, which no sample's wait can pass. The
record's sum is sample-seconds (samples wait at once), so it is divided by the samples, never drawn against
seconds. Split from cli/report_plots.py (which lists it among the charts, for multi-turn runs only: a
single-turn run has no turns to draw, and its header says so).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from slipstream.cli.report import multi_turn

if TYPE_CHECKING:
    from slipstream.cli.report import RunData

__all__ = ["multi_turn", "turns"]


def turns(run: RunData) -> Figure | str:
    recs = [r for r in run.records if r.get("turns_mean") is not None]
    if not recs:
        return "metrics.jsonl has no `turns_mean` field (a run recorded before it was)"
    waits = [r for r in recs if r.get("env_wait_s") is not None and _samples(r)]
    fig = Figure(figsize=(8.0, 6.5 if waits else 4.0), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True) if waits else (fig.add_subplot(), None)
    steps = [r["step"] for r in recs]
    points = [(r["step"], int(k), n) for r in recs for k, n in (r.get("turns_by_count") or {}).items() if n]
    if points:
        most = max(n for _, _, n in points)
        top.scatter(
            [s for s, _, _ in points], [k for _, k, _ in points], s=[12 + 150 * n / most for _, _, n in points],
            color="tab:gray", alpha=0.35, linewidths=0, label="samples by turns (area: how many)",
        )  # fmt: skip
    top.plot(steps, [r["turns_mean"] for r in recs], "o-", color="tab:blue", label="mean")
    top.plot(steps, [r.get("turns_max", math.nan) for r in recs], "v:", color="tab:red", label="most")
    top.set_ylim(bottom=0)
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylabel("turns per sample")
    top.set_title(f"turns per sample: most {max(r.get('turns_max') or 0 for r in recs)} in one sample")
    _steps_axis(top)
    top.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    if bottom is not None:
        _waits(bottom, waits)
        top.set_xlabel("")  # the shared axis is labelled once, below
    return fig


def _samples(rec: dict[str, Any]) -> int:
    return sum((rec.get("turns_by_count") or {}).values())


def _waits(ax: Any, recs: list[dict[str, Any]]) -> None:
    steps = [r["step"] for r in recs]
    mean = [r["env_wait_s"] / _samples(r) for r in recs]
    ax.bar(steps, mean, width=0.6, color="tab:orange", alpha=0.8, label="a sample's mean")
    ax.plot(
        steps,
        [r.get("env_wait_max_s", math.nan) for r in recs],
        "v-",
        color="tab:red",
        label="most, one sample",
    )
    rollout = [r.get("rollout_s", math.nan) for r in recs]
    ax.plot(steps, rollout, "--", color="tab:gray", linewidth=1, label="rollout wall time")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("environment wait (s)")
    ax.set_title(
        f"environment wait: {sum(mean) / len(mean):.2f} s a sample on average, "
        f"most {max(r.get('env_wait_max_s') or 0.0 for r in recs):.2f} s"
    )
    _steps_axis(ax)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")


def _steps_axis(ax: Any) -> None:
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
