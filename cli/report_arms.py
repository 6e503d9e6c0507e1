"""The report's arm table: what each tuner arm bought and cost at each batch size, over the whole run.

One row per (arm, batch-size bucket) where the arm ran: decode iterations, accept length (tokens per
sequence per target pass), drafting time per drafted token, its share of the run's decoded tokens, and
committed tokens per decode second. The non-obvious choice: the steps' tables are pooled by summing their
counts (`pool_arm_tables` in rl/step.py), never by averaging their ratios, so a step with few iterations weighs
as little as it should. Drawn as a table, not bars: five figures a row read better as numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from matplotlib.figure import Figure

from slipstream.cli.report_figure import figure, no_field
from slipstream.rl.step import BATCH_BUCKETS, pool_arm_tables

if TYPE_CHECKING:
    from slipstream.cli.report import RunData

__all__ = ["arm_table"]

COLUMNS = (("iterations", "iterations", "{:.0f}"), ("accept_length", "accept length", "{:.2f}"),
           ("draft_ms_per_token", "draft ms / token", "{:.3f}"), ("token_share", "token share", "{:.1%}"),
           ("tokens_per_s", "tokens / s", "{:.1f}"))  # fmt: skip


def arm_table(run: RunData) -> Figure | str:
    if not any("arm_table" in r for r in run.records):
        return no_field("arm_table")
    table = pool_arm_tables(run.records)
    order = {label: i for i, label in enumerate(BATCH_BUCKETS)}
    rows = [
        (arm, bucket, cell)
        for arm in sorted(table, key=lambda a: (a != "off", a))
        for bucket, cell in sorted(table[arm].items(), key=lambda kv: order.get(kv[0], len(order)))
    ]
    if not rows:
        return "arm_table is empty at every step: no decode iteration was recorded"
    fig = figure(8.0, 0.6 + 0.28 * (len(rows) + 1))
    ax = fig.add_subplot()
    ax.axis("off")
    cells = [[arm, bucket, *(fmt.format(cell[key]) for key, _, fmt in COLUMNS)] for arm, bucket, cell in rows]
    drawn = ax.table(cellText=cells, colLabels=["arm", "batch", *(label for _, label, _ in COLUMNS)],
                     loc="center", cellLoc="right")  # fmt: skip
    drawn.auto_set_font_size(False)
    drawn.set_fontsize(8)
    ax.set_title(f"tuner arms over {len(run.records)} steps")
    return fig
