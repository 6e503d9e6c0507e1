"""The environment actor's contract, driven in-process: a good episode (sync and async replies), and ones
that raise, hang or answer garbage — each answered with an error (that sample invalid) while the others
are served; a turn for an episode it does not hold is answered `unknown`; EnvironmentUp at start."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec

from slipstream.actors.environment import EnvironmentActor
from slipstream.protocols.environment import (
    Answer,
    EnvironmentUp,
    EpisodeOpened,
    OpenEpisode,
    RolloutUp,
    Turn,
)
from slipstream.runtime.inbox import Inbox
from slipstream.tasks.datasets import Row
from slipstream.tasks.environments import Observation
from tests.actors.test_rollout_actor import Captured


class Flaky:
    """Behaves as its question says: "ok", "async", "raise", "hang", "garbage", "slow" (answers in 0.3 s)."""

    stop_sequences = ("</call>",)

    def __init__(self, row: Row) -> None:
        self.mode = row.question

    def opening(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.mode}]

    def reply(self, turn: str) -> Any:
        if self.mode == "raise":
            raise ZeroDivisionError("planted")
        if self.mode == "hang":
            time.sleep(2.0)
        if self.mode == "slow":
            time.sleep(0.3)
        if self.mode == "garbage":
            return {"text": "not an Observation"}
        if self.mode == "async":
            return self._later(turn)
        return Observation(text=f"echo {turn}", done=turn == "last", reward=1.0 if turn == "last" else None)

    async def _later(self, turn: str) -> Observation:
        await asyncio.sleep(0.01)
        return Observation(text="later", done=True, reward=0.5)


def test_episodes_good_and_bad_are_answered_and_the_actor_serves_on() -> None:
    out = Captured()
    cfg = msgspec.convert(
        {"env": "tests.actors.test_environment_actor:Flaky", "turn_timeout_s": 0.5, "notify": ["rollout:0"]},
        EnvironmentActor.Config,
    )
    env = EnvironmentActor(cfg, rank=0, outbox=out, inbox=Inbox(8))
    env.on_start()
    try:
        (up,) = out.of(EnvironmentUp)
        modes = ["ok", "async", "raise", "hang", "garbage"]
        for mode in modes:
            env.on_open(OpenEpisode(episode_id=mode, row_json=json.dumps({"question": mode})), "rollout:0")
        wait(env, out, EpisodeOpened, len(modes))
        opened = {m.episode_id: m for m in out.of(EpisodeOpened)}
        assert all(m.error is None and m.incarnation == up.incarnation for m in opened.values())
        assert opened["ok"].stop_sequences == ["</call>"] and opened["ok"].messages[0].content == "ok"
        for mode in modes:
            env.on_turn(Turn(episode_id=mode, turn=0, text="first"), "rollout:0")
        env.on_turn(Turn(episode_id="never-opened", turn=0, text="x"), "rollout:0")
        wait(env, out, Answer, len(modes) + 1)
        answers = {a.episode_id: a for a in out.of(Answer)}
        assert answers["ok"].text == "echo first" and not answers["ok"].done and answers["ok"].error is None
        assert answers["async"].done and answers["async"].reward == 0.5
        assert "ZeroDivisionError" in (answers["raise"].error or "")
        assert "timeout" in (answers["hang"].error or "")
        assert "garbage" in (answers["garbage"].error or "")
        assert answers["never-opened"].unknown
        # The good episode goes on; the failed ones are dropped (a turn for them is now unknown).
        env.on_turn(Turn(episode_id="ok", turn=1, text="last"), "rollout:0")
        env.on_turn(Turn(episode_id="raise", turn=1, text="again"), "rollout:0")
        wait(env, out, Answer, len(modes) + 3)
        last = out.of(Answer)[-2:]
        by_id = {a.episode_id: a for a in last}
        assert by_id["ok"].done and by_id["ok"].reward == 1.0 and by_id["raise"].unknown
        bad = env.on_open(OpenEpisode(episode_id="x", row_json="{not json"), "rollout:0")
        assert bad is None and "malformed row" in (out.of(EpisodeOpened)[-1].error or "")
    finally:
        env.on_stop()


def test_a_restarted_rollouts_predecessor_episodes_are_dropped_in_flight_too() -> None:
    """RolloutUp from a new process of rollout:0 drops every episode its dead predecessor held (issue 42,
    step 3), one whose reply is running included: that reply is neither sent nor kept when it returns."""
    out = Captured()
    cfg = msgspec.convert({"env": "tests.actors.test_environment_actor:Flaky"}, EnvironmentActor.Config)
    env = EnvironmentActor(cfg, rank=0, outbox=out, inbox=Inbox(8))
    env.on_start()
    try:
        modes = {"rollout:0@old/1:0/0": "ok", "rollout:0@old/1:1/0": "slow", "rollout:10@x/2:0/0": "ok",
                 "rollout:0@new/1:0/0": "ok"}  # fmt: skip
        for episode_id, mode in modes.items():
            env.on_open(
                OpenEpisode(episode_id=episode_id, row_json=json.dumps({"question": mode})), "rollout:0"
            )
        wait(env, out, EpisodeOpened, len(modes))
        env.on_turn(Turn(episode_id="rollout:0@old/1:1/0", turn=0, text="first"), "rollout:0")
        assert env.busy == {"rollout:0@old/1:1/0"}  # its reply runs for 0.3 s
        env.on_rollout_up(RolloutUp(owner="rollout:0", incarnation="new"), "rollout:0")
        # rollout:10's episode is not rollout:0's (the owner ends at "@"), nor is the new process's.
        assert set(env.episodes) == {"rollout:10@x/2:0/0", "rollout:0@new/1:0/0"}
        assert env.counts["orphans"] == 2
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            env.step()
            time.sleep(0.01)
        assert out.of(Answer) == [] and not env.busy and not env.closed
        assert set(env.episodes) == {"rollout:10@x/2:0/0", "rollout:0@new/1:0/0"}
        env.on_turn(Turn(episode_id="rollout:0@old/1:0/0", turn=0, text="x"), "rollout:0")
        assert out.of(Answer)[-1].unknown
    finally:
        env.on_stop()


def wait(env: EnvironmentActor, out: Captured, kind: type, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(out.of(kind)) < n:
        assert time.monotonic() < deadline, f"{len(out.of(kind))} of {n} {kind.__name__}"
        if not env.step():
            time.sleep(0.005)
