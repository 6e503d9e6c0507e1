"""The charts of `slipstream report`: one function a chart, from a loaded run to a figure or a reason.

A chart function returns a matplotlib `Figure`, or a string saying why the run did not record its data;
then nothing is drawn, because an empty axis reads as "measured, and zero". `draw_all` turns each into a
`Chart` (PNG bytes, or the reason) under the name, title and caption of its `ChartSpec` in `CHARTS`.
The non-obvious choices: figures are `matplotlib.figure.Figure` objects on an Agg canvas, never pyplot,
so no global state or GUI backend is touched (this module imports matplotlib at the top; `cli/report.py`
imports it only after checking matplotlib is installed); every metrics field is read with `.get`, so an
older run's metrics.jsonl draws what it has (both in cli/report_figure.py, which every chart draws on).
The speculation charts are in cli/report_speculation.py; what each chart shows: docs/report.md.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from matplotlib.figure import Figure

from slipstream.cli.report_arms import arm_table
from slipstream.cli.report_figure import figure, no_field, png, series, steps_axis
from slipstream.cli.report_speculation import accept_position, drafter_loss, speculation
from slipstream.cli.report_tail import long_tail
from slipstream.cli.report_turns import multi_turn, turns

if TYPE_CHECKING:
    from slipstream.cli.report import RunData

PHASES = (("rollout_s", "rollout"), ("reward_s", "reward"), ("learn_s", "learn"), ("sync_s", "sync"))
PHASE_COLORS = {"rollout": "tab:blue", "reward": "tab:orange", "learn": "tab:green", "sync": "tab:red"}
BOX_STEPS = 40  # more steps than this: percentile lines instead of one box a step
JITTER_SAMPLES = 256  # more samples in a step than this: no per-sample points over its box


@dataclass(frozen=True)
class ChartSpec:
    """One chart of the report: its file stem, title, one-sentence caption, and the function drawing it."""

    name: str
    title: str
    caption: str
    draw: Callable[[RunData], Figure | str]
    # Whether the chart belongs to this run at all (None: every run). One that does not is left off the page,
    # not listed as "not recorded": a single-turn run has no turns to record.
    applies: Callable[[RunData], bool] | None = None


@dataclass(frozen=True)
class Chart:
    """One drawn chart (`png`), or one the run did not record (`missing` says why)."""

    name: str  # file stem: <name>.png
    title: str
    caption: str
    png: bytes | None = None
    missing: str | None = None


def draw_all(run: RunData) -> list[Chart]:
    """Every chart of `CHARTS` for `run`, in order."""
    charts = []
    for spec in CHARTS:
        if spec.applies is not None and not spec.applies(run):
            continue
        drawn = spec.draw(run)
        if isinstance(drawn, str):
            charts.append(Chart(spec.name, spec.title, spec.caption, missing=drawn))
        else:
            charts.append(Chart(spec.name, spec.title, spec.caption, png=png(drawn)))
    return charts


def reward(run: RunData) -> Figure | str:
    steps, rewards = series(run, "reward_mean")
    if not steps:
        return no_field("reward_mean")
    fig = figure()
    ax = fig.add_subplot()
    ax.plot(steps, rewards, "o-", label="reward (mean)")
    for key, style, label in (
        ("correct_share", "s-", "correct share (reward ≥ 1)"),
        ("nonzero_adv_share", "^:", "mixed groups (non-zero advantage)"),
    ):
        s, v = series(run, key)
        if s:
            ax.plot(s, v, style, label=label, alpha=0.8 if key == "correct_share" else 0.6)
    ax.set_ylim(bottom=min(0.0, *rewards))
    ax.set_ylabel("reward / share of samples or groups")
    ax.set_title(f"reward {rewards[0]:.3f} → {rewards[-1]:.3f} over {len(steps)} steps")
    steps_axis(ax)
    ax.legend(loc="best", fontsize="small")
    return fig


def lengths(run: RunData) -> Figure | str:
    if run.samples_missing:
        return run.samples_missing
    steps = sorted(run.lengths)
    data = [run.lengths[s] for s in steps]
    max_tokens = run.config.get("max_tokens")
    fig = figure()
    ax = fig.add_subplot()
    if len(steps) <= BOX_STEPS:
        ax.boxplot(data, positions=steps, widths=0.6, showfliers=False, manage_ticks=False)
        rng = random.Random(0)  # the same jitter every time the report is drawn
        for step, lens in zip(steps, data, strict=True):
            rewards = run.rewards.get(step, [])
            if len(lens) > JITTER_SAMPLES:
                continue
            xs = [step + rng.uniform(-0.22, 0.22) for _ in lens]
            colors = ["tab:green" if (r or 0) >= 1 else "tab:gray" for r in rewards] or "tab:gray"
            ax.scatter(xs, lens, s=9, c=colors, alpha=0.6, linewidths=0, zorder=3)
        ax.scatter([], [], s=9, c="tab:green", label="correct (reward ≥ 1)")
        ax.scatter([], [], s=9, c="tab:gray", label="other")
    else:
        for q, style in ((0.1, ":"), (0.5, "-"), (0.9, "--")):
            ax.plot(
                steps, [_quantile(d, q) for d in data], style, color="tab:blue", label=f"p{round(q * 100)}"
            )
        ax.plot(steps, [max(d) for d in data], "-", color="tab:red", alpha=0.5, label="max")
    counted = sum(len(d) for d in data)
    if isinstance(max_tokens, int):
        ax.axhline(
            max_tokens, color="tab:red", linestyle="--", linewidth=1, label=f"max_tokens = {max_tokens}"
        )
        cut = sum(1 for d in data for n in d if n >= max_tokens)
        ax.set_title(f"{counted} responses over {len(steps)} steps; {cut} reached max_tokens")
    else:
        ax.set_title(f"{counted} responses over {len(steps)} steps")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("response tokens")
    steps_axis(ax)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    return fig


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def idle(run: RunData) -> Figure | str:
    steps, idle_s = series(run, "idle_device_s")
    if not steps:
        return no_field("idle_device_s")
    reclaimed = [r.get("reclaimed_s") or 0.0 for r in run.records if r.get("idle_device_s") is not None]
    fig = figure()
    ax = fig.add_subplot()
    ax.bar([s - 0.2 for s in steps], idle_s, width=0.4, color="tab:gray", label="idle")
    ax.bar([s + 0.2 for s in steps], reclaimed, width=0.4, color="tab:green", label="reclaimed (drafter)")
    total_idle, total_back = sum(idle_s), sum(reclaimed)
    share = f" ({100 * total_back / total_idle:.0f}%)" if total_idle > 0 else ""
    ax.set_title(f"idle {total_idle:.1f} device-s, reclaimed {total_back:.1f}{share}")
    ax.set_ylabel("device-seconds")
    steps_axis(ax)
    ax.legend(loc="best", fontsize="small")
    return fig


def step_time(run: RunData) -> Figure | str:
    recs = [r for r in run.records if r.get("step_s") is not None]
    if not recs:
        return no_field("step_s")
    steps = [r["step"] for r in recs]
    fig = figure()
    ax = fig.add_subplot()
    bottom = [0.0] * len(recs)
    segments = [(label, [r.get(key) or 0.0 for r in recs], PHASE_COLORS[label]) for key, label in PHASES]
    checkpoint = [r.get("checkpoint_s") or 0.0 for r in recs]
    if any(checkpoint):
        segments.append(("checkpoint", checkpoint, "tab:brown"))
    accounted = [sum(seg[1][i] for seg in segments) for i in range(len(recs))]
    other = [max(0.0, r["step_s"] - a) for r, a in zip(recs, accounted, strict=True)]
    if any(o > 0.01 * r["step_s"] for o, r in zip(other, recs, strict=True)):
        segments.append(("other", other, "lightgray"))
    for label, values, color in segments:
        ax.bar(steps, values, bottom=bottom, color=color, width=0.8, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    total = sum(r["step_s"] for r in recs)
    roll = sum(r.get("rollout_s") or 0.0 for r in recs)
    ax.set_title(
        f"mean step {total / len(recs):.1f} s; rollout {100 * roll / total:.0f}% of the time"
        if total
        else "step time"
    )
    ax.set_ylabel("seconds")
    steps_axis(ax)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    return fig


def reward_calls(run: RunData) -> Figure | str:
    recs = [r for r in run.records if r.get("reward_terms")]
    if not any("reward_terms" in r for r in run.records):
        return no_field("reward_terms")
    if not recs:
        return "no step recorded a reward call (the verifiers sent no RewardCalls)"
    steps = [r["step"] for r in recs]
    terms = sorted(set().union(*(r["reward_terms"] for r in recs)))
    fig = figure(8.0, 6.0)
    secs_ax, batch_ax = fig.subplots(2, 1, sharex=True)
    bottom = [0.0] * len(recs)
    for term in terms:
        cells = [r["reward_terms"].get(term) or {} for r in recs]
        secs = [c.get("seconds", 0.0) for c in cells]
        secs_ax.bar(steps, secs, bottom=bottom, width=0.8, label=term)
        bottom = [b + v for b, v in zip(bottom, secs, strict=True)]
        (line,) = batch_ax.plot(
            steps, [c.get("batch_mean", math.nan) for c in cells], "o-", label=f"{term} mean"
        )
        maxes = [c.get("batch_max", math.nan) for c in cells]
        batch_ax.plot(steps, maxes, "v:", color=line.get_color(), label=f"{term} max")
    secs_ax.set_ylabel("reward call seconds")
    secs_ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    batch_ax.set_ylabel("samples per call")
    batch_ax.set_ylim(bottom=0)
    batch_ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    steps_axis(secs_ax)
    steps_axis(batch_ax)
    secs_ax.set_xlabel("")  # the shared axis is labelled once, below
    total, step_s = sum(bottom), sum(r.get("step_s") or 0.0 for r in recs)
    share = f", {total / step_s:.0%} of step time" if step_s else ""
    secs_ax.set_title(f"reward calls {total:.1f} s over {len(recs)} steps{share}")
    return fig


def sync(run: RunData) -> Figure | str:
    steps, secs = series(run, "sync_s")
    if not steps:
        return no_field("sync_s")
    fig = figure()
    ax = fig.add_subplot()
    ax.bar(steps, secs, width=0.6, color="tab:red", alpha=0.8, label="sync seconds")
    ax.set_ylabel("seconds")
    steps_axis(ax)
    text = f"weight sync: mean {sum(secs) / len(secs):.2f} s a step"
    byte_steps, sizes = series(run, "sync_bytes")
    if any(sizes):  # 0: not measured
        twin = ax.twinx()
        twin.plot(byte_steps, [b / 2**20 for b in sizes], "ko-", label="MiB pushed")
        twin.set_ylabel("MiB pushed")
        twin.set_ylim(bottom=0)
        mib = sum(sizes) / len(sizes) / 2**20
        text += f", {mib:.1f} MiB"
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize="small")
    else:
        text += " (bytes not recorded in this run)"
    ax.set_title(text)
    return fig


def mismatch(run: RunData) -> Figure | str:
    steps, values = series(run, "mismatch_logp_abs_max")
    if not steps:
        return no_field("mismatch_logp_abs_max")
    fig = figure()
    ax = fig.add_subplot()
    positive = [v for v in values if v > 0]
    # Whole decades around the data, at least up to 1e-2: steady fp32 noise reads as a flat line, not
    # as a swing magnified across one decade, and a jump towards 1 still fits.
    lo = 10.0 ** (math.floor(math.log10(min(positive))) - 1) if positive else 1e-8
    hi = max(10.0 ** (math.ceil(math.log10(max(positive))) + 1), 1e-2) if positive else 1e-2
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    gapped = [v if v > 0 else math.nan for v in values]
    ax.plot(steps, gapped, "o-", color="tab:blue", label="max |Δ log-prob|")
    zeros = [s for s, v in zip(steps, values, strict=True) if v <= 0]
    if zeros:
        ax.plot(zeros, [lo] * len(zeros), "v", color="tab:green", clip_on=False, label="exactly 0")
    ax.set_ylabel("max |Δ log-prob| (nats)")
    worst = max(values)
    ax.set_title(f"train–rollout log-prob mismatch: worst {worst:.2e} nats")
    steps_axis(ax)
    ax.legend(loc="best", fontsize="small")
    return fig


CHARTS: tuple[ChartSpec, ...] = (
    ChartSpec(
        "reward",
        "Reward and correct share",
        "Mean reward over valid samples, share of samples with reward ≥ 1, and share of groups whose "
        "rewards differ (they carry the gradient).",
        reward,
    ),
    ChartSpec(
        "lengths",
        "Response lengths",
        "Response length in tokens of every sample of a step (boxes: quartiles, whiskers: 1.5 IQR); "
        "points coloured by correctness; the dashed line is max_tokens, where responses are cut off.",
        lengths,
    ),
    ChartSpec(
        "turns",
        "Turns per sample and environment wait",
        "Multi-turn runs only. Top: policy turns per sample each step, mean and most, over the samples by "
        "their turns (the long tail in turns). Bottom: the wait for the environment's answers, a sample's "
        "mean and the most one sample waited, under the rollout's wall time.",
        turns,
        applies=multi_turn,
    ),
    ChartSpec(
        "speculation",
        "Accept length and tuner arms per batch size",
        "Top: tokens kept per sequence per target pass, per batch-size bucket over the iterations that "
        "speculated there, and over all iterations (1.0 = no gain). Bottom: the share of decode "
        "iterations each tuner arm ran.",
        speculation,
    ),
    ChartSpec(
        "accept_position",
        "Acceptance per draft position",
        "Share of speculated sequence-iterations whose draft token at position i was accepted. A stale or "
        "broken drafter shows here first: every position falls towards 0 (accept length towards 1.0) with "
        "no error anywhere.",
        accept_position,
    ),
    ChartSpec(
        "arms",
        "What each arm bought and cost",
        "Per tuner arm and batch-size bucket over the run: decode iterations, accept length (tokens per "
        "sequence per target pass), drafting time per drafted token, the arm's share of decoded tokens, and "
        "committed tokens per decode second.",
        arm_table,
    ),
    ChartSpec(
        "drafter_loss",
        "Drafter loss",
        "The drafter's online training loss per step; steps where it did not train are gaps.",
        drafter_loss,
    ),
    ChartSpec(
        "idle",
        "Idle and reclaimed device-seconds",
        "Device-seconds rollout devices sat idle in each step's rollout (waiting for the long tail), and "
        "the part of it leased to drafter training.",
        idle,
    ),
    ChartSpec(
        "step_time",
        "Step time split",
        "Each step's wall time split into rollout, reward (last completion to last reward), learn and "
        "weight sync, plus checkpoint writes and what no phase accounts for.",
        step_time,
    ),
    ChartSpec(
        "reward_calls",
        "Reward time and batch sizes per term",
        "Top: seconds each reward term's calls took in a step, summed over workers (calls in parallel add "
        "up; they overlap the rollout). Bottom: samples per call, mean and largest: 1 for a per-completion "
        "term, more where the verifier batched.",
        reward_calls,
    ),
    ChartSpec(
        "sync",
        "Weight sync",
        "Seconds from the learner's weight push until every rollout acknowledged the new version, and the "
        "bytes pushed where the run recorded them.",
        sync,
    ),
    ChartSpec(
        "mismatch",
        "Train–rollout log-prob mismatch",
        "Largest |log-prob| difference over a step's tokens between the learner's forward pass and what "
        "the rollout sampled with (log scale). A steady level is numerical noise (kernels, dtype); a jump "
        "of orders of magnitude means the two policies differ (a missed or stale weight sync).",
        mismatch,
    ),
    ChartSpec(
        "long_tail",
        "The long tail of one rollout",
        "One step's rollout: every sample as a line from its admission to its finish, per rollout actor "
        "(colour: response tokens). The gap between most samples finishing and the last one is the long "
        "tail, when devices idle unless leased to the drafter.",
        long_tail,
    ),
)
