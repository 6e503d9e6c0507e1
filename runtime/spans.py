"""Spans: what each process spent its time on, for latency analysis (`slipstream trace`, `report`).

A span is (name, start, duration, step, fields) for work that costs time: a decode iteration, a reward
call, a drafter step, a learner micro-batch, a weight push. Each process appends its spans to
RUN/spans/<actor>.jsonl (a `meta` line naming the process, then a line a span). Recording costs a clock
read and a list append; lines are written in batches (`flush_every` spans, `flush_s` seconds, on close).
A recorder with no path is a no-op. Times are `time.monotonic_ns()`: one clock per host; across hosts
the actor records the offset measured at the handshake as a `clock` line, which `read_spans` adds. Flows
(a weight push reaching a rollout) are joined by the spans' shared `version` field, not ids on the wire.

    rec = SpanRecorder(run_dir / "spans" / "rollout-0.jsonl", actor="rollout-0", role="rollout", rank=0)
    with rec.span("decode", step=3, batch=16, arm="eagle:d3"):
        ...
    spans = read_spans(run_dir)          # every process's spans, on one clock, sorted by start
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

SPANS_DIR = "spans"
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True, slots=True)
class Span:
    """One recorded span, on the coordinator's clock (ns)."""

    actor: str
    role: str
    rank: int | None
    name: str
    start_ns: int
    dur_ns: int
    step: int | None = None
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.dur_ns


class SpanRecorder:
    """Collects one process's spans and appends them to its file in batches. Thread-safe."""

    def __init__(
        self,
        path: Path | None,
        *,
        actor: str,
        role: str,
        rank: int | None = None,
        flush_every: int = 512,
        flush_s: float = 2.0,
    ) -> None:
        self.enabled = path is not None
        self._path = path
        self._pending: list[bytes] = []
        self._lock = threading.Lock()
        self._flush_every, self._flush_s = flush_every, flush_s
        self._last_flush = time.monotonic()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            meta = {"kind": "meta", "actor": actor, "role": role, "rank": rank, "pid": os.getpid()}
            meta["host"] = socket.gethostname()
            self._pending.append(_encode(meta))

    def add(self, name: str, start_ns: int, dur_ns: int, step: int | None = None, **args: Any) -> None:
        """Record a span measured by the caller (`time.monotonic_ns()` start, duration in ns)."""
        if not self.enabled:
            return
        line = {"name": name, "ts": start_ns, "dur": max(0, dur_ns)}
        if step is not None:
            line["step"] = step
        if args:
            line["args"] = args
        self._pending.append(_encode(line))
        if len(self._pending) >= self._flush_every or time.monotonic() - self._last_flush > self._flush_s:
            self.flush()

    @contextlib.contextmanager
    def span(self, name: str, step: int | None = None, **args: Any) -> Iterator[dict[str, Any]]:
        """Time the block; fields added to the yielded dict inside it are recorded too."""
        if not self.enabled:
            yield {}
            return
        extra: dict[str, Any] = {}
        start = time.monotonic_ns()
        try:
            yield extra
        finally:
            self.add(name, start, time.monotonic_ns() - start, step, **args, **extra)

    def instant(self, name: str, step: int | None = None, **args: Any) -> None:
        """A zero-length marker (a preemption request, a restart)."""
        self.add(name, time.monotonic_ns(), 0, step, **args)

    def set_clock_offset(self, offset_ns: int) -> None:
        """From now on this file's spans read as `monotonic + offset_ns` on the coordinator's clock."""
        if self.enabled:
            self._pending.append(_encode({"kind": "clock", "offset_ns": int(offset_ns)}))

    def flush(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            lines, self._pending = self._pending, []
            self._last_flush = time.monotonic()
            if lines:
                assert self._path is not None
                with open(self._path, "ab") as f:
                    f.write(b"\n".join(lines) + b"\n")

    def close(self) -> None:
        self.flush()


NULL_RECORDER = SpanRecorder(None, actor="", role="")


def span_path(run_dir: Path | None, actor: str) -> Path | None:
    """Where `actor`'s spans go in `run_dir` (None: tracing off)."""
    return None if run_dir is None else Path(run_dir) / SPANS_DIR / f"{actor}.jsonl"


def read_spans(run_dir: Path, steps: tuple[int, int] | None = None) -> list[Span]:
    """Every span under RUN/spans, clock-aligned, sorted by start; `steps` = (first, last) inclusive keeps
    spans whose step is in range (spans without a step are kept when they overlap the kept ones' window).

    A torn last line (a process killed mid-write) is skipped; any other bad line raises naming the file."""
    files = sorted((Path(run_dir) / SPANS_DIR).glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{run_dir}: no spans (RUN/{SPANS_DIR}/*.jsonl): was tracing on?")
    spans: list[Span] = []
    for path in files:
        actor, role, rank, offset = path.stem, path.stem.split("-")[0], None, 0
        raw = path.read_bytes().splitlines()
        for i, line in enumerate(raw):
            if not line.strip():
                continue
            try:
                rec = _decode(line)
            except msgspec.DecodeError as e:
                if i == len(raw) - 1:
                    break
                raise ValueError(f"{path}:{i + 1}: not a span line: {e}") from None
            kind = rec.get("kind")
            if kind == "meta":
                actor, role, rank = rec.get("actor", actor), rec.get("role", role), rec.get("rank")
            elif kind == "clock":
                offset = int(rec["offset_ns"])
            else:
                spans.append(
                    Span(
                        actor=actor,
                        role=role,
                        rank=rank,
                        name=str(rec["name"]),
                        start_ns=int(rec["ts"]) + offset,
                        dur_ns=int(rec["dur"]),
                        step=rec.get("step"),
                        args=rec.get("args", {}),
                    )
                )
    spans.sort(key=lambda s: s.start_ns)
    if steps is not None:
        lo, hi = steps
        stepped = [s for s in spans if s.step is not None and lo <= s.step <= hi]
        if not stepped:
            return []
        t0, t1 = min(s.start_ns for s in stepped), max(s.end_ns for s in stepped)
        spans = [
            s
            for s in spans
            if (s.step is not None and lo <= s.step <= hi)
            or (s.step is None and s.end_ns >= t0 and s.start_ns <= t1)
        ]
    return spans
