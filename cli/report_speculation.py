"""The report's speculation charts: accept length and tuner arms per batch size, acceptance per draft
position, and the drafter's training loss.

Split from cli/report_plots.py (which lists them among the charts) as the charts of what speculation did.
The non-obvious choice: arms and buckets are ordered and coloured alike in every panel (`off` first and
grey, then the others by name; buckets by their lower edge), so a panel reads against its neighbours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from matplotlib.figure import Figure

from slipstream.cli.report_figure import figure, no_field, series, steps_axis

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from slipstream.cli.report import RunData

__all__ = ["accept_position", "drafter_loss", "speculation"]


def _bucket_key(bucket: str) -> int:
    head = bucket.split("-")[0]
    return int(head) if head.isdigit() else 1 << 30


def _arm_colors(arms: Sequence[str]) -> dict[str, Any]:
    import matplotlib

    palette = matplotlib.colormaps["tab10"].colors
    others = [a for a in arms if a != "off"]
    colors: dict[str, Any] = {arm: palette[i % len(palette)] for i, arm in enumerate(others)}
    colors["off"] = "lightgray"
    return colors


def _arm_order(arms: set[str]) -> list[str]:
    return (["off"] if "off" in arms else []) + sorted(arms - {"off"})


def speculation(run: RunData) -> Figure | str:
    """Accept length per batch-size bucket over the steps (top), and the share of decode iterations each
    tuner arm ran, a panel per bucket where the run recorded them by bucket (bottom)."""
    arm_sets = [set((r.get("arms") or {}).keys()) for r in run.records]
    all_arms = set().union(*arm_sets)
    if not all_arms:
        return no_field("arms")
    by_bucket_accept = [r.get("accept_by_batch") or {} for r in run.records]
    if all_arms == {"off"} and not any(by_bucket_accept):
        return "the run did not speculate: every decode iteration ran the `off` arm (a baseline run)"
    per_bucket = any(r.get("arms_by_batch") for r in run.records)
    if per_bucket:
        for r in run.records:
            for arms in (r.get("arms_by_batch") or {}).values():
                all_arms |= set(arms)
    arms = _arm_order(all_arms)
    arm_buckets = {b for r in run.records for b in (r.get("arms_by_batch") or {})}
    buckets = sorted(arm_buckets | {b for d in by_bucket_accept for b in d}, key=_bucket_key)
    panels = sorted(arm_buckets, key=_bucket_key) if per_bucket else ["all"]
    fig = figure(max(8.0, 2.0 * len(panels) + 1.5), 6.5)
    grid = fig.add_gridspec(2, len(panels), height_ratios=[1.2, 1])
    _draw_accept_lengths(fig.add_subplot(grid[0, :]), run, buckets)
    first = _draw_arm_shares(fig, grid, run, panels, arms, per_bucket=per_bucket)
    handles, labels = first.get_legend_handles_labels() if first else ([], [])
    fig.legend(
        handles, labels, loc="outside lower center", ncols=len(arms), fontsize="small", title="tuner arm"
    )
    return fig


def _draw_accept_lengths(top: Axes, run: RunData, buckets: list[str]) -> None:
    """Each bucket's accept length a line over the steps, then the speculated iterations' and all of them."""
    palette = _bucket_colors(len(buckets))
    all_steps = [r["step"] for r in run.records]
    for color, bucket in zip(palette, buckets, strict=True):
        values = [(r.get("accept_by_batch") or {}).get(bucket, math.nan) for r in run.records]
        top.plot(all_steps, values, "o-", color=color, label=f"batch {bucket}", alpha=0.85)
    steps, speculated = series(run, "spec_accept_length")
    if steps and any(speculated):
        # Where the drafts ran: the average over every iteration counts the tuner's plain ones as 1.0.
        shares = [
            r.get("spec_token_share") or 0.0 for r in run.records if r.get("spec_accept_length") is not None
        ]
        label = f"speculated iterations ({100 * sum(shares) / len(shares):.0f}% of tokens)"
        top.plot(steps, [v or math.nan for v in speculated], "k-", linewidth=2.5, label=label)
    steps, overall = series(run, "accept_length")
    if steps:
        top.plot(steps, overall, "--", color="gray", linewidth=1.5, label="all iterations")
    top.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    top.set_ylim(bottom=0.9)
    top.set_ylabel("accept length\n(tokens / seq / target pass)")
    top.set_title("accept length per batch-size bucket")
    steps_axis(top)
    top.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")


def _draw_arm_shares(
    fig: Figure, grid: Any, run: RunData, panels: list[str], arms: list[str], *, per_bucket: bool
) -> Axes | None:
    """A panel per bucket (or one for all): each step's decode iterations stacked by tuner arm, as shares.
    Returns the first panel, which carries the arms' legend handles."""
    colors = _arm_colors(arms)
    first: Axes | None = None
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(grid[1, i], sharey=first) if first else fig.add_subplot(grid[1, i])
        first = first or ax
        counts = [
            (
                r["step"],
                (r.get("arms_by_batch") or {}).get(panel, {}) if per_bucket else (r.get("arms") or {}),
            )
            for r in run.records
        ]
        bottom = [0.0] * len(counts)
        for arm in arms:
            shares = [c.get(arm, 0) / max(sum(c.values()), 1) for _, c in counts]
            ax.bar(
                [s for s, _ in counts],
                shares,
                bottom=bottom,
                color=colors[arm],
                width=0.8,
                label=arm if i == 0 else None,
            )
            bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
        ax.set_title(f"batch {panel}" if per_bucket else "arm share, all batch sizes", fontsize="medium")
        ax.set_ylim(0, 1)
        steps_axis(ax)
        if i == 0:
            ax.set_ylabel("share of iterations")
        else:
            ax.tick_params(labelleft=False)
    return first


