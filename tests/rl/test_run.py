"""The run's learner recovery (rl/run.py): which version a replayed learner is rebuilt to."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from slipstream.rl import recovery
from slipstream.rl.coordinator import ActorDiedError
from slipstream.rl.run import Run


def a_run(policy_version: int, dead: dict[str, str]) -> Run:
    """A Run at step 3 of a run resumed at step 1 (steps 1 and 2 recorded), without its processes."""
    run = Run.__new__(Run)
    run.coord = SimpleNamespace(policy_version=policy_version, dead=dead, learners=["learner:0"])  # type: ignore[assignment]
    run.cfg, run.run_dir, run.specs, run.start = None, None, [], 1  # type: ignore[assignment]
    run.records = [SimpleNamespace(step=0), SimpleNamespace(step=1), SimpleNamespace(step=2)]  # type: ignore[list-item]
    return run


def test_the_loop_replays_to_the_steps_recorded_the_coordinator_to_the_rollouts_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replayed: list[int] = []

    async def replay(coord: Any, cfg: Any, run_dir: Any, specs: Any, version: int) -> None:
        replayed.append(version)

    monkeypatch.setattr(recovery, "replay_learner", replay)
    dead = {"learner:0": "killed by SIGKILL"}
    # The loop caught the death in step 3 (its sync done: the rollouts hold v4): back to v3, then step 3
    # trains again.
    asyncio.run(a_run(4, dead).recover_learners(ActorDiedError("learner:0 died")))
    # The coordinator re-pushing v4 to a restarted rollout: the learner must hold v4 (step 3's samples are
    # on disk before it trains).
    asyncio.run(a_run(4, dead).recover_learners())
    assert replayed == [3, 4]
    # A death that was not a learner's is not the loop's to recover.
    with pytest.raises(ActorDiedError, match="rollout:0"):
        asyncio.run(a_run(4, {}).recover_learners(ActorDiedError("rollout:0 died")))
