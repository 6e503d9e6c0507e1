"""A test environment for real multi-turn runs with a tiny random model (which never writes a tool call):
every episode takes `turns` policy turns, each answered with an observation, and ends with a reward from
its last turn's text — or None for a row whose answer is even, so the run's reward scores the transcript.

`kill_marker`: at its first reply, if that file does not exist yet, the episode creates it and SIGKILLs its
own process (the environment actor): a real death mid-episode, once per run."""

from __future__ import annotations

import os
import signal
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
