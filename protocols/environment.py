"""Environment channel (issue 42): a rollout's episodes and the environment actor that hosts them.

Rollouts talk to an environment actor directly, never through the coordinator (bulk text, many turns per
sample). `OpenEpisode` starts one sample's episode from its dataset row, answered by `EpisodeOpened` (the
first messages and the turn's stop sequences); each policy turn goes as a `Turn` and comes back as an
`Answer` (an observation, done, and a reward at the end), or with `error` when the episode raised, hung
or answered garbage (the sample is then invalid: masked, never scored 0). `CloseEpisode` drops one the
rollout ended itself (a cap). An actor answers a turn for an episode it does not hold with `unknown`,
and says `EnvironmentUp` with a fresh `incarnation` to its rollouts at start: after a restart, episodes
held by the process before are lost and the rollout replays them from their start with the same seeds.
A rollout in turn says `RolloutUp` at start: episodes of its earlier processes are dropped there at once.
"""

import sys
from enum import StrEnum
from typing import Annotated

import msgspec

from slipstream.protocols.base import Message, NonNeg, NonNegF

Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]


class EnvironmentKind(StrEnum):
    OPEN = "environment.open"
    OPENED = "environment.opened"
    TURN = "environment.turn"
    ANSWER = "environment.answer"
    CLOSE = "environment.close"
    UP = "environment.up"
    ROLLOUT_UP = "environment.rollout_up"


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str


class OpenEpisode(Message, frozen=True, kw_only=True):
    """Rollout → environment: start episode `episode_id` from a dataset row (JSON text: rows are any JSON)."""

    kind = EnvironmentKind.OPEN
    episode_id: str
    row_json: str


class EpisodeOpened(Message, frozen=True, kw_only=True):
    """Environment → rollout: the episode's first messages (the prompt) and what ends a policy turn early;
    or `error` (the factory raised or gave garbage): the sample is invalid."""

    kind = EnvironmentKind.OPENED
    episode_id: str
    messages: list[ChatMessage] = []
    stop_sequences: list[str] = []
    error: str | None = None
    incarnation: str = ""  # the answering process (EnvironmentUp's)


class Turn(Message, frozen=True, kw_only=True):
    """Rollout → environment: the policy's turn `turn` (0-based) of an episode, as text and token ids."""

    kind = EnvironmentKind.TURN
    episode_id: str
    turn: NonNeg
    text: str
    token_ids: list[int] = []


class Answer(Message, frozen=True, kw_only=True):
    """Environment → rollout: the observation to append (as a message of `role`), whether the episode is
    done and its reward (None: the run's reward scores the transcript); `error`: the sample is invalid;
    `unknown`: this process holds no such episode (it restarted): replay it."""

    kind = EnvironmentKind.ANSWER
    episode_id: str
    turn: NonNeg
    text: str = ""
    role: str = "tool"
    done: bool = False
    reward: Finite | None = None
    error: str | None = None
    unknown: bool = False
    elapsed_s: NonNegF = 0.0  # the environment's time on this turn (reply and deadline)


class CloseEpisode(Message, frozen=True, kw_only=True):
    """Rollout → environment: the rollout ended the episode itself (a cap, a replay): drop its state."""

    kind = EnvironmentKind.CLOSE
    episode_id: str


class EnvironmentUp(Message, frozen=True, kw_only=True):
    """Environment → its rollouts, once at start: a new process (`incarnation`) that holds no episodes."""

    kind = EnvironmentKind.UP
    incarnation: str


class RolloutUp(Message, frozen=True, kw_only=True):
    """Rollout → its environment, once at start: a new process of rollout `owner` (its name), whose episode
    ids begin `owner@incarnation/`. Episodes of the owner's earlier processes (a dead rollout's) are
    dropped, never answered: they would otherwise be held until the environment restarts."""

    kind = EnvironmentKind.ROLLOUT_UP
    owner: str
    incarnation: str


MESSAGES: tuple[type[Message], ...] = (
    OpenEpisode, EpisodeOpened, Turn, Answer, CloseEpisode, EnvironmentUp, RolloutUp,
)  # fmt: skip

__all__ = [m.__name__ for m in MESSAGES] + ["MESSAGES", "ChatMessage", "EnvironmentKind"]
