"""Span recording and reading (runtime/spans.py): batched files, clock offsets, step filters, torn lines."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from slipstream.runtime.spans import SpanRecorder, read_spans, span_path


def test_spans_round_trip_with_fields_steps_and_the_clock_offset(tmp_path: Path) -> None:
    rec = SpanRecorder(span_path(tmp_path, "rollout-1"), actor="rollout-1", role="rollout", rank=1)
    rec.add("early", 1_000, 50, 0, batch=4)
    rec.set_clock_offset(10_000)
    with rec.span("decode", step=1, arm="eagle:d3") as fields:
        fields["accepted"] = 3
        time.sleep(0.001)
    rec.instant("preempt", step=1)
    rec.close()
    spans = read_spans(tmp_path)
    assert [s.name for s in spans] == ["early", "decode", "preempt"]
    early, decode, preempt = spans
    assert (early.start_ns, early.dur_ns, early.step, early.args) == (1_000, 50, 0, {"batch": 4})
    assert (decode.actor, decode.role, decode.rank) == ("rollout-1", "rollout", 1)
    assert decode.args == {"arm": "eagle:d3", "accepted": 3}
    assert decode.dur_ns >= 1_000_000
    # Spans after the clock line read on the coordinator's clock: monotonic + offset.
    assert decode.start_ns > time.monotonic_ns() - 10**9 + 10_000
    assert preempt.dur_ns == 0 and preempt.start_ns >= decode.end_ns


def test_a_recorder_without_a_path_writes_nothing(tmp_path: Path) -> None:
    rec = SpanRecorder(span_path(None, "x"), actor="x", role="x")
    with rec.span("work"):
        pass
    rec.close()
    assert not (tmp_path / "spans").exists()
    with pytest.raises(FileNotFoundError, match="no spans"):
        read_spans(tmp_path)


def test_flushes_in_batches_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = span_path(tmp_path, "learner-0")
    assert path is not None
    rec = SpanRecorder(path, actor="learner-0", role="learner", rank=0, flush_every=3, flush_s=3600)
    rec.add("a", 1, 1)
    assert not path.exists()  # below the batch size nothing is written yet
    rec.add("b", 2, 1)
    assert path.read_bytes().count(b"\n") == 3  # meta + 2 spans
    rec.add("c", 3, 1)
    rec.close()
    with open(path, "ab") as f:
        f.write(b'{"name":"torn","ts":4')  # a process killed mid-write
    assert [s.name for s in read_spans(tmp_path)] == ["a", "b", "c"]
    with open(path, "ab") as f:
        f.write(b'\n{"name":"d","ts":5,"dur":1}\n')
    with pytest.raises(ValueError, match="not a span line"):
        read_spans(tmp_path)


def test_the_step_filter_keeps_unstepped_spans_inside_the_window(tmp_path: Path) -> None:
    rec = SpanRecorder(span_path(tmp_path, "coordinator"), actor="coordinator", role="coordinator")
    rec.add("step", 0, 100, 0)
    rec.add("step", 100, 100, 1)
    rec.add("step", 200, 100, 2)
    rec.add("inside", 150, 10)  # no step, in step 1's window
    rec.add("outside", 250, 10)
    rec.close()
    kept = read_spans(tmp_path, steps=(1, 1))
    assert [(s.name, s.step) for s in kept] == [("step", 1), ("inside", None)]
    assert read_spans(tmp_path, steps=(7, 9)) == []
