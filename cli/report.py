"""`slipstream report RUN`: PNG charts and one self-contained HTML page about a training run.

    slipstream report runs/train-20261201-101500                 # writes RUN/report/report.html + *.png
    slipstream report RUN -o /tmp/r7 --tail-step 2                # elsewhere; the long-tail view of step 2

It reads what `slipstream train` leaves in the run directory: metrics.jsonl (one record a step),
samples/step-N.jsonl (response lengths and rewards), spans/*.jsonl (through `runtime.spans.read_spans`;
only when the run was traced), config.json and summary.json. The charts themselves are in
`cli/report_plots.py`; what each shows is in docs/report.md.

The non-obvious choices: a chart whose data the run did not record is not drawn at all (an empty axis
reads as "measured, zero"); the page says "not recorded in this run" and why. The page embeds every PNG
as a data URI, so it can be mailed or attached alone, and the same PNGs are written beside it for slides.
A torn last line of metrics.jsonl (a run still going, or killed mid-write) is skipped, so a live run can
be reported. matplotlib is an optional extra (`pip install 'slipstream[report]'`), imported only here.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from slipstream.protocols import samples_record
from slipstream.runtime.spans import SPANS_DIR, Span, read_spans

if TYPE_CHECKING:
    from slipstream.cli.report_plots import Chart

INSTALL_HINT = "pip install 'slipstream[report]'"
HTML_NAME = "report.html"


class ReportError(ValueError):
    """The run directory cannot be reported on (the message names the file)."""


class _Sample(msgspec.Struct):
    """The fields of a samples/step-N.jsonl line the report reads (the rest is skipped unparsed)."""

    token_ids: list[int]
    reward: float | None = None


@dataclass
class RunData:
    """What the charts read from one run directory."""

    run_dir: Path
    records: list[dict[str, Any]]  # metrics.jsonl, one record a step, by step
    config: dict[str, Any]
    summary: dict[str, Any] | None
    mode: str  # "slipstream", "baseline", or "?"
    lengths: dict[int, list[int]] = field(default_factory=dict)  # step -> response tokens of each sample
    rewards: dict[int, list[float | None]] = field(default_factory=dict)  # aligned with lengths
    samples_missing: str | None = None
    spans: list[Span] = field(default_factory=list)
    spans_missing: str | None = None
    tail_step: int | None = None  # the long-tail view's step (None: the longest rollout)


@dataclass(frozen=True)
class Report:
    html: Path
    charts: list[Chart]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The `report` subcommand on `slipstream`'s subparsers."""
    p = subparsers.add_parser(
        "report",
        help="draw a run's charts: PNGs and one self-contained HTML page",
        description="Charts of a `slipstream train` run directory (docs/report.md): reward, response "
        "lengths, accept length and tuner arms per batch size, idle/reclaimed device time, step-time "
        "split, reward time and batch sizes per term, weight sync, log-prob mismatch, drafter loss and acceptance per draft position when "
        "recorded, turns per sample and environment wait in a multi-turn run, and one step's long tail "
        "from the rollout's spans. Exit 2 on a missing or empty "
        "metrics.jsonl.",
    )
    p.add_argument("run", type=Path, help="run directory (holds metrics.jsonl)")
    p.add_argument("-o", "--out", type=Path, default=None, help="output directory (default RUN/report)")
    p.add_argument(
        "--tail-step", type=int, default=None, help="the long-tail view's step (default: the longest rollout)"
    )
    return p


