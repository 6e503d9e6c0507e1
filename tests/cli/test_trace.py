"""`slipstream trace`: Chrome trace event JSON from a run's spans (cli/trace.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slipstream.cli.trace import _lanes, chrome_trace, run
from slipstream.runtime.spans import Span, SpanRecorder, read_spans, span_path


def check_chrome_trace(trace: dict) -> None:
    """What Perfetto and chrome://tracing need: every event has ph/ts/pid/tid (metadata: ph/pid/name),
    complete events a non-negative dur, flows a start before their end, and every pid a process name."""
    events = trace["traceEvents"]
    named = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    flows: dict[int, list[dict]] = {}
    for e in events:
        assert {"ph", "pid", "name"} <= e.keys(), e
        if e["ph"] == "M":
            continue
        assert {"ts", "tid"} <= e.keys(), e
        assert e["pid"] in named, f"pid {e['pid']} has no process_name"
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
        elif e["ph"] in ("s", "f"):
            flows.setdefault(e["id"], []).append(e)
        else:
            assert e["ph"] in ("i", "B", "E"), e
    for pair in flows.values():
        assert [e["ph"] for e in pair] == ["s", "f"] and pair[0]["ts"] <= pair[1]["ts"]


def _run_dir(tmp_path: Path) -> Path:
    def rec(actor: str, role: str, rank: int | None) -> SpanRecorder:
        return SpanRecorder(span_path(tmp_path, actor), actor=actor, role=role, rank=rank)

    coord, learner = rec("coordinator", "coordinator", None), rec("learner-0", "learner", 0)
    rollouts = [rec(f"rollout-{r}", "rollout", r) for r in (0, 1)]
    drafter = rec("drafter-0", "drafter", 0)
    verifier = rec("verifier-0", "verifier", 0)
    coord.add("rollout", 0, 1000, 0)
    for r, ro in enumerate(rollouts):
        ro.add("iteration", 10, 100, 0, batch=2)
        ro.add("sample", 0, 500 + 400 * r, 0, group=r, index=0)
        ro.add("sample", 0, 300, 0, group=r, index=1)
        ro.add("sample", 350, 100, 0, group=r, index=2)  # fits on the second sample's lane
        ro.add("apply_weights", 2100, 50, 0, version=1)
    coord.add("device_idle", 500, 500, 0, device="rollout-0", lent_to="drafter-0")
    drafter.add("lease", 510, 495, 0, device="rollout-0", lease_id=1)
    learner.add("push", 2000, 200, 0, version=1, bytes=10)
    # Two workers' calls at once (a batch of 3 and of 1), then one killed at its deadline; a sample's reward.
    verifier.add("reward_batch", 600, 300, 0, term="judge", size=3, invalid=0)
    verifier.add("reward_batch", 650, 350, 0, term="judge", size=1, invalid=0)
    verifier.add("reward_batch", 950, 400, 0, term="judge", size=2, invalid=2, killed="timeout")
    verifier.add("reward", 600, 310, 0, group=0, index=0, ok=True)
    for r in (coord, learner, drafter, verifier, *rollouts):
        r.close()
    return tmp_path


def test_every_process_is_named_samples_pack_into_lanes_and_pushes_flow_to_each_rollout(
    tmp_path: Path,
) -> None:
    trace = chrome_trace(read_spans(_run_dir(tmp_path)))
    check_chrome_trace(trace)
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {
        "coordinator",
        "learner-0",
        "rollout-0",
        "rollout-1",
        "drafter-0",
        "verifier-0",
        "devices",
    }
    pid = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    lanes = sorted(e["tid"] for e in events if e.get("name") == "sample" and e["pid"] == pid["rollout-0"])
    assert lanes == [1, 2, 2]  # three samples, two of them in sequence on one lane
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert sorted((e["ph"], e["pid"]) for e in flows) == sorted(
        [("s", pid["learner-0"]), ("s", pid["learner-0"]), ("f", pid["rollout-0"]), ("f", pid["rollout-1"])]
    )
    device = [e for e in events if e["pid"] == pid["devices"] and e["ph"] == "X"]
    assert sorted(e["name"] for e in device) == ["device_idle", "lease"]
    assert len({e["tid"] for e in device}) == 2  # idle and leased on their own lanes: they overlap
    # Reward calls: each a span with its term, size and seconds, on lanes of their own (two workers overlap).
    lanes_named = {
        e["tid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid["verifier-0"]
    }
    calls = [e for e in events if e.get("name") == "reward_batch"]
    assert [
        (e["args"]["size"], e["dur"], lanes_named[e["tid"]]) for e in sorted(calls, key=lambda e: e["ts"])
    ] == [
        (3, 0.3, "reward calls 1"),
        (1, 0.35, "reward calls 2"),
        (2, 0.4, "reward calls 1"),  # the first call had ended, the second not: the first lane again
    ]
    assert all(e["args"]["term"] == "judge" and e["args"]["step"] == 0 for e in calls)
    assert calls[-1]["args"]["killed"] == "timeout" and calls[-1]["args"]["invalid"] == 2
    (reward,) = [e for e in events if e.get("name") == "reward"]
    assert reward["tid"] == 0  # the per-sample span stays on the work lane


def test_lanes_are_the_fewest_without_overlap() -> None:
    def span(a: int, b: int) -> Span:
        return Span(actor="r", role="rollout", rank=0, name="sample", start_ns=a, dur_ns=b - a)

    spans = [span(0, 10), span(0, 5), span(5, 8), span(6, 20), span(10, 12)]
    assert _lanes(spans) == [0, 1, 1, 2, 1]  # the lane that frees first is reused


def test_the_command_writes_the_file_and_names_a_bad_range(tmp_path: Path, capsys) -> None:
    run_dir = _run_dir(tmp_path)
    out = tmp_path / "t.json"
    assert run(argparse.Namespace(run=run_dir, out=out, steps="0:0")) == 0
    check_chrome_trace(json.loads(out.read_text()))
    assert run(argparse.Namespace(run=run_dir, out=out, steps="x")) == 2
    assert "--steps" in capsys.readouterr().out
    assert run(argparse.Namespace(run=tmp_path / "nope", out=out, steps=None)) == 2
