"""The report's long-tail chart: one step's rollout, every sample a line from its admission to its finish.

`long_tail` picks the step (`--tail-step`, else the traced step whose rollout took longest), groups the
run's `sample` spans by step (the coordinator's `rollout` span they start in, else their own step) and
draws one row of lines per rollout actor, coloured by response tokens: the gap between most samples
finishing and the last one is the tail, when devices idle unless leased to the drafter. Split from
cli/report_plots.py (which lists it among the charts), as the one chart drawn from spans, not metrics.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from slipstream.cli.report_figure import figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from slipstream.cli.report import RunData
    from slipstream.runtime.spans import Span

__all__ = ["long_tail", "longest_rollout", "sample_steps"]


def long_tail(run: RunData) -> Figure | str:
    if run.spans_missing:
        return run.spans_missing
    samples = [s for s in run.spans if s.name == "sample"]
    if not samples:
        return "RUN/spans has no `sample` spans: the rollout did not record them"
    by_step = sample_steps(samples, run.spans)
    if not by_step:
        return "no `sample` span carries a step or falls inside a coordinator `rollout` span"
    step = run.tail_step if run.tail_step is not None else longest_rollout(run, by_step)
    if step not in by_step:
        return f"no `sample` spans for step {step} (spans cover steps {', '.join(map(str, sorted(by_step)))})"
    return _draw_tail(run.spans, by_step[step], step)


def sample_steps(samples: list[Span], spans: list[Span]) -> dict[int, list[Span]]:
    """`sample` spans by step: the coordinator's `rollout` span they start in, else their own `step` (the
    policy version they decoded with, which is the step in the synchronous loop)."""
    windows = [
        (s.start_ns, s.end_ns, s.step)
        for s in spans
        if s.name == "rollout" and s.role == "coordinator" and s.step is not None
    ]
    out: dict[int, list[Span]] = {}
    for span in samples:
        step = next((w[2] for w in windows if w[0] <= span.start_ns <= w[1]), span.step)
        if step is not None:
            out.setdefault(step, []).append(span)
    return out


def longest_rollout(run: RunData, by_step: dict[int, list[Span]]) -> int:
    """The traced step whose rollout took longest (metrics' rollout_s; then the samples' own extent)."""
    rollout_s = {r["step"]: r.get("rollout_s") or 0.0 for r in run.records}

    def extent(step: int) -> tuple[float, int]:
        spans = by_step[step]
        return rollout_s.get(step, 0.0), max(s.end_ns for s in spans) - min(s.start_ns for s in spans)

    return max(by_step, key=extent)


def _draw_tail(spans: list[Span], samples: list[Span], step: int) -> Figure:
    import matplotlib
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    phase = next(
        (s for s in spans if s.name == "rollout" and s.role == "coordinator" and s.step == step), None
    )
    t0 = phase.start_ns if phase else min(s.start_ns for s in samples)
    actors = sorted({s.actor for s in samples}, key=lambda a: (len(a), a))
    tokens = [int(s.args.get("tokens", 0)) for s in samples]
    norm = Normalize(vmin=min(tokens), vmax=max(max(tokens), min(tokens) + 1))
    cmap = matplotlib.colormaps["viridis"]
    rows = max(len([s for s in samples if s.actor == a]) for a in actors)
    fig = figure(9.0, min(2.0 + 0.09 * rows * len(actors) + 0.6 * len(actors), 14.0))
    axes = fig.subplots(len(actors), 1, sharex=True, squeeze=False)[:, 0]
    ends = sorted((s.end_ns - t0) / 1e9 for s in samples)
    p90 = ends[math.ceil(0.9 * len(ends)) - 1]  # when 90% of the samples had finished
    t_end = max(phase.end_ns if phase else 0, max(s.end_ns for s in samples))
    shaded: set[bool] = set()  # which kinds of device_idle span were drawn (lent or not)
    idle_windows = [s for s in spans if s.name == "device_idle"]
    for ax, actor in zip(axes, actors, strict=True):
        mine = sorted((s for s in samples if s.actor == actor), key=lambda s: (s.start_ns, s.end_ns))
        colors = [cmap(norm(int(s.args.get("tokens", 0)))) for s in mine]
        shaded |= _shade_idle(ax, actor, idle_windows, t0=t0, t_end=t_end)
        phase_end = (phase.end_ns - t0) / 1e9 if phase else None
        _draw_lane(ax, actor, mine, colors, t0=t0, p90=p90, last=ends[-1], phase_end=phase_end)
    axes[-1].set_xlabel("seconds since the rollout began" if phase else "seconds since the first admission")
    half = ends[math.ceil(0.5 * len(ends)) - 1]
    axes[0].set_title(
        f"step {step}: {len(samples)} samples; half finished at {half:.2f} s, 90% at {p90:.2f} s, "
        f"the last at {ends[-1]:.2f} s"
    )
    _legend(fig, axes[0], phase=phase is not None, shaded=shaded)
    fig.colorbar(
        ScalarMappable(norm=norm, cmap=cmap), ax=list(axes), label="response tokens", shrink=0.6, aspect=40
    )
    return fig


def _shade_idle(ax: Axes, actor: str, idle_windows: list[Span], *, t0: int, t_end: int) -> set[bool]:
    """Shades `actor`'s idle windows in the step as the coordinator saw them: green where the device was
    lent to a drafter, grey where not. Returns which kinds were drawn (lent or not)."""
    shaded = set()
    for gap in idle_windows:
        if gap.args.get("device") == actor and gap.end_ns >= t0 and gap.start_ns <= t_end:
            lent = gap.args.get("lent_to") is not None
            color = "tab:green" if lent else "tab:gray"
            ax.axvspan((gap.start_ns - t0) / 1e9, (gap.end_ns - t0) / 1e9, color=color, alpha=0.15, lw=0)
            shaded.add(lent)
    return shaded


def _draw_lane(
    ax: Axes,
    actor: str,
    mine: list[Span],
    colors: list[Any],
    *,
    t0: int,
    p90: float,
    last: float,
    phase_end: float | None,
) -> None:
    """One actor's samples, a line each from admission to finish in admission order, under the marks of
    90% and all samples done and of the rollout phase's end."""
    rows_at = list(range(len(mine)))
    starts = [(s.start_ns - t0) / 1e9 for s in mine]
    finish = [(s.end_ns - t0) / 1e9 for s in mine]
    ax.hlines(rows_at, starts, finish, colors=colors, linewidth=2)
    ax.scatter(finish, rows_at, c=colors, marker="|", s=30)
    ax.axvline(p90, color="tab:orange", linestyle="--", linewidth=1)
    ax.axvline(last, color="tab:red", linestyle="--", linewidth=1)
    if phase_end is not None:
        ax.axvline(phase_end, color="black", linestyle=":", linewidth=1)
    ax.set_ylabel(f"{actor}\nsamples by admission", fontsize="small")
    ax.set_ylim(len(mine) - 0.5, -0.5)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", alpha=0.3)


def _legend(fig: Figure, ax: Axes, *, phase: bool, shaded: set[bool]) -> None:
    """The marks' and the idle shades' legend under the lanes (the shades drawn only)."""
    from matplotlib.patches import Patch

    handles = [
        ax.plot([], [], "--", color="tab:orange")[0],
        ax.plot([], [], "--", color="tab:red")[0],
    ]
    labels = ["90% of samples done", "last sample done"]
    if phase:
        handles.append(ax.plot([], [], ":", color="black")[0])
        labels.append("rollout phase ends")
    for lent in sorted(shaded):
        color = "tab:green" if lent else "tab:gray"
        handles.append(Patch(color=color, alpha=0.15))
        labels.append("device idle, lent to the drafter" if lent else "device idle")
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 3), fontsize="small")