def run(args: argparse.Namespace) -> int:
    """`slipstream report`: 0 when the page is written, 2 on bad input or without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"slipstream report: matplotlib is not installed: {INSTALL_HINT}", file=sys.stderr)
        return 2
    try:
        report = build_report(args.run, args.out, tail_step=args.tail_step)
    except ReportError as e:
        print(f"slipstream report: {e}", file=sys.stderr)
        return 2
    drawn = [c for c in report.charts if c.png is not None]
    print(f"{report.html}  ({len(drawn)} charts)")
    for chart in report.charts:
        if chart.missing:
            print(f"  {chart.name}: not recorded in this run: {chart.missing}")
    return 0


def build_report(run_dir: Path, out: Path | None = None, *, tail_step: int | None = None) -> Report:
    """Draw every chart of `run_dir` into `out` (default RUN/report): <chart>.png and report.html."""
    from slipstream.cli import report_plots  # imports matplotlib

    data = load_run(run_dir)
    if tail_step is not None:
        known = [r["step"] for r in data.records]
        if tail_step not in known:
            raise ReportError(f"--tail-step {tail_step}: {run_dir} recorded steps {known[0]}..{known[-1]}")
        data.tail_step = tail_step
    out = Path(out) if out is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    charts = report_plots.draw_all(data)
    for chart in charts:
        png = out / f"{chart.name}.png"
        if chart.png is not None:
            png.write_bytes(chart.png)
        else:
            png.unlink(missing_ok=True)  # a stale chart from an earlier report would contradict the page
    page = out / HTML_NAME
    page.write_text(render_html(data, charts), encoding="utf-8")
    return Report(html=page, charts=charts)


def load_run(run_dir: Path) -> RunData:
    """Read a run directory; ReportError names the file when metrics.jsonl is missing, empty or bad."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: not a directory")
    records = _read_metrics(run_dir / "metrics.jsonl")
    summary = _read_json(run_dir / "summary.json")
    config = _read_json(run_dir / "config.json") or (summary or {}).get("config") or {}
    data = RunData(run_dir, records, config, summary, mode=_mode(records, config, summary))
    _read_samples(data)
    try:
        data.spans = read_spans(run_dir)
    except FileNotFoundError:
        why = "tracing was off (trace: false)" if config.get("trace") is False else "the run was not traced"
        data.spans_missing = f"RUN/{SPANS_DIR}/ holds no span files: {why}"
    except (ValueError, KeyError) as e:
        data.spans_missing = f"the span files could not be read: {e}"
    return data


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ReportError(f"{path}: no such file (is {path.parent} a `slipstream train` run directory?)")
    lines = path.read_bytes().splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    by_step: dict[int, dict[str, Any]] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == last:
                break  # a torn last line: the run is still writing, or was killed mid-write
            raise ReportError(f"{path}:{i + 1}: not a JSON record: {e}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise ReportError(f"{path}:{i + 1}: a record without an integer `step`")
        by_step[rec["step"]] = rec  # a resumed run may repeat a step: its last record counts
    if not by_step:
        raise ReportError(f"{path}: empty: the run has not finished a step yet")
    return [by_step[s] for s in sorted(by_step)]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _mode(records: list[dict[str, Any]], config: dict[str, Any], summary: dict[str, Any] | None) -> str:
    """baseline or slipstream: summary.json says (config.json is the same for both); else the tuner's arms."""
    if summary is not None and isinstance(summary.get("baseline"), bool):
        return "baseline" if summary["baseline"] else "slipstream"
    arms = set().union(*[set((r.get("arms") or {}).keys()) for r in records])
    if arms:
        return "baseline" if arms == {"off"} else "slipstream"
    configured = ((config.get("rollout") or {}).get("tuner") or {}).get("arms")
    return "baseline" if configured == ["off"] else "?"


def _read_samples(data: RunData) -> None:
    folder = data.run_dir / "samples"
    if not folder.is_dir():
        data.samples_missing = "RUN/samples/ is absent: the run kept no samples"
        return
    decode = msgspec.json.Decoder(_Sample).decode
    for rec in data.records:
        lens, rewards = [], []
        lines = [line for path in samples_record.sample_files(data.run_dir, rec["step"]) for line in
                 path.read_bytes().splitlines()]  # fmt: skip
        for line in lines:
            if not line.strip():
                continue
            try:
                sample = decode(line)
            except msgspec.DecodeError:
                continue  # a torn line: one sample fewer in the distribution, not a failed report
            lens.append(len(sample.token_ids))
            rewards.append(sample.reward)
        if lens:
            data.lengths[rec["step"]], data.rewards[rec["step"]] = lens, rewards
    if not data.lengths:
        data.samples_missing = "RUN/samples/ holds no step-N.jsonl for the recorded steps"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def header_rows(data: RunData) -> list[tuple[str, str]]:
    """The page's header table: (label, value)."""
    steps = [r["step"] for r in data.records]
    planned = data.config.get("steps")
    count = f"{len(steps)} (steps {steps[0]}–{steps[-1]})"
    if isinstance(planned, int) and planned != len(steps):
        count += f" of {planned} configured"
    total = sum(r.get("step_s") or 0.0 for r in data.records)
    first, last = data.records[0].get("reward_mean"), data.records[-1].get("reward_mean")
    reward = f"{last:.3f}" if isinstance(last, (int, float)) else "?"
    if isinstance(first, (int, float)) and len(steps) > 1:
        reward += f" (first step {first:.3f})"
    model = str(data.config.get("model", "?"))
    where = ", ".join(str(data.config[k]) for k in ("task", "device") if data.config.get(k))
    rows = [
        ("run", str(data.run_dir.resolve())),
        ("steps", count),
        ("model", model + (f" ({where})" if where else "")),
        ("mode", data.mode),
        ("total time", f"{_duration(total)} (sum of step times)"),
        ("final reward", reward),
    ]
    rows += [("reward calls", calls)] if (calls := reward_calls_row(data.records)) else []
    return rows + turns_rows(data)


def multi_turn(data: RunData) -> bool:
    """The run played episodes: its config names an environment, or a step recorded turns."""
    env = (data.config.get("environment") or {}).get("env")
    return bool(env) or any(r.get("turns_max") for r in data.records)


def turns_rows(data: RunData) -> list[tuple[str, str]]:
    """Multi-turn episodes (issue 42): turns per sample with the long tail in turns (samples by their turns,
    every step), and the environment wait: seconds a step summed over samples, its share of the samples' time
    in the rollout (their `sample` spans; traced runs), the most one sample waited. One row saying so for a
    single-turn run."""
    recs = data.records
    if not multi_turn(data):
        return [("turns per sample", "single-turn run: no environment, no episodes")]
    counts: dict[int, int] = {}
    for r in recs:
        for k, n in (r.get("turns_by_count") or {}).items():
            counts[int(k)] = counts.get(int(k), 0) + n
    top = max((r.get("turns_max") or 0 for r in recs), default=0)
    if counts:
        played = {k: n for k, n in counts.items() if k}  # 0: invalid before its first turn
        mean = sum(k * n for k, n in played.items()) / max(sum(played.values()), 1)
        tail = ", ".join(f"{k}: {n}" for k, n in sorted(counts.items()))
        turns = f"mean {mean:.2f}, max {top}; samples by turns (all steps) {tail}"
    else:
        mean = sum(r.get("turns_mean") or 0.0 for r in recs) / len(recs)
        turns = f"mean {mean:.2f}, max {top}; samples by turns: not recorded in this run (before the field)"
    rows = [("turns per sample", turns)]
    if not any("env_wait_s" in r for r in recs):
        return [*rows, ("environment wait", "not recorded in this run (before the field)")]
    wait = sum(r.get("env_wait_s") or 0.0 for r in recs)
    text = f"{wait / len(recs):.2f} s a step (summed over samples)"
    lives = sum(sp.dur_ns for sp in data.spans if sp.name == "sample") / 1e9
    waits = sum(sp.dur_ns for sp in data.spans if sp.name == "env_wait") / 1e9
    text += f", {waits / lives:.0%} of the samples' time in the rollout" if lives else ", share: needs spans"
    text += f"; at most {max(r.get('env_wait_max_s') or 0.0 for r in recs):.2f} s for one sample"
    return [*rows, ("environment wait", text)]


def reward_calls_row(records: list[dict[str, Any]]) -> str:
    """The run's reward calls: their seconds and share of the step time, then per term its seconds, calls,
    samples per call (mean, largest) and invalid samples; "" when no step recorded any."""
    terms: dict[str, list[float]] = {}  # term -> [seconds, calls, samples, largest, invalid]
    step_s = 0.0
    for rec in records:
        if not rec.get("reward_terms"):
            continue
        step_s += rec.get("step_s") or 0.0
        for name, cell in rec["reward_terms"].items():
            t = terms.setdefault(name, [0.0, 0, 0, 0, 0])
            for i, key in enumerate(("seconds", "calls", "samples")):
                t[i] += cell.get(key, 0)
            t[3] = max(t[3], cell.get("batch_max", 0))
            t[4] += cell.get("invalid", 0)
    if not terms:
        return ""
    total = sum(t[0] for t in terms.values())
    text = f"{total:.1f} s" + (f" ({total / step_s:.0%} of step time)" if step_s else "")
    for name, (secs, calls, samples, top, invalid) in sorted(terms.items()):
        mean = samples / calls if calls else 0.0
        text += f"; {name}: {secs:.1f} s, {int(calls)} calls, batch mean {mean:.1f} (max {int(top)})"
        text += f", {int(invalid)} invalid" if invalid else ""
    return text


_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table.head { border-collapse: collapse; margin-bottom: 1.5em; }
table.head th { text-align: left; padding: 2px 14px 2px 0; color: #555; font-weight: normal; }
table.head td { padding: 2px 0; font-family: ui-monospace, monospace; }
section { margin: 2em 0; }
img { max-width: 100%; border: 1px solid #ddd; }
p.caption { color: #444; margin: 0.3em 0 0.6em; }
p.missing { color: #8a5a00; background: #fff6e0; padding: 0.5em 0.8em; border-left: 3px solid #e0a000; }
a.file { font-size: small; color: #666; }
"""


def render_html(data: RunData, charts: list[Chart]) -> str:
    """The report page: header table, then each chart embedded (data URI) with a link to its PNG file."""
    esc = html.escape
    rows = "\n".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in header_rows(data))
    sections = []
    for chart in charts:
        parts = [f'<section id="{esc(chart.name)}">', f"<h2>{esc(chart.title)}</h2>"]
        parts.append(f'<p class="caption">{esc(chart.caption)}</p>')
        if chart.png is not None:
            uri = "data:image/png;base64," + base64.b64encode(chart.png).decode("ascii")
            file = f"{chart.name}.png"
            parts.append(f'<img src="{uri}" alt="{esc(chart.title)} ({esc(file)})">')
            parts.append(f'<br><a class="file" href="{esc(file)}">{esc(file)}</a>')
        else:
            parts.append(f'<p class="missing">not recorded in this run: {esc(chart.missing or "")}</p>')
        parts.append("</section>")
        sections.append("\n".join(parts))
    title = f"slipstream report: {data.run_dir.resolve().parent.name}/{data.run_dir.resolve().name}"
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f'<h1>{esc(title)}</h1>\n<table class="head">\n{rows}\n</table>\n'
        + "\n".join(sections)
        + "\n</body>\n</html>\n"
    )
