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
    events: list[dict[str, Any]] = []
    if not spans:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    t0 = min(s.start_ns for s in spans)

    def us(ns: int) -> float:
        return round((ns - t0) / 1e3, 3)

    actors = sorted(
        {(s.role, s.rank, s.actor) for s in spans}, key=lambda k: (_ROLE_ORDER.get(k[0], 9), k[1] or 0)
    )
    pid_of = {actor: i + 1 for i, (_, _, actor) in enumerate(actors)}
    for (_, _, actor), pid in zip(actors, pid_of.values(), strict=True):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": actor}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "work"}})

    by_actor: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_actor[s.actor].append(s)
    devices: dict[str, int] = {}
    pushes: dict[int, tuple[int, Span]] = {}  # version -> (pid, push span)
    applies: list[tuple[int, int, Span]] = []  # (pid, tid, apply span)
    for actor, mine in by_actor.items():
        pid = pid_of[actor]
        tid_of_sample: dict[int, int] = {}  # id(span) -> its lane, for the kinds in _PACKED
        for kind, label in _PACKED.items():
            packed = [s for s in mine if s.name == kind]
            first = len(set(tid_of_sample.values())) + 1  # after the lanes of the kinds before it
            lanes = _lanes(packed)
            tid_of_sample.update({id(s): first + lane for s, lane in zip(packed, lanes, strict=True)})
            for lane in sorted(set(lanes)):
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pid,
                        "tid": first + lane,
                        "args": {"name": f"{label} {lane + 1}"},
                    }
                )
        for s in mine:
            if s.name in ("device_idle", "lease") and s.args.get("device"):
                device = str(s.args["device"])
                devices.setdefault(device, len(devices))
                tid = 2 * devices[device] + (0 if s.name == "device_idle" else 1)
                events.append(_event(s, _DEVICES_PID, tid, us))
                if s.name == "device_idle":
                    continue  # the coordinator's own track needs no copy of the device windows
            tid = tid_of_sample.get(id(s), 0)
            events.append(_event(s, pid, tid, us))
            if s.name == "push" and "version" in s.args:
                pushes[int(s.args["version"])] = (pid, s)
            elif s.name == "apply_weights" and "version" in s.args:
                applies.append((pid, tid, s))
    if devices:
        events.append(
            {"ph": "M", "name": "process_name", "pid": _DEVICES_PID, "tid": 0, "args": {"name": "devices"}}
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": _DEVICES_PID,
                "tid": 0,
                "args": {"sort_index": 0},
            }
        )
        for device, i in devices.items():
            for tid, what in ((2 * i, "idle"), (2 * i + 1, "leased to a drafter")):
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": _DEVICES_PID,
                        "tid": tid,
                        "args": {"name": f"{device} {what}"},
                    }
                )
    flow = 0
    for pid, tid, apply in applies:
        push = pushes.get(int(apply.args["version"]))
        if push is None:
            continue
        flow += 1
        ppid, pspan = push
        name = f"weights v{apply.args['version']}"
        events.append(
            {
                "ph": "s",
                "id": flow,
                "name": name,
                "cat": "sync",
                "pid": ppid,
                "tid": 0,
                "ts": us(pspan.start_ns),
            }
        )
        # Ends inside the apply span ("bp": "e" binds it to the enclosing slice).
        end = max(apply.start_ns, pspan.start_ns)
        events.append(
            {
                "ph": "f",
                "bp": "e",
                "id": flow,
                "name": name,
                "cat": "sync",
                "pid": pid,
                "tid": tid,
                "ts": us(end),
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


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
