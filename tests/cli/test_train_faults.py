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


def _samples(run_dir: Path, steps: int = 3) -> dict[tuple[int, int, int], list[int]]:
    out: dict[tuple[int, int, int], list[int]] = {}
    for step in range(steps):
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


async def _kill_after_steps(run_dir: Path, victim: str, steps: int) -> int:
    """SIGKILLs `victim` once `steps` steps are recorded in metrics.jsonl (the next step is rolling out)."""
    metrics = run_dir / "metrics.jsonl"
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < steps:
        await asyncio.sleep(0.01)
    pid = next(
        e["pid"] for e in reversed(_events(run_dir / "logs" / f"{victim}.jsonl")) if e["event"] == "ready"
    )
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_killed_learner_restarts_from_its_checkpoint_and_replays_to_the_same_weights(
    tiny_chat: Path, tmp_path: Path
) -> None:
    import torch

    cfg = config(tiny_chat, steps=4, checkpoint_every=2, faults={"restart_backoff_s": 0.1})
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    uvloop.run(train.train(cfg, clean))

    async def run_with_kill() -> dict[str, Any]:
        job = asyncio.create_task(train.train(cfg, faulty))
        killer = asyncio.create_task(_kill_after_steps(faulty, "learner-0", steps=3))
        summary = await job
        killer.result()
        return summary

    steps = uvloop.run(run_with_kill())["steps"]
    assert [s["policy_version"] for s in steps] == [1, 2, 3, 4]
    assert "learner:0" in steps[3]["restarts"]
    events = _events(faulty / "logs" / "learner-0.jsonl")
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [e["version"] for e in loaded] == [2]  # the step-2 checkpoint, then step 2 replayed, then step 3
    trained = [e["step"] for e in events if e["event"] == "trained"]
    assert trained == [0, 1, 2, 2, 3]
    # The replay reproduced the lost step: the same final weights as without faults. Within 1e-5, not bitwise:
    # once in ~10 runs the replayed step differed in the last bits (cause not found; one lost step at lr 1e-3
    # moves weights by ~1e-3, so a skipped or wrong replay still fails).
    final = [
        torch.load(run / "checkpoints" / "step-4" / "learner.pt", weights_only=True)
        for run in (clean, faulty)
    ]
    assert _samples(faulty, 4) == _samples(clean, 4)
    for name, tensor in final[0]["model"].items():
        torch.testing.assert_close(final[1]["model"][name], tensor, rtol=0, atol=1e-5, msg=name)
