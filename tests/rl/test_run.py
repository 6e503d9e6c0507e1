"""The run's learner recovery (rl/run.py): which version a replayed learner is rebuilt to."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from slipstream.rl import recovery
from slipstream.rl.coordinator import ActorDiedError
from slipstream.rl.run import Run
from slipstream.rl.run_dir import StepRecord
from slipstream.rl.step_work import step_line


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


def a_record(**fields: Any) -> StepRecord:
    base = {
        "step": 0, "reward_mean": 0.5, "correct_share": 0.25, "nonzero_adv_share": 1.0, "invalid": 0,
        "tokens": 96, "mean_response_tokens": 8.0, "step_s": 10.0, "rollout_s": 6.0, "reward_s": 0.4,
        "learn_s": 3.0, "sync_s": 0.5, "accept_length": 1.0, "arms": {}, "idle_device_s": 0.0,
        "reclaimed_s": 0.0, "loss": 0.1, "grad_norm": 1.0, "mismatch_logp_abs_max": 0.0, "policy_version": 1,
    }  # fmt: skip
    return StepRecord(**{**base, **fields})


def test_the_step_line_shows_the_reward_calls_share_of_the_step() -> None:
    terms = {
        "judge": {"calls": 3, "samples": 12, "seconds": 1.2, "batch_mean": 4.0, "batch_max": 8, "invalid": 0}
    }
    line = step_line(a_record(reward_call_s=1.2, reward_terms=terms), 10)
    assert line == (
        "step 1/10  reward 0.500  correct 0.250  96 tok  "
        "10.0 s (rollout 6.0, reward 0.4, learn 3.0, sync 0.5)  reward calls 12%  no speculation"
    )
    # Parallel workers' seconds add up: the share can pass 100%.
    assert "  reward calls 240%  " in step_line(a_record(reward_call_s=24.0, reward_terms=terms), 10)
    # A record without the calls (a verifier that reported none, an older run) says nothing of them.
    assert "reward calls" not in step_line(a_record(), 10)
