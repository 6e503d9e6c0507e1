"""`slipstream train` survives a dead rollout and a dead verifier: real processes, real SIGKILLs.

A watcher kills rollout:1 while it decodes step 1, and verifier:0 and the drafter owner drafter:0 while
step 2 decodes. The run must restart all three, hand the rollout the current weights and the drafter the
policy's head, deal again exactly the samples and score requests they owed, and end with the same samples and rewards as a run without faults (reproducible mode: a
sample's tokens depend on its seed alone), each (group, sample) once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import uvloop

from slipstream.cli import train
from tests.cli.conftest import config

pytestmark = pytest.mark.timeout(600)


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


async def _kill_while_working(run_dir: Path, victim: str, watch: str, step: int) -> int:
    """SIGKILLs `victim` ("rollout-1") once rollout `watch` decodes step `step` (its step-th weight update
    applied, then a decode iteration); returns the pid killed."""
    logs = run_dir / "logs"
    while True:
        events = _events(logs / f"{watch}.jsonl")
        applied = [i for i, e in enumerate(events) if e["event"] == "weights_applied"]
        if len(applied) >= step and any(e["event"] == "tuner_decision" for e in events[applied[step - 1] :]):
            break
        await asyncio.sleep(0.01)
    pid = next(e["pid"] for e in reversed(_events(logs / f"{victim}.jsonl")) if e["event"] == "ready")
    os.kill(pid, signal.SIGKILL)
    return pid


def _samples(run_dir: Path) -> dict[tuple[int, int, int], list[int]]:
    out: dict[tuple[int, int, int], list[int]] = {}
    for step in range(3):
        for line in (run_dir / "samples" / f"step-{step}.jsonl").read_text().splitlines():
            r = json.loads(line)
            key = (step, r["group_id"], r["sample_index"])
            assert key not in out, f"{key} recorded twice"
            out[key] = r["token_ids"]
    return out


def test_a_killed_rollout_and_verifier_are_restarted_and_nothing_is_lost(
    tiny_chat: Path, tmp_path: Path
) -> None:
    cfg = config(tiny_chat, faults={"restart_backoff_s": 0.1})
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    uvloop.run(train.train(cfg, clean))

    async def run_with_kills() -> tuple[dict[str, Any], list[int]]:
        job = asyncio.create_task(train.train(cfg, faulty))
        killers = [
            asyncio.create_task(_kill_while_working(faulty, "rollout-1", "rollout-1", step=1)),
            asyncio.create_task(_kill_while_working(faulty, "verifier-0", "rollout-0", step=2)),
            asyncio.create_task(_kill_while_working(faulty, "drafter-0", "rollout-0", step=2)),
        ]
        summary = await job
        pids = [k.result() for k in killers]  # both kills happened
        return summary, pids

    summary, pids = uvloop.run(run_with_kills())
    steps = summary["steps"]
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
    assert steps[1]["restarts"] == ["rollout:1"] and steps[1]["requeued"] > 0
    assert {"verifier:0", "drafter:0"} <= set(steps[2]["restarts"])
    # The restarted drafter owner was handed the policy's head (v2), and follows it (v3).
    drafter = _events(faulty / "logs" / "drafter-0.jsonl")
    second = [i for i, e in enumerate(drafter) if e["event"] == "ready"][1]
    assert [e["version"] for e in drafter[second:] if e["event"] == "head_synced"] == [2, 3]
    # The restarted rollout was handed the current policy (v1), re-hashed, before it decoded again.
    events = _events(faulty / "logs" / "rollout-1.jsonl")
    readies = [i for i, e in enumerate(events) if e["event"] == "ready"]
    assert len(readies) == 2 and events[readies[1]]["pid"] != pids[0]
    after = events[readies[1] :]
    applied = [e["version"] for e in after if e["event"] == "weights_applied" and e["verified"]]
    assert applied[:1] == [1]
    first_decode = next(i for i, e in enumerate(after) if e["event"] == "tuner_decision")
    assert any(e["event"] == "weights_applied" for e in after[:first_decode])
    # Nothing lost, nothing twice, and the same tokens and rewards as without faults.
    assert _samples(faulty) == _samples(clean)
    clean_steps = json.loads((clean / "summary.json").read_text())["steps"]
    assert [s["reward_mean"] for s in steps] == [s["reward_mean"] for s in clean_steps]
    assert all(s["invalid"] == 0 for s in steps)
