"""`bench e2e`'s memory figures: each actor's peak resident memory read back from its log's `stopped`
event, the sum, and their line in the rendered table (the whole bench runs in tests/cli/test_train.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.benchmarks import e2e

STEP = {
    "step_s": 2.0, "rollout_s": 1.0, "reward_s": 0.1, "learn_s": 0.8, "sync_s": 0.1, "tokens": 100,
    "accept_length": 1.5, "idle_device_s": 0.4, "reclaimed_s": 0.2,
}  # fmt: skip


def write_log(run_dir: Path, name: str, events: list[dict]) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs" / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_peaks_come_from_stopped_events_and_sum(tmp_path: Path) -> None:
    write_log(tmp_path, "learner-0", [
        {"role": "learner", "rank": 0, "event": "trained", "step": 0},
        {"role": "learner", "rank": 0, "event": "stopped", "handled": 3, "peak_rss_mb": 3000.5, "peak_gpu_mb": 812.0},
    ])  # fmt: skip
    # Restarted once after a clean stop: the higher peak counts. A line naming "stopped" elsewhere is no event.
    write_log(tmp_path, "rollout-1", [
        {"role": "rollout", "rank": 1, "event": "stopped", "peak_rss_mb": 900.0},
        {"role": "rollout", "rank": 1, "event": "bad_request", "error": "stopped"},
        {"role": "rollout", "rank": 1, "event": "stopped", "peak_rss_mb": 1200.0},
    ])  # fmt: skip
    write_log(tmp_path, "drafter-0", [{"role": "drafter", "rank": 0, "event": "started"}])  # killed: no stop
    assert e2e.peak_rss(tmp_path) == {"learner:0": 3000.5, "rollout:1": 1200.0}

    figures = e2e.run_figures({"steps": [STEP, STEP]}, 5.0, run_dir=tmp_path)
    assert figures.peak_rss_mb == {"learner:0": 3000.5, "rollout:1": 1200.0}
    assert figures.peak_rss_mb_total == 4200.5
    assert figures.peak_gpu_mb == {"learner:0": 812.0}  # only an actor that used CUDA says
    assert e2e.run_figures({"steps": [STEP]}, 5.0).peak_rss_mb_total == 0.0  # no run directory: no figures

    cost = e2e.LearnerCost(
        threads=1, steps=1, response_tokens=1, sequence_tokens=2, forward_s=[1.0], train_s=[3.0],
        cost_x_each=[3.0], cost_x=3.0,
    )  # fmt: skip
    result = e2e.E2EResult(
        run_dir=str(tmp_path), steps=2, slipstream=figures, baseline=figures, speedup_step=1.0,
        speedup_rollout=1.0, identical_sample_steps=2, learner=cost,
    )  # fmt: skip
    text = e2e.render(result)
    assert "slipstream peak RSS MiB: learner:0 3000, rollout:1 1200; sum 4200" in text
    assert "upper bound" in text


def test_inbound_figures_are_the_coordinators_events_per_step_without_start_up(tmp_path: Path) -> None:
    """The coordinator logs `inbound` as each step begins and at the end (rl/coordinator.py): the first
    event is start-up's, the others one step each; the figures are their means."""

    def inbound(messages: int, kinds: dict[str, list[int]]) -> dict:
        return {"event": "inbound", "messages": messages, "bytes": sum(b for _, b in kinds.values()),
                "kinds": kinds}  # fmt: skip

    write_log(tmp_path, "coordinator", [
        inbound(50, {"control.hello": [50, 5000]}),  # start-up: left out
        {"event": "step_done", "step": 0},
        inbound(14, {"rollout.completion": [12, 1200], "learner.step_stats": [2, 100]}),
        inbound(12, {"rollout.completion": [12, 1000]}),
    ])  # fmt: skip
    figures = e2e.run_figures({"steps": [STEP, STEP]}, 5.0, run_dir=tmp_path)
    assert figures.inbound_messages == 13.0 and figures.inbound_bytes == 1150.0
    assert figures.inbound_by_kind == {
        "learner.step_stats": [1.0, 50.0],
        "rollout.completion": [12.0, 1100.0],
    }
    (tmp_path / "logs" / "coordinator.jsonl").unlink()
    assert e2e.run_figures({"steps": [STEP]}, 5.0, run_dir=tmp_path).inbound_by_kind == {}


