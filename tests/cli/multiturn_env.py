"""A test environment for real multi-turn runs with a tiny random model (which never writes a tool call):
every episode takes `turns` policy turns, each answered with an observation, and ends with a reward from
its last turn's text — or None for a row whose answer is even, so the run's reward scores the transcript.

`kill_marker`: at its first reply, if that file does not exist yet, the episode creates it and SIGKILLs its
own process (the environment actor): a real death mid-episode, once per run.

`SlowOne`: a Relay slow for one sample (tests/cli/test_multiturn_processes.py): the episode that replies
first in its process holds its first answer until the process's other episodes have ended."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field

from slipstream.tasks.datasets import Row
from slipstream.tasks.environments import Observation


def env_reward(last_turn: str) -> float:
    """What `Relay` rewards an episode with (a test recomputes it from the recorded turn)."""
    return 0.25 + (len(last_turn) % 3) / 4


@dataclass
class Relay:
    row: Row
    turns: int = 2
    kill_marker: str = ""
    stop_sequences: tuple[str, ...] = ()
    taken: int = field(default=0, init=False)

    def opening(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.row.question}]

    def reply(self, turn: str) -> Observation:
        if self.kill_marker and not os.path.exists(self.kill_marker):
            open(self.kill_marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        self.taken += 1
        if self.taken < self.turns:
            return Observation(text=f"result {self.taken}")
        scored_here = int(str(self.row.answer)) % 2 == 1
        return Observation(text="", done=True, reward=env_reward(turn) if scored_here else None)


_slow: list[SlowOne] = []  # the one slow episode of this environment process (the first to reply)
_ended = [0]  # episodes of this process, the slow one aside, that gave their last answer


@dataclass
class SlowOne(Relay):
    """A Relay whose first-replying episode (one a process) holds its first answer until `others` other
    episodes have ended, or `max_wait_s` passed. Waiting on the others rather than for a fixed time keeps the
    test independent of the host's speed: a rollout that decodes the others meanwhile ends the wait early,
    one that stalls behind the slow sample runs into `max_wait_s`. A coroutine, so the environment actor's
    loop answers the other episodes while it waits."""

    others: int = 0
    max_wait_s: float = 60.0

    async def reply(self, turn: str) -> Observation:
        if not _slow:
            _slow.append(self)
            deadline = time.monotonic() + self.max_wait_s
            while _ended[0] < self.others and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        answer = Relay.reply(self, turn)
        if answer.done and self is not _slow[0]:
            _ended[0] += 1
        return answer
