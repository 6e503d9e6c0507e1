"""Reward channel: completions to score in, rewards (or a recorded reward error) out.

A reward that raised or timed out still produces a `Reward` — with `error` set and reward 0 — so a
bad reward function costs one sample, never the run.
"""

from enum import StrEnum
from typing import Annotated

import msgspec

from slipstream.protocols.base import Message, NonNeg


class RewardKind(StrEnum):
    SCORE = "reward.score"
    REWARD = "reward.reward"


class ScoreRequest(Message, frozen=True, kw_only=True):
    """→ verifier: score one response against the task's reference (`answer`, `metadata` as JSON text)."""

    kind = RewardKind.SCORE
    group_id: NonNeg
    sample_index: NonNeg
    prompt: str
    response: str
    answer: str
    metadata_json: str = "{}"
    policy_version: NonNeg


class Reward(Message, frozen=True, kw_only=True):
    """Verifier → coordinator: the reward, or the error that replaced it."""

    kind = RewardKind.REWARD
    group_id: NonNeg
    sample_index: NonNeg
    reward: float
    error: str | None = None
    elapsed_s: Annotated[float, msgspec.Meta(ge=0.0)]
    policy_version: NonNeg


MESSAGES: tuple[type[Message], ...] = (ScoreRequest, Reward)

__all__ = [m.__name__ for m in MESSAGES] + ["MESSAGES", "RewardKind"]