def test_two_rounds_run_a_b_b_a_and_pool_the_speedups(tmp_path: Path, monkeypatch) -> None:
    # The order is the point: whichever mode runs first in an invocation pays the host's first touches.
    # Training and the learner's cost are stubbed here; tests/cli/test_train.py runs the real bench.
    calls: list[tuple[str, bool]] = []
    step_s = iter([2.0, 1.0, 3.0, 4.0])  # S, B, then B, S

    def train(run_dir: Path, baseline: bool, turns: str | None) -> dict:
        assert turns is None  # one after the other: nothing to take turns with
        calls.append((run_dir.name, baseline))
        return {"steps": [{**STEP, "step_s": next(step_s)}]}

    monkeypatch.setattr(e2e, "_samples", lambda run_dir, step: [])
    monkeypatch.setattr(e2e, "learner_cost", lambda run_dir, steps, threads: None)
    result = e2e.run(train, tmp_path, rounds=2)
    assert calls == [("slipstream", False), ("baseline", True), ("baseline-2", True), ("slipstream-2", False)]
    assert result.speedup_step_each == [0.5, 0.75]
    assert result.speedup_step == round((1.0 + 3.0) / (2.0 + 4.0), 3) and result.rounds == 2


def test_interleaved_rounds_start_together_and_alternate_steps_in_the_rounds_order(
    tmp_path: Path, monkeypatch
) -> None:
    # Each fake run takes turns as `slipstream train --turns` does: start-up, each step, the shutdown.
    import asyncio
    import threading

    from slipstream.runtime.turns import Turns

    log: list[str] = []
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=10)  # the round's two runs are alive at once

    def train(run_dir: Path, baseline: bool, turns: str | None) -> dict:
        assert turns is not None
        both.wait()
        me = Turns.parse(turns)
        me.poll_s = 0.001

        async def loop() -> None:
            for phase in ("start", "step 0", "step 1", "stop"):
                await me.acquire()
                with lock:
                    log.append(f"{run_dir.name} {phase}")
                if phase != "stop":
                    me.release()
            me.done()

        asyncio.run(loop())
        return {"steps": [{**STEP, "step_s": 1.0 if baseline else 0.5}]}

    monkeypatch.setattr(e2e, "_samples", lambda run_dir, step: [])
    monkeypatch.setattr(e2e, "learner_cost", lambda run_dir, steps, threads: None)
    with pytest.raises(ValueError, match="interleave needs isolated runs"):
        e2e.run(train, tmp_path, interleave=True)
    result = e2e.run(train, tmp_path, rounds=2, isolated=True, interleave=True)
    phases = ["start", "step 0", "step 1", "stop"]
    first = [x for p in phases for x in (f"slipstream {p}", f"baseline {p}")]
    second = [x for p in phases for x in (f"baseline-2 {p}", f"slipstream-2 {p}")]
    assert log == first + second
    assert result.speedup_step_each == [2.0, 2.0] and result.rounds == 2


def test_an_isolated_run_counts_its_train_process_as_the_coordinator_and_not_the_bench() -> None:
    """`bench e2e` runs each `slipstream train` as a child: that child is the run's coordinator, and the
    bench's own process (its imports, what the first run left in it) is no part of the run's memory."""
    import os
    import subprocess
    import sys

    code = "import time; print('ready', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code, "train"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"  # exec'd: its argv
        assert e2e._process_label(os.getpid(), isolated=True) is None
        assert e2e._process_label(child.pid, isolated=True) == "coordinator"
        # In process (tests, a caller's own loop): this process runs the loop; a stray child is "other".
        assert e2e._process_label(os.getpid()) == "coordinator"
        assert e2e._process_label(child.pid) == "other"
    finally:
        child.kill()
        child.wait()