def _bucket_colors(n: int) -> list[Any]:
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    return [cmap(0.1 + 0.8 * i / max(n - 1, 1)) for i in range(n)]


def accept_position(run: RunData) -> Figure | str:
    if not any("accept_by_position" in r for r in run.records):
        return no_field("accept_by_position")
    steps, rows = series(run, "accept_by_position")
    rows_steps = [(s, row) for s, row in zip(steps, rows, strict=True) if row]
    if not rows_steps:
        return "accept_by_position is empty at every step: nothing was speculated"
    depth = max(len(row) for _, row in rows_steps)
    fig = figure()
    ax = fig.add_subplot()
    rows_of = [r.get("accept_by_position") or [] for r in run.records]
    for i, color in enumerate(_bucket_colors(depth)):
        values = [row[i] if i < len(row) else math.nan for row in rows_of]
        ax.plot([r["step"] for r in run.records], values, "o-", color=color, label=f"draft token {i + 1}")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("share accepted")
    ax.set_title(f"acceptance per draft position (k up to {depth})")
    steps_axis(ax)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    return fig


def drafter_loss(run: RunData) -> Figure | str:
    if not any("drafter_loss" in r for r in run.records):
        return no_field("drafter_loss")
    steps, losses = series(run, "drafter_loss")
    if not steps:
        return "drafter_loss is null at every step: the drafter never trained (a baseline run, or no lease)"
    fig = figure()
    ax = fig.add_subplot()
    gapped = [math.nan if r.get("drafter_loss") is None else r["drafter_loss"] for r in run.records]
    all_steps = [r["step"] for r in run.records]
    ax.plot(all_steps, gapped, "o-", color="tab:purple")
    ax.set_xlim(all_steps[0] - 0.5, all_steps[-1] + 0.5)  # steps it did not train on stay in view
    ax.set_ylabel("drafter loss")
    ax.set_title(
        f"drafter loss {losses[0]:.3g} → {losses[-1]:.3g} "
        f"(trained in {len(steps)} of {len(run.records)} steps)"
    )
    steps_axis(ax)
    return fig
