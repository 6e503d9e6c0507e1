"""`slipstream trace RUN`: a run's spans as Chrome trace event JSON (open it in Perfetto or chrome://tracing).

One process track per actor (named by role and rank, the coordinator first), with its spans on thread
lanes: decode iterations, learner micro-batches, per-sample rewards and drafter steps on lane 0; spans
that overlap by nature, the rollouts' per-sample spans and their episodes' `env_wait`s (a turn sent to
its environment until the answer) and the verifier's `reward_batch` calls (one per worker at once), each
packed onto as few further lanes as keep each lane free of overlaps (the long tail: the last lanes' bars).
A "devices" process has two lanes per rollout device: when it was idle, and when a drafter held it. A
weight push is a flow arrow from the learner's `push` span to each rollout's `apply_weights` span of the
same version. Times are microseconds from the first span kept, on the coordinator's clock (runtime/spans.py
aligns them).

    slipstream trace runs/demo -o trace.json --steps 2:3
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.runtime.spans import Span, read_spans

__all__ = ["add_parser", "chrome_trace", "run"]

_ROLE_ORDER = {"coordinator": 0, "learner": 1, "rollout": 2, "verifier": 3, "drafter": 4}
_DEVICES_PID = 1000
# span name -> its lanes' name: the kinds whose spans overlap by nature, each packed onto lanes of its own
_PACKED = {"sample": "samples", "env_wait": "environment waits", "reward_batch": "reward calls"}


def _parse_steps(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        a, _, b = text.partition(":")
        lo, hi = int(a) if a else 0, int(b) if b else 1 << 30
    except ValueError:
        raise ValueError(
            f"--steps: expected A:B (inclusive step numbers, either may be empty), got {text!r}"
        ) from None
    if lo > hi:
        raise ValueError(f"--steps: {lo} > {hi}")
    return lo, hi


def _lanes(spans: list[Span]) -> list[int]:
    """Interval partitioning: a lane per span (spans sorted by start), as few lanes as keep each free of
    overlaps."""
    free: list[tuple[int, int]] = []  # (end_ns, lane)
    lanes: list[int] = []
    count = 0
    for s in spans:
        if free and free[0][0] <= s.start_ns:
            _, lane = heapq.heappop(free)
        else:
            lane, count = count, count + 1
        lanes.append(lane)
        heapq.heappush(free, (s.end_ns, lane))
    return lanes


def chrome_trace(spans: list[Span]) -> dict[str, Any]:
    """The trace event JSON object (`traceEvents` plus `displayTimeUnit`) for `spans`."""
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    trace = _Trace(t0=min(s.start_ns for s in spans))
    pid_of = trace.add_processes(spans)
    by_actor: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_actor[s.actor].append(s)
    for actor, mine in by_actor.items():
        trace.add_actor(pid_of[actor], mine)
    trace.add_devices()
    trace.add_weight_flows()
    return {"traceEvents": trace.events, "displayTimeUnit": "ms"}


def _meta(pid: int, tid: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """A metadata event: a process's or a lane's name, or a process's sort index."""
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}


@dataclass
class _Trace:
    """The events of one trace as they are built, and what later parts need from earlier ones."""

    t0: int  # the first span's start: time zero
    events: list[dict[str, Any]] = field(default_factory=list)
    devices: dict[str, int] = field(default_factory=dict)  # device -> its index on the devices track
    pushes: dict[int, tuple[int, Span]] = field(default_factory=dict)  # version -> (pid, push span)
    applies: list[tuple[int, int, Span]] = field(default_factory=list)  # (pid, tid, apply span)

    def us(self, ns: int) -> float:
        """Microseconds since the first span."""
        return round((ns - self.t0) / 1e3, 3)

    def add_processes(self, spans: list[Span]) -> dict[str, int]:
        """Names a process track per actor, ordered by role then rank: each actor's pid."""
        actors = sorted(
            {(s.role, s.rank, s.actor) for s in spans}, key=lambda k: (_ROLE_ORDER.get(k[0], 9), k[1] or 0)
        )
        pid_of = {actor: i + 1 for i, (_, _, actor) in enumerate(actors)}
        for (_, _, actor), pid in zip(actors, pid_of.values(), strict=True):
            self.events.append(_meta(pid, 0, "process_name", {"name": actor}))
            self.events.append(_meta(pid, 0, "process_sort_index", {"sort_index": pid}))
            self.events.append(_meta(pid, 0, "thread_name", {"name": "work"}))
        return pid_of

    def add_actor(self, pid: int, mine: list[Span]) -> None:
        """One actor's spans on its lanes, its device windows on the devices track; notes pushes and applies."""
        tid_of_span = self._pack(pid, mine)
        for s in mine:
            if s.name in ("device_idle", "lease") and s.args.get("device"):
                device = str(s.args["device"])
                self.devices.setdefault(device, len(self.devices))
                tid = 2 * self.devices[device] + (0 if s.name == "device_idle" else 1)
                self.events.append(_event(s, _DEVICES_PID, tid, self.us))
                if s.name == "device_idle":
                    continue  # the coordinator's own track needs no copy of the device windows
            tid = tid_of_span.get(id(s), 0)
            self.events.append(_event(s, pid, tid, self.us))
            if s.name == "push" and "version" in s.args:
                self.pushes[int(s.args["version"])] = (pid, s)
            elif s.name == "apply_weights" and "version" in s.args:
                self.applies.append((pid, tid, s))

    def _pack(self, pid: int, mine: list[Span]) -> dict[int, int]:
        """Names the lanes of the kinds in _PACKED after lane 0, kind after kind: id(span) -> its lane."""
        tid_of_span: dict[int, int] = {}
        for kind, label in _PACKED.items():
            packed = [s for s in mine if s.name == kind]
            first = len(set(tid_of_span.values())) + 1  # after the lanes of the kinds before it
            lanes = _lanes(packed)
            tid_of_span.update({id(s): first + lane for s, lane in zip(packed, lanes, strict=True)})
            for lane in sorted(set(lanes)):
                self.events.append(_meta(pid, first + lane, "thread_name", {"name": f"{label} {lane + 1}"}))
        return tid_of_span

    def add_devices(self) -> None:
        """Names the devices track and its two lanes per device (idle, leased), where any device was seen."""
        if not self.devices:
            return
        self.events.append(_meta(_DEVICES_PID, 0, "process_name", {"name": "devices"}))
        self.events.append(_meta(_DEVICES_PID, 0, "process_sort_index", {"sort_index": 0}))
        for device, i in self.devices.items():
            for tid, what in ((2 * i, "idle"), (2 * i + 1, "leased to a drafter")):
                self.events.append(_meta(_DEVICES_PID, tid, "thread_name", {"name": f"{device} {what}"}))

    def add_weight_flows(self) -> None:
        """A flow arrow from each push to every apply of the same version."""
        flow = 0
        for pid, tid, apply in self.applies:
            push = self.pushes.get(int(apply.args["version"]))
            if push is None:
                continue
            flow += 1
            ppid, pspan = push
            name = f"weights v{apply.args['version']}"
            self.events.append(
                {
                    "ph": "s",
                    "id": flow,
                    "name": name,
                    "cat": "sync",
                    "pid": ppid,
                    "tid": 0,
                    "ts": self.us(pspan.start_ns),
                }
            )
            # Ends inside the apply span ("bp": "e" binds it to the enclosing slice).
            end = max(apply.start_ns, pspan.start_ns)
            self.events.append(
                {
                    "ph": "f",
                    "bp": "e",
                    "id": flow,
                    "name": name,
                    "cat": "sync",
                    "pid": pid,
                    "tid": tid,
                    "ts": self.us(end),
                }
            )


def _event(s: Span, pid: int, tid: int, us: Any) -> dict[str, Any]:
    args = dict(s.args)
    if s.step is not None:
        args["step"] = s.step
    if s.dur_ns == 0:
        return {
            "ph": "i",
            "s": "t",
            "name": s.name,
            "cat": s.role,
            "pid": pid,
            "tid": tid,
            "ts": us(s.start_ns),
            "args": args,
        }
    return {
        "ph": "X",
        "name": s.name,
        "cat": s.role,
        "pid": pid,
        "tid": tid,
        "ts": us(s.start_ns),
        "dur": round(s.dur_ns / 1e3, 3),
        "args": args,
    }


def add_parser(sub: Any) -> None:
    s = sub.add_parser("trace", help="write a run's spans as Chrome trace JSON (Perfetto, chrome://tracing)")
    s.add_argument("run", type=Path, help="a run directory (traced: `trace: true`, the default)")
    s.add_argument("-o", "--out", type=Path, default=None, help="output file (default RUN/trace.json)")
    s.add_argument("--steps", default=None, help="A:B, inclusive step range (default: every step)")


def run(args: argparse.Namespace) -> int:
    try:
        steps = _parse_steps(args.steps)
        spans = read_spans(args.run, steps)
    except (FileNotFoundError, ValueError) as e:
        print(f"slipstream trace: {e}")
        return 2
    if not spans:
        print(f"slipstream trace: no spans in steps {args.steps} of {args.run}")
        return 2
    out = args.out or Path(args.run) / "trace.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    trace = chrome_trace(spans)
    out.write_text(json.dumps(trace, separators=(",", ":")))
    actors = len({s.actor for s in spans})
    print(
        f"{out}: {len(trace['traceEvents'])} events from {actors} processes (open in https://ui.perfetto.dev)"
    )
    return 0
